"""Prompt-lookup branches in the stream tree: the lookup finds what a scan of the text finds, the
merged tree holds every branch as a path and keeps the stream tree, and decoding with branches
stays exactly one-token-per-pass decoding (greedy, and seeded sampling) while accepting paths
deeper than the streams can draft."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS, make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding import generate, generate_autoregressive
from streamspec.decoding.lookup import (
    NgramIndex,
    PromptLookup,
    StreamTreeOnHost,
    merge_branches,
    pick_branches,
    recent_occurrences,
)
from streamspec.decoding.session import DecodingSession
from streamspec.decoding.tree import build_tree, tree_from_parents

pytestmark = pytest.mark.usefixtures("single_thread")


def _scan(text, lookup):
    """The lookup by brute force: for n from long to short, the latest earlier occurrences of the
    last n tokens (as many as the index looks at), most recent first; then `pick_branches`."""
    candidates = []
    for n in range(min(lookup.ngram, len(text)), lookup.min_ngram - 1, -1):
        suffix = text[len(text) - n :]
        stops = [stop for stop in range(len(text) - 1, n - 1, -1) if text[stop - n : stop] == suffix]
        candidates += [text[stop : stop + lookup.tokens] for stop in stops[: recent_occurrences(lookup)]]
    return pick_branches(candidates, lookup)


def test_branches_prefer_whole_length_and_skip_prefixes():
    lookup = PromptLookup(tokens=3, matches=2, ngram=1)
    assert pick_branches([[1], [1, 2], [1, 2, 3], [4, 5, 6], [7, 8, 9]], lookup) == [[1, 2, 3], [4, 5, 6]]
    assert pick_branches([[1], [1, 2], [], [5]], lookup) == [[1, 2], [5]]
    index = NgramIndex(1)
    index.extend([9] * 10)  # a run: the latest occurrences have 1, 2, ... tokens after them
    assert index.continuations(lookup) == [[9, 9, 9]]


@pytest.mark.parametrize("lookup", [PromptLookup(4, 3, 3), PromptLookup(2, 5, 2, min_ngram=2), PromptLookup(6, 1, 1)])
def test_the_index_finds_what_a_scan_finds(lookup):
    rng = random.Random(0)
    for _ in range(60):
        text = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        index = NgramIndex(lookup.ngram)
        cut = rng.randrange(len(text) + 1)
        index.extend(text[:cut])  # grown in two pieces, as decoding grows it
        index.extend(text[cut:])
        assert index.continuations(lookup) == _scan(text, lookup)


def test_merging_keeps_the_stream_tree_and_adds_each_branch_as_a_path():
    tree = StreamTreeOnHost.of((2, 1))  # root; 2 candidates; 1 below each
    assert list(tree.parent) == build_tree((2, 1), 2).parent.tolist()
    tokens = tree.tokens(7, [[3, 4], [5, 6]])
    assert tokens == [7, 3, 4, 5, 5]
    branches = [[3, 5, 9, 9], [4, 1], [8]]
    parent, merged = merge_branches(list(tree.parent), tokens, branches)
    assert parent[: len(tree.parent)] == list(tree.parent) and merged[: len(tokens)] == tokens
    children = {}
    for node in range(1, len(parent)):
        assert (parent[node], merged[node]) not in children, "two children with one token"
        children[(parent[node], merged[node])] = node
    for branch in branches:  # each branch is a path from the root
        node = 0
        for token in branch:
            node = children[(node, token)]
    assert len(parent) == 5 + 2 + 1 + 1  # 3,5 shared; 9,9 new; 4 shared, 1 new; 8 new
    small, _ = merge_branches(list(tree.parent), tokens, branches, budget=6)
    assert len(small) == 6
    built = tree_from_parents(parent, 2, (2, 1))
    assert built.depth_limit == 4 and built.depth.tolist()[-1] == 1
    for node in range(len(parent)):
        assert built.ancestors[node].nonzero().flatten().tolist() == sorted(built.path_to(node))


@pytest.fixture(scope="module", params=ARCHS)
def looping(request):
    """A random streamed model whose greedy text repeats itself (so lookups find continuations)."""
    torch.manual_seed(0)
    model = add_streams(make_model(request.param, seed=1), StreamConfig(num_streams=2, stream_layers=2)).eval()
    return model


@pytest.mark.parametrize("tree", [1, (2, 1)])
def test_greedy_with_lookup_equals_one_token_per_pass(looping, tree):
    deeper = 0
    for seed in range(4):
        ids = random_ids(1, 12, seed=seed)
        reference = generate_autoregressive(looping, ids, 40)
        out = generate(looping, ids, 40, tree_top_k=tree, lookup=PromptLookup(tokens=6, matches=2))
        assert torch.equal(out.tokens, reference)
        deeper += sum(n > 1 + 2 for n in out.accepted_per_pass)  # longer than the streams can draft
    assert deeper > 0, "no pass accepted a lookup branch: the test did not exercise them"


def test_seeded_sampling_with_lookup_equals_one_token_per_pass(looping):
    for seed in range(4):
        ids = random_ids(1, 10, seed=seed)
        kwargs = dict(temperature=0.7, seed=seed)
        reference = generate(looping, ids, 30, speculative=False, **kwargs).tokens
        out = generate(looping, ids, 30, tree_top_k=(2, 1), lookup=PromptLookup(5, 2), **kwargs)
        assert torch.equal(out.tokens, reference)


def test_a_session_looks_up_in_its_whole_sequence(looping):
    ids = random_ids(1, 12, seed=5)[0].tolist()
    session = DecodingSession(looping, tree_top_k=1, lookup=PromptLookup(6, 2))
    session.extend(ids)
    first = session.generate(15).tokens
    second = session.generate(15).tokens
    reference = generate_autoregressive(looping, torch.tensor([ids]), 30)[0].tolist()
    assert first + second == reference


def test_bad_lookups_are_refused(looping):
    ids = random_ids(1, 5, seed=1)
    for bad in (dict(tokens=0), dict(matches=-1), dict(ngram=2, min_ngram=3), dict(budget=0), dict(tokens=True)):
        with pytest.raises(ValueError, match="lookup"):
            PromptLookup(**bad)
    with pytest.raises(ValueError, match="L\\[,M"):
        PromptLookup.parse("4,x")
    assert PromptLookup.parse("4,2") == PromptLookup(4, 2)
    with pytest.raises(TypeError, match="PromptLookup"):
        generate(looping, ids, 4, lookup=(4, 2))
    for kwargs in (dict(prune_threshold=0.1), dict(speculative=False)):  # compiled, they run padded
        with pytest.raises(ValueError, match="lookup branches"):
            generate(looping, ids, 4, lookup=PromptLookup(), **kwargs)
    with pytest.raises(ValueError, match="lookup branches"):
        generate(looping, torch.cat([ids, ids]), 4, lookup=PromptLookup())
    with pytest.raises(ValueError, match="streamed models"):
        DecodingSession(looping.hf_model, lookup=PromptLookup())
