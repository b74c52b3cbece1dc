"""The decode step runs on the device: at most one device-to-host read per forward pass (to learn
what was accepted and whether to stop), for one token per pass, chains, trees, sampling and
batches; pruning adds one (the number of nodes kept). Reads are counted with a dispatch mode
that sees every op whose result the host must wait for (a scalar read, a data-dependent shape,
a copy to the CPU from another device) and every `Tensor.tolist`/`numpy` call."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding.cache import RowCache
from streamspec.decoding import generate
from streamspec.patch.layout import row_allowed
from streamspec.decoding.lookup import PromptLookup
from streamspec.decoding.session import DecodingSession
from streamspec.decoding.tree import accepted_nodes, build_tree, deepest_path

pytestmark = pytest.mark.usefixtures("single_thread")

aten = torch.ops.aten
# Ops whose result the host has to wait for: a scalar read, or an output whose size depends on
# the data.
WAITING_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal,
               aten.unique_dim, aten._unique2, aten.unique_consecutive, aten.repeat_interleave}


class HostReads(TorchDispatchMode):
    """Counts the reads from the device an op sequence makes (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in WAITING_OPS:
            self.reads.append(str(func))
        elif func.overloadpacket in (aten._to_copy, aten.copy_):
            source = args[1] if func.overloadpacket is aten.copy_ else args[0]
            target = args[0].device if func.overloadpacket is aten.copy_ else kwargs.get("device")
            if isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None \
                    and torch.device(target).type == "cpu":
                self.reads.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def count_reads(monkeypatch):
    """Yields a `HostReads` that also counts `Tensor.tolist` and `Tensor.numpy` (they read the
    data without an aten op)."""
    mode = HostReads()
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if mode.active:
                mode.reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return mode


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    streamed = add_streams(make_model("llama"), StreamConfig(num_streams=3, stream_layers=2)).eval()
    with torch.no_grad():  # streams that agree with the main stream now and then: varied accepted depths
        streamed.streams.stream_embeddings.mul_(0.1)
    return streamed


def _bound_holds(mode: HostReads, passes: int, per_pass: int = 1, per_call: int = 0) -> None:
    assert passes >= 4, "too few passes for the bound to mean anything"
    assert len(mode.reads) <= per_pass * passes + per_call, (len(mode.reads), passes, mode.reads)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("tree", [1, (2, 1, 1), 3])
def test_one_read_per_pass_for_one_sequence(model, count_reads, temperature, tree):
    ids = random_ids(1, 9, seed=1)
    with count_reads:
        out = generate(model, ids, 20, tree_top_k=tree, temperature=temperature, seed=0, verify="device")
    _bound_holds(count_reads, out.forward_passes)


def test_one_read_per_pass_one_token_per_pass(model, count_reads):
    with count_reads:
        out = generate(model, random_ids(1, 9, seed=2), 12, speculative=False)
    _bound_holds(count_reads, out.forward_passes)


def test_pruning_reads_the_kept_count_once_more(model, count_reads):
    with count_reads:
        out = generate(model, random_ids(1, 9, seed=3), 20, tree_top_k=3, prune_threshold=0.05, verify="device")
    _bound_holds(count_reads, out.forward_passes, per_pass=2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_read_per_pass_for_a_batch(model, count_reads, temperature):
    ids = random_ids(3, 9, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    mask[2, -2:] = 0  # a right-padded row
    with count_reads:
        out = generate(model, ids, 16, attention_mask=mask, temperature=temperature, seed=0, verify="device")
    _bound_holds(count_reads, out.forward_passes, per_call=1)  # +1: the mask's check for an empty row


def test_lookup_branches_keep_one_read_per_pass(model, count_reads):
    """The pass's read carries the next stream candidates too (the host merges the branches into
    them); per call, the prompt and the first candidates are read once."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with count_reads:
        out = generate(model, ids, 20, tree_top_k=(2, 1, 1), lookup=PromptLookup(4, 2), verify="device")
    _bound_holds(count_reads, out.forward_passes, per_call=2)


def test_confidence_trees_keep_one_read_per_pass(model, count_reads):
    """The pass's read carries the next candidates and their scores (the host grows the tree)."""
    with count_reads:
        out = generate(model, random_ids(1, 9, seed=6), 20, tree_top_k=3, tree_budget=6, verify="device")
    _bound_holds(count_reads, out.forward_passes, per_call=2)


def test_one_read_per_pass_in_a_session(model, count_reads):
    session = DecodingSession(model, tree_top_k=(2, 1, 1), verify="device")
    session.extend(random_ids(1, 9, seed=5)[0].tolist())
    with count_reads:
        out = session.generate(20)
    _bound_holds(count_reads, out.forward_passes)


@pytest.mark.parametrize("kwargs", [dict(), dict(temperature=0.8, top_p=0.9, seed=3), dict(prune_threshold=0.05),
                                    dict(lookup=PromptLookup(4, 2)), dict(tree_top_k=1)])
def test_device_step_and_host_walk_decode_the_same(model, kwargs):
    """`verify="device"` and `verify="host"` are two ways to the same tokens (and passes)."""
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    outs = [generate(model, ids, 24, verify=verify, **kwargs) for verify in ("device", "host")]
    assert torch.equal(outs[0].tokens, outs[1].tokens) and outs[0].accepted_per_pass == outs[1].accepted_per_pass
    reference = generate(model, ids, 24, speculative=False, **{k: v for k, v in kwargs.items() if k in ("temperature", "top_p", "seed")})
    assert torch.equal(outs[0].tokens, reference.tokens)
    batch = torch.cat([ids, ids.flip(1)])
    fused, split = (generate(model, batch, 12, verify=verify) for verify in ("device", "host"))
    assert torch.equal(fused.tokens, split.tokens)


def test_the_counter_sees_reads(count_reads):
    """The bound above can fail: the old host-driven walk (an int() per node) is counted."""
    x = torch.arange(5)
    with count_reads:
        int(x[2])
        x.nonzero()
        x.tolist()
        bool(x.sum() > 3)
    assert len(count_reads.reads) == 4


# -- the pieces, on their own -------------------------------------------------------------------
def test_accepted_nodes_and_deepest_path_match_a_walk():
    tree = build_tree((2, 2, 1), 3)
    gen = torch.Generator().manual_seed(0)
    children = tree.children()
    for _ in range(200):
        shift = torch.randint(0, 3, (tree.size,), generator=gen)
        tokens = (tree.rank + shift[tree.parent.clamp(min=0)]) % 3  # siblings distinct, as top-k candidates are
        choice = torch.randint(0, 3, (tree.size,), generator=gen)
        node, walk = 0, [0]  # the host walk: first child holding the chosen token
        while True:
            nxt = next((c for c in children[node] if int(tokens[c]) == int(choice[node])), None)
            if nxt is None:
                break
            node = nxt
            walk.append(node)
        accepted = accepted_nodes(tree, tokens, choice)
        best, path = deepest_path(tree, accepted)
        depth = int(tree.depth[best])
        assert path[: depth + 1].tolist() == tree.path_to(int(best))
        assert path[: depth + 1].tolist() == walk
        for i in range(tree.size):  # accepted == every node on its path confirmed
            expected = all(int(tokens[c]) == int(choice[p]) for p, c in zip(tree.path_to(i), tree.path_to(i)[1:]))
            assert bool(accepted[i]) == expected


def test_row_cache_keeps_each_row_contiguous():
    cache = RowCache(1, capacity=4)
    keys = torch.arange(2 * 3, dtype=torch.float).view(2, 1, 3, 1)  # B=2, 3 new entries
    k, _ = cache.update(keys, keys, 0)
    assert k.shape[-2] == 3
    cache.advance(torch.tensor([3, 3]), 3)
    cache.main_length = 2  # 2 main entries, then 1 that is not stored (a stream's)
    new = 100 + torch.arange(2 * 3, dtype=torch.float).view(2, 1, 3, 1)
    k, _ = cache.update(new, new, 0)
    assert k.shape[-2] == 3 + 2 + 1 and torch.equal(k[..., -1:, :], new[..., 2:, :])
    cache.advance(torch.tensor([1, 2]), 5)  # row 0 keeps one new entry, row 1 two
    cache.main_length = None
    k, _ = cache.update(new[..., :1, :] + 100, new[..., :1, :], 0)
    assert k[0, 0, :5, 0].tolist() == [0, 1, 2, 100, 200]  # row 0's rejected entry was overwritten
    assert k[1, 0, :6, 0].tolist() == [3, 4, 5, 103, 104, 203]
    allowed = row_allowed(torch.tensor([[False, True, True], [True, True, True]]), cache.row_lengths, 5, 1)
    assert allowed[0, 0].tolist() == [False, True, True, True, True, False]
    assert allowed[1, 0].tolist() == [True] * 6


HOST_FACTORIES = ("tensor", "as_tensor", "full", "zeros", "ones", "arange", "empty", "randint")
HOST_READS = ("tolist", "item", "numpy", "cpu", "__int__", "__bool__", "__float__", "__index__")


class HostWork:
    """What the host does around a loop's passes: the tensors it builds through torch's factory
    functions (`HOST_FACTORIES`) and its reads of tensor data (`HOST_READS`), not counted while a
    compiled graph runs (its own ops are the device's work). Works where a dispatch mode cannot:
    torch.compile refuses to trace under one."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.reads: list[str] = []
        self.active = False


@pytest.fixture
def host_work(monkeypatch):
    from streamspec.decoding import compiled

    work = HostWork()

    def counting(original, into, name):
        def counted(*args, **kwargs):
            if work.active:
                into.append(name)
            return original(*args, **kwargs)
        return counted

    for name in HOST_FACTORIES:
        monkeypatch.setattr(torch, name, counting(getattr(torch, name), work.built, name))
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), work.reads, name))
    make = compiled.compile_pass

    def uncounted_graphs(fn, backend, device_type):
        step = make(fn, backend, device_type)

        def call(*args):
            active, work.active = work.active, False
            try:
                return step(*args)
            finally:
                work.active = active
        return call

    monkeypatch.setattr(compiled, "compile_pass", uncounted_graphs)
    caches = (compiled._compiled_pass, compiled._compiled_host_pass, compiled._compiled_token_pass)
    for cache in caches:
        cache.cache_clear()
    yield work
    for cache in caches:
        cache.cache_clear()


def _per_pass(model, work: HostWork, generate_kwargs):
    """Reads and host-built tensors of one more pass: two generations of different lengths from
    the same prompt, the difference of their counts over the difference of their passes (what
    the prefill and the call's set-up cost cancels out)."""
    ids = random_ids(1, 9, seed=1)
    generate(model, ids, 24, **generate_kwargs)  # compiles, outside the counts
    counts = []
    for new in (8, 24):
        work.reads.clear()
        work.built.clear()
        work.active = True
        try:
            out = generate(model, ids, new, **generate_kwargs)
        finally:
            work.active = False
        counts.append((out.forward_passes, len(work.reads), len(work.built), out))
    (short, reads_short, built_short, _), (long, reads_long, built_long, out) = counts
    assert long - short >= 3, "too few passes apart for a count a pass to mean anything"
    return (reads_long - reads_short) / (long - short), (built_long - built_short) / (long - short), out


@pytest.mark.parametrize("options", [dict(tree_top_k=1), dict(tree_top_k=(2, 1, 1)), dict(speculative=False)],
                         ids=["chain", "tree", "one token"])
def test_compiled_passes_read_once_and_build_nothing_on_the_host(model, host_work, options):
    """Each compiled pass is one graph call, one device→host read (its state vector) and no
    tensor built on the host (the stored length, the root and the candidates stay on the
    device between passes; the cache commit runs in the graph)."""
    reads, built, out = _per_pass(model, host_work, dict(compile="aot_eager", **options))
    assert reads == 1, (reads, host_work.reads)
    assert built == 0, (built, host_work.built)
    assert out.host_reads == out.forward_passes  # the prefill's read, then one a pass
    assert out.graph_calls == out.forward_passes - 1


def test_host_built_trees_compiled_copy_once_and_read_once(model, host_work):
    """A tree built on the host (lookup branches, a confidence budget) goes to the device in one
    copy a pass (its tokens with the stored length), and comes back in one read."""
    from streamspec.decoding.lookup import PromptLookup

    reads, built, _ = _per_pass(model, host_work, dict(compile="aot_eager", tree_top_k=(2, 1, 1),
                                                      lookup=PromptLookup(4, 1)))
    assert reads == 1, (reads, host_work.reads)
    assert built == 1, (built, host_work.built)


@pytest.mark.parametrize("tree", [1, (2, 1, 1)])
def test_uncompiled_device_step_reads_once_a_pass(model, host_work, tree):
    """The uncompiled device step reads once a pass too (`GenerateOutput.host_reads` agrees)."""
    reads, _, out = _per_pass(model, host_work, dict(tree_top_k=tree, verify="device"))
    assert reads == 1, (reads, host_work.reads)
    assert out.host_reads == out.forward_passes and out.graph_calls == 0
