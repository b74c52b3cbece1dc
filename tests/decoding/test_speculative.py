"""Greedy speculative streaming: draft trees as pure tensors, and decoding that reproduces
autoregressive decoding exactly, with and without pruning, whatever the tree."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, hf_greedy, make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding import generate, generate_autoregressive
from streamspec.decoding.tree import build_tree, prune_by_transition

pytestmark = pytest.mark.usefixtures("single_thread")


# -- trees ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, depth", [(1, 3), (2, 2), (3, 3), (4, 1), (3, 0)])
def test_tree_shape(k, depth):
    tree = build_tree(k, depth)
    assert tree.size == sum(k**d for d in range(depth + 1))
    assert int(tree.parent[0]) == -1 and all(int(tree.parent[i]) < i for i in range(1, tree.size))
    for i in range(tree.size):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i and len(path) == int(tree.depth[i]) + 1
        expected = torch.zeros(tree.size, dtype=torch.bool)
        expected[path] = True
        assert torch.equal(tree.ancestors[i], expected)
    for parent in range(tree.size):  # siblings hold distinct ranks
        ranks = tree.rank[tree.parent == parent]
        assert len(set(ranks.tolist())) == len(ranks)


@pytest.mark.parametrize("shape", [(3, 1, 1), (2, 3), (1, 2, 1), (4,)])
def test_tree_shape_per_depth(shape):
    tree = build_tree(shape, 3)
    assert tree.top_k == shape and tree.depth_limit == len(shape)
    expected, width = 1, 1
    for k in shape:
        width *= k
        expected += width
    assert tree.size == expected
    for node in range(tree.size):  # a node of depth d has k_{d+1} children, with ranks 0..k-1
        children = (tree.parent == node).nonzero().flatten()
        depth = int(tree.depth[node])
        assert len(children) == (shape[depth] if depth < len(shape) else 0)
        assert sorted(tree.rank[children].tolist()) == list(range(len(children)))
    assert build_tree(3, 3).top_k == (3, 3, 3)


@pytest.mark.parametrize("bad", [0, (3, 0, 1), (1, 1, 1, 1), (), 2.0, (2, "1"), True])
def test_bad_tree_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="tree_top_k"):
        build_tree(bad, 3)


def test_tree_tokens_and_children():
    tree = build_tree(2, 2)  # nodes: 0; 1,2 (depth 1); 3,4 (under 1), 5,6 (under 2)
    candidates = torch.tensor([[10, 11], [20, 21]])
    tokens = tree.tokens(torch.tensor(5), candidates)
    assert tokens.tolist() == [5, 10, 11, 20, 21, 20, 21]
    # the verification walk moves from a node to the child holding the chosen token
    assert tree.children() == [[1, 2], [3, 4], [5, 6], [], [], [], []]
    sub = tree.subset(torch.tensor([0, 2, 5, 6]))
    assert sub.children() == [[1], [2, 3], [], []] and sub.num_parents == 2


def test_pruning_drops_subtrees_below_threshold():
    tree = build_tree(2, 2)
    tokens = torch.tensor([5, 10, 11, 20, 21, 20, 21])
    probs = torch.full((7, 30), 1e-6)
    probs[0, 10], probs[0, 11] = 0.6, 0.05  # node 2 (token 11) is unlikely: it and its subtree go
    probs[1, 20], probs[1, 21] = 0.3, 0.01  # under node 1, only node 3 (token 20) stays
    kept = prune_by_transition(tree, tokens, probs.log(), threshold=0.1)
    assert kept.tolist() == [0, 1, 3]
    sub = tree.subset(kept)
    assert sub.parent.tolist() == [-1, 0, 1] and sub.depth.tolist() == [0, 1, 2]
    assert prune_by_transition(tree, tokens, probs.log(), threshold=0.0).tolist() == list(range(7))


# -- exactness --------------------------------------------------------------------------------
SETTINGS = [(1, None), (3, None), (2, 0.01), (3, 0.2), ((3, 1, 1), None), ((1, 2, 1), 0.01)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_random_models_decode_exactly(arch, mode):
    for seed in range(3):
        model = add_streams(make_model(arch, seed), StreamConfig(stream_layers=2, mode=mode)).eval()
        prompt = random_ids(1, 3 + 2 * seed, seed)
        reference = generate_autoregressive(model, prompt, 16)
        for k, threshold in SETTINGS:
            out = generate(model, prompt, 16, tree_top_k=k, prune_threshold=threshold)
            assert torch.equal(out.tokens, reference), (seed, k, threshold)
        if mode == "lossless":
            assert torch.equal(reference, hf_greedy(model.base, prompt, 16))


@pytest.mark.parametrize("shape", [(2,), (3, 2), (1, 1)])
def test_shallow_trees_decode_exactly(shape):
    """A tree shallower than the streams (only the first streams draft) is exact too."""
    for seed in range(2):
        model = add_streams(make_model("qwen2", seed), StreamConfig(stream_layers=2)).eval()
        prompt = random_ids(1, 5, seed)
        out = generate(model, prompt, 12, tree_top_k=shape)
        assert torch.equal(out.tokens, generate_autoregressive(model, prompt, 12))


def _arithmetic(start: int, step: int, length: int) -> torch.Tensor:
    return (3 + (start - 3 + step * torch.arange(length)) % 98)[None]


@pytest.fixture(scope="module")
def counting_model():
    """A tiny model trained for a few seconds on arithmetic sequences, so its streams draft well
    and whole paths get accepted (random models accept almost nothing)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = add_streams(make_model("llama", 0), StreamConfig(stream_layers=2)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        starts, steps = torch.randint(3, 101, (16, 1)), torch.randint(1, 3, (16, 1))
        ids = 3 + (starts - 3 + steps * torch.arange(24)) % 98
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    return model.eval()


@pytest.mark.parametrize("k, threshold", SETTINGS)
def test_trained_streams_accept_long_paths_and_stay_exact(counting_model, k, threshold):
    prompt = _arithmetic(10, 2, 5)
    reference = generate_autoregressive(counting_model, prompt, 30)
    out = generate(counting_model, prompt, 30, tree_top_k=k, prune_threshold=threshold)
    assert torch.equal(out.tokens, reference)
    assert out.tokens_per_pass > 2.5, out.accepted_per_pass  # whole paths accepted: 1 + γ per pass at best
    assert sum(out.accepted_per_pass) >= out.tokens.shape[1]
    assert len(out.nodes_per_pass) == out.forward_passes - 1
    if threshold:
        assert all(after <= before for before, after in out.nodes_per_pass), out.nodes_per_pass
        pruned = [after < before for before, after in out.nodes_per_pass[1:]]
        # full trees lose nodes every pass; a 6-node tree only now and then
        assert all(pruned) if isinstance(k, int) else any(pruned), out.nodes_per_pass
    # every pass's time splits into layers, heads and the rest
    n = out.forward_passes
    assert len(out.forward_seconds_per_pass) == len(out.head_seconds_per_pass) == len(out.overhead_seconds_per_pass) == n
    for total, forward, head in zip(out.seconds_per_pass, out.forward_seconds_per_pass, out.head_seconds_per_pass):
        assert 0 < forward and 0 < head and forward + head <= total + 1e-9


@pytest.mark.parametrize("shape, threshold", [((2,), None), ((1, 2), None), ((2, 1), 0.01)])
def test_shallow_trees_accept_whole_paths_of_their_depth(counting_model, shape, threshold):
    """Streams that draft well fill a shallow tree: passes accept up to depth + 1 tokens, never
    more (the streams below the tree's depth are not drafted from)."""
    prompt = _arithmetic(10, 2, 5)
    out = generate(counting_model, prompt, 24, tree_top_k=shape, prune_threshold=threshold)
    assert torch.equal(out.tokens, generate_autoregressive(counting_model, prompt, 24))
    assert max(out.accepted_per_pass) == len(shape) + 1, out.accepted_per_pass


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_exact_inside_accepted_paths(counting_model, max_new_tokens):
    prompt = _arithmetic(40, 1, 6)
    reference = generate_autoregressive(counting_model, prompt, max_new_tokens)
    out = generate(counting_model, prompt, max_new_tokens)
    assert out.tokens.shape[1] == max_new_tokens and torch.equal(out.tokens, reference)


@pytest.mark.parametrize("position", [0, 3, 6, 9])
def test_eos_inside_accepted_paths(counting_model, position):
    prompt = _arithmetic(20, 1, 6)
    free = generate_autoregressive(counting_model, prompt, 20)
    eos = int(free[0, position])
    out = generate(counting_model, prompt, 20, eos_token_id=eos)
    assert torch.equal(out.tokens, free[:, : position + 1])
    assert torch.equal(out.tokens, generate_autoregressive(counting_model, prompt, 20, eos_token_id=eos))


def test_bad_arguments_are_refused():
    model = add_streams(make_model("llama"), StreamConfig(stream_layers=2)).eval()
    prompt = random_ids(1, 4, 0)
    cases = [
        (dict(input_ids=prompt[:, :0], max_new_tokens=4), "non-empty"),
        (dict(input_ids=prompt, max_new_tokens=0), "max_new_tokens"),
        (dict(input_ids=prompt, max_new_tokens=4, tree_top_k=0), "tree_top_k"),
        (dict(input_ids=prompt, max_new_tokens=4, tree_top_k=(2, 2, 2, 2)), "tree_top_k"),
        (dict(input_ids=prompt, max_new_tokens=4, prune_threshold=1.0), "prune_threshold"),
        (dict(input_ids=prompt, max_new_tokens=4, prune_threshold=-0.1), "prune_threshold"),
        (dict(input_ids=random_ids(1, 60, 0), max_new_tokens=10), "context"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(model, **kwargs)
    with pytest.raises(TypeError, match="StreamedModel"):
        generate(make_model("llama"), prompt, 4)
    # the one-token-per-pass reference checks its arguments the same way
    with pytest.raises(TypeError, match="StreamedModel"):
        generate_autoregressive(make_model("llama"), prompt, 4)
    with pytest.raises(ValueError, match="one sequence"):
        generate_autoregressive(model, random_ids(2, 4, 0), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_autoregressive(model, prompt, 0)


# -- batches ----------------------------------------------------------------------------------
def _padded(prompts, side):
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        n = p.shape[1]
        where = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, where], mask[i, where] = p[0], 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batches_equal_per_sequence_greedy(arch, side):
    model = add_streams(make_model(arch, 1), StreamConfig(stream_layers=2)).eval()
    prompts = [random_ids(1, n, seed=n) for n in (3, 7, 5)]
    ids, mask = _padded(prompts, side)
    out = generate(model, ids, 9, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        expected = generate_autoregressive(model, prompt, 9)
        assert out.lengths[row] == expected.shape[1]
        assert torch.equal(out.tokens[row : row + 1, : out.lengths[row]], expected), row


@pytest.mark.parametrize("side", ["left", "right"])
def test_batches_accept_paths_and_honour_eos(counting_model, side):
    prompts = [_arithmetic(10, 2, 5), _arithmetic(50, 1, 8), _arithmetic(30, 2, 3)]
    ids, mask = _padded(prompts, side)
    eos = int(generate_autoregressive(counting_model, prompts[1], 20)[0, 5])
    out = generate(counting_model, ids, 20, attention_mask=mask, eos_token_id=eos)
    for row, prompt in enumerate(prompts):
        expected = generate_autoregressive(counting_model, prompt, 20, eos_token_id=eos)
        assert torch.equal(out.tokens[row : row + 1, : out.lengths[row]], expected), row
    assert out.lengths[1] == 6  # stopped at the EOS inside an accepted path
    assert sum(out.lengths) / out.forward_passes > 2 * len(prompts), out.accepted_per_pass


def test_batch_arguments_are_checked():
    model = add_streams(make_model("llama"), StreamConfig(stream_layers=2)).eval()
    ids = random_ids(2, 4, 0)
    with pytest.raises(ValueError, match="single best path"):
        generate(model, ids, 4, tree_top_k=3)
    with pytest.raises(ValueError, match="single best path"):
        generate(model, ids, 4, prune_threshold=0.1)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(model, ids, 4, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="real token"):
        generate(model, ids, 4, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="single best path"):
        generate(model, ids, 4, tree_top_k=(1, 1))  # a shorter chain than the streams
    assert torch.equal(generate(model, ids, 4, tree_top_k=(1, 1, 1)).tokens, generate(model, ids, 4).tokens)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, ids[:0], 4)


def test_on_tokens_streams_exactly_the_output(counting_model):
    prompt = _arithmetic(20, 1, 6)
    eos = int(generate_autoregressive(counting_model, prompt, 20)[0, 6])
    for kwargs in (dict(max_new_tokens=7), dict(max_new_tokens=20, eos_token_id=eos), dict(max_new_tokens=9)):
        seen: list[int] = []
        out = generate(counting_model, prompt, on_tokens=seen.extend, **kwargs)
        assert seen == out.tokens[0].tolist(), kwargs


def test_autoregressive_statistics(counting_model):
    prompt = _arithmetic(10, 2, 5)
    out = generate(counting_model, prompt, 9, speculative=False)
    assert out.forward_passes == 9 and out.accepted_per_pass == [1] * 9 and out.nodes_per_pass == []
    assert len(out.seconds_per_pass) == 9 and out.tokens_per_pass == 1.0 and out.lengths is None
    for total, forward, head in zip(out.seconds_per_pass, out.forward_seconds_per_pass, out.head_seconds_per_pass):
        assert 0 < forward and 0 < head and forward + head <= total + 1e-9
