"""Trees shaped by confidence: `grow_tree` keeps the most probable paths within its budget, and
decoding with such trees stays exactly one-token-per-pass decoding (greedy and seeded sampling)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from conftest import ARCHS, make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding import generate, generate_autoregressive
from streamspec.decoding.lookup import PromptLookup
from streamspec.decoding.session import DecodingSession
from streamspec.decoding.tree import grow_tree

pytestmark = pytest.mark.usefixtures("single_thread")


def _paths(parent, rank):
    """Each node's rank path from the root."""
    paths = [()]
    for node in range(1, len(parent)):
        paths.append(paths[parent[node]] + (rank[node],))
    return paths


@pytest.mark.parametrize("depth, width", [(1, 4), (3, 2), (3, 3), (2, 5)])
def test_grown_trees_keep_the_most_probable_paths(depth, width):
    rng = random.Random(depth * 10 + width)
    for _ in range(30):
        scores = [sorted((-rng.random() * 4 for _ in range(width)), reverse=True) for _ in range(depth)]
        every = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
        for budget in (1, 2, 5, 9, 1 + len(every), 100):
            parent, depths, rank = grow_tree(scores, budget)
            assert len(parent) == min(budget, 1 + len(every))
            assert all(parent[n] < n for n in range(1, len(parent)))  # parents first
            paths = _paths(parent, rank)
            assert all(len(p) == d for p, d in zip(paths, depths)) and len(set(paths)) == len(paths)
            score = {p: sum(scores[i][r] for i, r in enumerate(p)) for p in every}
            chosen = set(paths[1:])
            if chosen and len(chosen) < len(every):  # nothing left out beats anything taken
                assert min(score[p] for p in chosen) >= max(score[p] for p in every if p not in chosen) - 1e-12


def test_a_budget_of_the_full_size_is_the_full_tree():
    from streamspec.decoding.tree import tree_lists

    parent, depth, rank = grow_tree([[-0.1, -2.0], [-0.5, -0.9]], 7)
    assert sorted(_paths(parent, rank)) == sorted(_paths(*tree_lists((2, 2))[::2]))


@pytest.fixture(scope="module", params=ARCHS)
def streamed(request):
    torch.manual_seed(0)
    return add_streams(make_model(request.param, seed=1), StreamConfig(num_streams=3, stream_layers=2)).eval()


@pytest.mark.parametrize("budget", [1, 4, 9])
def test_greedy_with_confidence_trees_equals_one_token_per_pass(streamed, budget):
    for seed in range(3):
        ids = random_ids(1, 10, seed=seed)
        reference = generate_autoregressive(streamed, ids, 30)
        for verify in ("host", "device"):
            out = generate(streamed, ids, 30, tree_top_k=3, tree_budget=budget, verify=verify)
            assert torch.equal(out.tokens, reference), (seed, verify)
            assert all(nodes <= budget for nodes, _ in out.nodes_per_pass)


def test_seeded_sampling_and_lookup_with_confidence_trees(streamed):
    ids = random_ids(1, 10, seed=4)
    kwargs = dict(temperature=0.8, seed=5)
    reference = generate(streamed, ids, 24, speculative=False, **kwargs).tokens
    out = generate(streamed, ids, 24, tree_top_k=2, tree_budget=5, lookup=PromptLookup(4, 1), **kwargs)
    assert torch.equal(out.tokens, reference)
    session = DecodingSession(streamed, tree_top_k=2, tree_budget=5)
    session.extend(ids[0].tolist())
    assert session.generate(12).tokens + session.generate(12).tokens == generate_autoregressive(streamed, ids, 24)[0].tolist()


def test_bad_budgets_are_refused(streamed):
    ids = random_ids(1, 5, seed=1)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="tree_budget"):
            generate(streamed, ids, 4, tree_budget=bad)
    for kwargs in (dict(prune_threshold=0.1), dict(speculative=False)):  # compiled, they run padded
        with pytest.raises(ValueError, match="tree_budget"):
            generate(streamed, ids, 4, tree_budget=4, **kwargs)
    with pytest.raises(ValueError):
        grow_tree([[-1.0]], 0)
