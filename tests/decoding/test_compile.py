"""`generate(..., compile=True)`: each draft-tree pass through torch.compile with static shapes
decodes exactly what the uncompiled path decodes (greedy and seeded sampling, llama and gpt2,
chain and tree), compiles once for a whole generation (the cache growing does not compile again,
nor does a new prompt length or seed), and refuses what it cannot do.

Inductor compilation is slow on a small CPU (tens of seconds per graph), so the inductor cases
are few and share their models (and so their compiled graphs); the other cases use the
"aot_eager" backend, which checks the same static-shape graph capture without C++ code
generation."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding import Sampler, generate, generate_autoregressive
from streamspec.decoding.session import DecodingSession

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


def _streamed(arch: str):
    torch.manual_seed(0)
    model = add_streams(make_model(arch), StreamConfig(num_streams=3, stream_layers=2)).eval()
    with torch.no_grad():  # streams that agree with the main stream now and then: varied accepted depths
        model.streams.stream_embeddings.mul_(0.1)
    return model


@pytest.fixture(scope="module")
def models():
    return {arch: _streamed(arch) for arch in ("llama", "gpt2")}


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("arch, tree, backend", [
    ("llama", (2, 1, 1), "inductor"),
    ("gpt2", (2, 1, 1), "inductor"),
    ("llama", 1, "aot_eager"),
    ("gpt2", 1, "aot_eager"),
    ("gpt2", 2, "aot_eager"),
])
def test_greedy_compiled_equals_uncompiled(models, arch, tree, backend):
    model = models[arch]
    ids = random_ids(1, 9, seed=1)
    expected = generate(model, ids, 24, tree_top_k=tree)
    before = _graphs()
    out = generate(model, ids, 24, tree_top_k=tree, compile=True if backend == "inductor" else backend)
    assert _graphs() - before <= 1, "more than one graph for one generation: the growing cache compiled again"
    assert out.tokens.tolist() == expected.tokens.tolist()
    assert out.tokens.tolist() == generate_autoregressive(model, ids, 24).tolist()
    assert out.accepted_per_pass == expected.accepted_per_pass
    assert out.tokens.shape[1] == 24


def test_no_recompilation_for_a_new_prompt_length_or_seed(models):
    """After the first pass compiled, further generations of the same model and tree compile
    nothing: not as the cache grows, nor for another prompt length or another seed."""
    model = models["llama"]
    generate(model, random_ids(1, 9, seed=1), 4, tree_top_k=(2, 1, 1), compile=True)  # compiled here (or before)
    before = _graphs()
    for length, seed in [(5, 0), (17, 3), (12, 4)]:
        out = generate(model, random_ids(1, length, seed=seed), 30, tree_top_k=(2, 1, 1), compile=True)
        assert out.tokens.shape[1] == 30
    assert _graphs() == before


def test_confidence_trees_share_a_graph_across_prompt_lengths(models, capfd):
    """A confidence-shaped tree (wide candidates, a small budget) reserves the cache its padded
    pass needs, rounded to a multiple of 256: two prompt lengths in one such size compile one
    graph (a capacity sized by the full (4,4,4) tree, 340 rows, made each of these prompts a
    buffer and a graph of its own), and both decode what the uncompiled loop decodes."""
    model = models["llama"]
    confidence = dict(tree_top_k=4, tree_budget=7)  # passes of 7 nodes, 28 rows: a 256-entry cache
    first, second = random_ids(1, 30, seed=11), random_ids(1, 36, seed=12)
    capfd.readouterr()
    out = generate(model, first, 20, compile="aot_eager", **confidence)
    assert out.tokens.tolist() == generate(model, first, 20, **confidence).tokens.tolist()
    err = capfd.readouterr().err  # (announced only where this process had not run that graph yet)
    assert "compiling the decode step" not in err or "trees of up to 7 nodes, cache of 256;" in err
    before = _graphs()
    out = generate(model, second, 20, compile="aot_eager", **confidence)
    assert _graphs() == before, "a new prompt length compiled a graph of its own"
    assert "compiling the decode step" not in capfd.readouterr().err
    assert out.tokens.tolist() == generate(model, second, 20, **confidence).tokens.tolist()


def test_seeded_sampling_compiled_equals_uncompiled(models):
    model = models["gpt2"]
    ids = random_ids(1, 7, seed=2)
    kwargs = dict(tree_top_k=(2, 1, 1), temperature=0.8, top_k=30, top_p=0.95)
    before = _graphs()
    for seed in (0, 5):  # a new seed is a tensor input: no new graph
        expected = generate(model, ids, 24, seed=seed, **kwargs)
        out = generate(model, ids, 24, seed=seed, compile=True, **kwargs)
        assert out.tokens.tolist() == expected.tokens.tolist()
        one_per_pass = generate_autoregressive(model, ids, 24, sampler=Sampler(0.8, 0.95, 30, seed=seed))
        assert out.tokens.tolist() == one_per_pass.tolist()
    assert _graphs() - before <= 1


@pytest.mark.parametrize("arch, backend", [("llama", "inductor"), ("gpt2", "aot_eager")])
def test_one_token_per_pass_compiled_equals_uncompiled(models, arch, backend, capfd):
    """speculative=False with compile: every pass after the prefill one compiled call, the same
    tokens as the uncompiled loop, one graph for the whole generation and for a new prompt length;
    the first call of the graph is announced on stderr, later ones are not."""
    model = models[arch]
    compile = True if backend == "inductor" else backend
    ids = random_ids(1, 9, seed=3)
    before = _graphs()
    capfd.readouterr()
    out = generate(model, ids, 20, speculative=False, compile=compile)
    err = capfd.readouterr().err
    assert "compiling the decode step (one token per pass, cache of 256" in err and "decode step ready in" in err
    assert out.tokens.tolist() == generate_autoregressive(model, ids, 20).tolist()
    assert out.forward_passes == 20 and out.accepted_per_pass == [1] * 20
    other = random_ids(1, 14, seed=4)
    assert generate(model, other, 20, speculative=False, compile=compile).tokens.tolist() == \
        generate_autoregressive(model, other, 20).tolist()
    assert "compiling" not in capfd.readouterr().err  # the same graph: nothing to announce
    assert _graphs() - before <= 1, "a new prompt length or the growing cache compiled again"
    sampler = dict(temperature=0.9, top_k=20, seed=7)
    sampled = generate(model, ids, 16, speculative=False, compile=compile, **sampler)
    assert sampled.tokens.tolist() == generate(model, ids, 16, speculative=False, **sampler).tokens.tolist()


@pytest.mark.parametrize("options", [dict(speculative=False), dict(tree_top_k=(2, 1, 1)),
                                     dict(tree_top_k=(2, 1, 1), lookup="6,2")])
def test_later_passes_skip_guards_but_never_mix_up_models_or_stances(options):
    """A loop's later passes run only the guards that tell cached graphs apart (after its first
    pass ran them all): two models of the same shape, alternated, each still decode their own
    tokens; a weight changed between generations is seen; a user's force_eager stance is kept."""
    from streamspec.decoding.lookup import PromptLookup

    options = {k: PromptLookup.parse(v) if k == "lookup" else v for k, v in options.items()}
    first, second = _streamed("llama"), _streamed("llama")
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = _repetitive_ids(seed=6)
    expected = {id(m): generate(m, ids, 20, **options).tokens.tolist() for m in (first, second)}
    assert expected[id(first)] != expected[id(second)]
    for model in (first, second, first, second):
        assert generate(model, ids, 20, compile="aot_eager", **options).tokens.tolist() == expected[id(model)]
    with torch.no_grad():
        second.streams.stream_embeddings.mul_(3.0)
    assert (generate(second, ids, 20, compile="aot_eager", **options).tokens.tolist()
            == generate(second, ids, 20, **options).tokens.tolist())
    with torch.compiler.set_stance("force_eager"):
        before = _graphs()
        assert generate(first, ids, 20, compile="aot_eager", **options).tokens.tolist() == expected[id(first)]
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    assert _graphs() == before


def _repetitive_ids(seed: int, length: int = 24):
    """A prompt that repeats itself, so that lookup branches are found (and accepted) often."""
    part = random_ids(1, 6, seed=seed)
    return torch.cat([part] * (length // 6), dim=1)


@pytest.mark.parametrize("arch, options, backend", [
    ("llama", dict(tree_top_k=(2, 1, 1), lookup="6,2"), "inductor"),
    ("gpt2", dict(tree_top_k=(2, 1, 1), lookup="6,2"), "aot_eager"),
    ("llama", dict(tree_top_k=1, lookup="8,1,2"), "aot_eager"),
    ("gpt2", dict(tree_top_k=3, tree_budget=6), "aot_eager"),
    ("llama", dict(tree_top_k=2, tree_budget=5, lookup="4,2"), "aot_eager"),
])
def test_host_built_trees_compiled_equal_uncompiled(models, arch, options, backend, capfd):
    """Lookup branches and confidence-grown trees compile too: each pass's tree padded to one of
    a few sizes, every size's graph compiled before the first pass (announced), the same tokens
    and accepted lengths as the uncompiled loop, and no graph more for another prompt."""
    from streamspec.decoding.compiled import host_tree_sizes
    from streamspec.decoding.config import DecodeConfig
    from streamspec.decoding.lookup import PromptLookup
    from streamspec.decoding.loop import _lookup_nodes, _tree

    model = models[arch]
    options = dict(options)
    if "lookup" in options:
        options["lookup"] = PromptLookup.parse(options["lookup"])
    compile = True if backend == "inductor" else backend
    ids = _repetitive_ids(seed=5)
    expected = generate(model, ids, 30, **options)
    capfd.readouterr()
    before = _graphs()
    out = generate(model, ids, 30, compile=compile, **options)
    err = capfd.readouterr().err
    assert out.tokens.tolist() == expected.tokens.tolist() == generate_autoregressive(model, ids, 30).tolist()
    assert out.accepted_per_pass == expected.accepted_per_pass
    if "lookup" in options:
        assert max(expected.accepted_per_pass) > 1 + model.num_drafts, "a lookup branch deeper than the streams must be accepted"
    shape = DecodeConfig(tree_top_k=options["tree_top_k"]).shape(model.num_drafts)
    stream_nodes = min(options.get("tree_budget") or 10 ** 6, _tree(shape).size)
    lookup = options.get("lookup")
    sizes = host_tree_sizes(stream_nodes, lookup, _lookup_nodes(stream_nodes, lookup) if lookup else stream_nodes)
    assert {n for n, _ in out.nodes_per_pass} <= set(sizes)  # every pass ran at one of the padded sizes
    assert _graphs() - before <= len(sizes) and err.count("compiling the decode step (trees of up to") <= len(sizes)
    other = _repetitive_ids(seed=6, length=18)
    again = _graphs()
    assert generate(model, other, 20, compile=compile, **options).tokens.tolist() == \
        generate(model, other, 20, **options).tokens.tolist()
    assert _graphs() == again, "every size was compiled with the first generation"


def test_lookup_and_confidence_trees_of_one_size_share_a_graph(models):
    """A lookup row and a confidence row whose trees pad to the same size run one compiled graph
    (`HOST_GRAPH_WIDTH`, `HOST_GRAPH_DEPTH`): the second compiles nothing, and each still decodes
    exactly what its uncompiled loop decodes, pass for pass (the confidence tree grown from its
    own width of candidates)."""
    from streamspec.decoding.lookup import PromptLookup

    model = models["llama"]
    ids = _repetitive_ids(seed=8)
    lookup = dict(tree_top_k=(2, 1, 1), lookup=PromptLookup(4, 1))  # sizes 7 and 11
    confidence = dict(tree_top_k=2, tree_budget=7)  # 2 candidates a stream, trees of 7 nodes
    first = generate(model, ids, 24, compile="aot_eager", **lookup)
    assert first.tokens.tolist() == generate(model, ids, 24, **lookup).tokens.tolist()
    assert {n for n, _ in first.nodes_per_pass} <= {7, 11}
    before = _graphs()
    out = generate(model, ids, 24, compile="aot_eager", **confidence)
    expected = generate(model, ids, 24, **confidence)
    assert _graphs() == before, "the confidence row compiled a graph of its own"
    assert out.tokens.tolist() == expected.tokens.tolist()
    assert out.accepted_per_pass == expected.accepted_per_pass
    assert {n for n, _ in out.nodes_per_pass} == {7}


def test_host_built_trees_compiled_with_seeded_sampling(models):
    from streamspec.decoding.lookup import PromptLookup

    model = models["gpt2"]
    ids = _repetitive_ids(seed=7)
    kwargs = dict(tree_top_k=(2, 1, 1), lookup=PromptLookup(6, 2), temperature=0.8, top_k=30, seed=3)
    assert generate(model, ids, 24, compile="aot_eager", **kwargs).tokens.tolist() == \
        generate(model, ids, 24, **kwargs).tokens.tolist()


def test_padded_trees_are_never_accepted_past_their_nodes():
    from streamspec.decoding.tree import accepted_nodes, deepest_path, padded_tree

    tree = padded_tree([-1, 0, 1, 0], 7, 4, (2, 1))
    assert tree.size == 7 and tree.depth.tolist() == [0, 1, 2, 1, 0, 0, 0]
    assert tree.ancestors[2].tolist() == [True, True, True, False, False, False, False]
    assert tree.ancestors[:4, 4:].any().item() is False and tree.ancestors[5].tolist() == [False] * 5 + [True, False]
    tokens = torch.tensor([9, 1, 2, 3, 9, 9, 9])
    nothing = torch.tensor([5] * 7)  # the main stream agrees with no draft: only the root is accepted
    best, path = deepest_path(tree, accepted_nodes(tree, tokens, nothing))
    assert best.item() == 0 and path[0].item() == 0
    chain = torch.tensor([1, 2, 7, 0, 0, 0, 0])  # root chooses 1, node 1 chooses 2: nodes 0-1-2 accepted
    best, path = deepest_path(tree, accepted_nodes(tree, tokens, chain))
    assert best.item() == 2 and path[:3].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="does not fit"):
        padded_tree([-1, 0, 1], 2, 4, (1,))
    with pytest.raises(ValueError, match="deep"):
        padded_tree([-1, 0, 1, 2], 4, 2, (1,))


@pytest.mark.parametrize("lookup", [None, "6,2"])
def test_session_compiled_equals_uncompiled(models, lookup):
    from streamspec.decoding.lookup import PromptLookup

    model = models["gpt2"]
    ids = (_repetitive_ids(seed=4, length=12) if lookup else random_ids(1, 8, seed=4))[0].tolist()
    results = []
    for compile in (False, "aot_eager"):
        session = DecodingSession(model, tree_top_k=(2, 1, 1), compile=compile,
                                  lookup=PromptLookup.parse(lookup) if lookup else None)
        session.extend(ids)
        first = session.generate(6).tokens
        session.extend([5, 6, 7])
        second = session.generate(9).tokens
        session.rollback(len(ids) + 4)
        third = session.generate(7).tokens
        results.append((first, second, third))
    assert results[0] == results[1]


# -- batches ----------------------------------------------------------------------------------
def _padded(prompts, side):
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        where = slice(width - p.shape[1], width) if side == "left" else slice(0, p.shape[1])
        ids[i, where], mask[i, where] = p[0], 1
    return ids, mask


_BATCH_GRAPHS: set = set()


@pytest.mark.parametrize("arch, side, backend", [
    ("llama", "left", "inductor"),
    ("llama", "right", "aot_eager"),
    ("gpt2", "left", "aot_eager"),
    ("gpt2", "right", "aot_eager"),
])
def test_batches_compiled_equal_uncompiled(models, arch, side, backend, capfd):
    """A batch (B > 1) with compile: every pass after the prefill one compiled call over the whole
    row cache, each row's tokens those of the uncompiled batch and of one token a pass for that
    prompt alone, the same accepted counts, one graph per batch size (announced once) whatever
    the prompts' lengths, and the EOS of one row ending that row only."""
    model = models[arch]
    compile = True if backend == "inductor" else backend
    prompts = [random_ids(1, n, seed=n) for n in (3, 9, 6)]
    ids, mask = _padded(prompts, side)
    expected = generate(model, ids, 20, attention_mask=mask)
    before = _graphs()
    capfd.readouterr()
    out = generate(model, ids, 20, attention_mask=mask, compile=compile)
    err = capfd.readouterr().err
    if (arch, backend) not in _BATCH_GRAPHS:  # this module's first call of the graph: announced
        assert "compiling the decode step (a batch of 3, chains of 4, cache of 256" in err
        _BATCH_GRAPHS.add((arch, backend))
    else:  # the other padding side: the same graph, not compiled again
        assert "compiling" not in err and _graphs() == before
    assert out.tokens.tolist() == expected.tokens.tolist() and out.lengths == expected.lengths
    assert out.accepted_per_pass == expected.accepted_per_pass
    assert max(expected.accepted_per_pass[1:]) > 3, "the streams never agreed: the test would not see a wrong commit"
    for row, prompt in enumerate(prompts):
        assert out.tokens[row, : out.lengths[row]].tolist() == generate_autoregressive(model, prompt, 20)[0].tolist()
    # other prompts of the same batch size: the same graph, nothing announced
    others = [random_ids(1, n, seed=10 + n) for n in (11, 4, 7)]
    ids, mask = _padded(others, side)
    full = generate_autoregressive(model, others[1], 20)[0].tolist()
    eos = full[4]
    out = generate(model, ids, 20, attention_mask=mask, eos_token_id=eos, compile=compile)
    assert "compiling" not in capfd.readouterr().err
    assert _graphs() - before <= 1, "a new prompt length or padding compiled again"
    for row, prompt in enumerate(others):
        alone = generate_autoregressive(model, prompt, 20, eos_token_id=eos)[0].tolist()
        assert out.tokens[row, : out.lengths[row]].tolist() == alone, row
    assert out.lengths[1] == full.index(eos) + 1 < 20  # the row that met its EOS ended there


def test_batches_compiled_with_seeded_sampling(models):
    model = models["gpt2"]
    prompts = [random_ids(1, n, seed=n) for n in (5, 8)]
    ids, mask = _padded(prompts, "left")
    kwargs = dict(temperature=0.8, top_k=30, top_p=0.95, attention_mask=mask)
    outputs = []
    for seed in (0, 3):  # a new seed is a tensor input: no new graph
        expected = generate(model, ids, 16, seed=seed, **kwargs)
        before = _graphs()
        out = generate(model, ids, 16, seed=seed, compile="aot_eager", **kwargs)
        assert out.tokens.tolist() == expected.tokens.tolist(), seed
        assert out.accepted_per_pass == expected.accepted_per_pass
        if seed:
            assert _graphs() == before
        outputs.append(out.tokens.tolist())
    assert outputs[0] != outputs[1]  # the seed is used


def test_batches_compiled_with_one_head_call(models):
    """The compiled batch with the LM head fused into one call a pass (what an accelerator
    gets) decodes what the uncompiled batch decodes."""
    from streamspec.decoding.batch import generate_batch
    from streamspec.decoding.output import GenerateOutput

    model = models["llama"]
    prompts = [random_ids(1, n, seed=20 + n) for n in (4, 10)]
    ids, mask = _padded(prompts, "left")
    for fuse_head in (True, False):
        runs = [generate_batch(model, ids, mask, 18, Sampler(), set(), GenerateOutput, fuse_head=fuse_head,
                               compile_backend=backend) for backend in (None, "aot_eager")]
        assert runs[0].tokens.tolist() == runs[1].tokens.tolist(), fuse_head
        assert runs[0].accepted_per_pass == runs[1].accepted_per_pass
    for row, prompt in enumerate(prompts):
        assert runs[1].tokens[row].tolist() == generate_autoregressive(model, prompt, 18)[0].tolist()


def test_batches_compiled_past_the_default_recompile_limit(models):
    """More graphs of the batch pass than dynamo's default limit of 8 (one per batch size here):
    each compiles rather than failing (``fullgraph=True`` fails hard at the limit)."""
    model = models["gpt2"]
    before = _graphs()
    for size in range(2, 12):
        out = generate(model, random_ids(size, 5, seed=size), 3, compile="aot_eager")
        assert out.tokens.shape == (size, 3)
    assert _graphs() - before >= 9  # (a size or two may be earlier tests')


def test_bad_combinations_are_refused(models):
    model = models["llama"]
    ids = random_ids(1, 5, seed=0)
    with pytest.raises(ValueError, match="prune_threshold"):
        generate(model, ids, 4, prune_threshold=0.1, compile=True)
    with pytest.raises(ValueError, match="single best path"):  # a batch compiles its chains, not trees
        generate(model, random_ids(2, 5, seed=0), 4, tree_top_k=2, compile=True)
    with pytest.raises(ValueError, match="compile must be"):
        generate(model, ids, 4, compile="tensorrt")
    with pytest.raises(ValueError, match="prune_threshold"):
        DecodingSession(model, prune_threshold=0.1, compile=True)
    with pytest.raises(ValueError, match="streamed models"):
        DecodingSession(make_model("llama"), compile=True)


# -- CUDA graphs ------------------------------------------------------------------------------
def _every_compiled_loop(model, compile, device="cpu"):
    """The outputs of each compiled loop (one token a pass, a fixed tree, host-built trees with
    lookup branches, a batch's chains) with `compile`."""
    from streamspec.decoding.lookup import PromptLookup

    ids, repetitive = random_ids(1, 9, seed=1).to(device), _repetitive_ids(seed=2).to(device)
    prompts = [random_ids(1, n, seed=n) for n in (3, 9, 6)]
    batch, mask = (t.to(device) for t in _padded(prompts, "left"))
    return [generate(model, ids, 16, speculative=False, compile=compile),
            generate(model, ids, 16, tree_top_k=(2, 1, 1), compile=compile),
            generate(model, repetitive, 16, tree_top_k=(2, 1, 1), lookup=PromptLookup(6, 2), compile=compile),
            generate(model, batch, 16, attention_mask=mask, compile=compile)]


def _tokens(outputs):
    return [out.tokens.tolist() for out in outputs]


def _fresh_graphs():
    from streamspec.decoding import compiled

    for fn in (compiled._compiled_pass, compiled._compiled_host_pass, compiled._compiled_token_pass,
               compiled._compiled_batch_pass):
        fn.cache_clear()


def test_cuda_graph_protocol_on_every_compiled_loop(models, monkeypatch):
    """The calls CUDA graphs need (`GraphedStep`: the cache buffers static addresses, a new step
    each call, the outputs copied out of the graphs' pool) decode what the uncompiled loops decode
    on every compiled path. Checked here on a CPU with the aot_eager backend (no graphs to replay;
    `test_cuda_graphs_replay_every_compiled_loop` replays them on a GPU)."""
    from streamspec.decoding import compiled, graphs

    model = models["gpt2"]
    expected = _tokens(_every_compiled_loop(model, False))
    steps = []
    begin = torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1) or begin())
    monkeypatch.setattr(graphs, "cuda_graphs_wanted", lambda backend, device_type: True)
    _fresh_graphs()
    try:
        outputs = _every_compiled_loop(model, "aot_eager")
    finally:
        _fresh_graphs()  # the other tests' graphs without the protocol
    assert _tokens(outputs) == expected
    assert len(steps) >= sum(out.forward_passes - 1 for out in outputs)  # every pass after a prefill began a step
    monkeypatch.undo()
    assert not compiled.cuda_graphs_wanted("inductor", "cpu") and not compiled.cuda_graphs_wanted("aot_eager", "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_every_compiled_loop(monkeypatch):
    """On a GPU, compile=True replays each compiled loop as CUDA graphs (inductor's
    reduce-overhead mode: no graph skipped for the cache buffers' in-place writes or anything
    else), with the uncompiled loops' tokens in float32; STREAMSPEC_CUDA_GRAPHS=0 turns it off."""
    from streamspec.decoding import compiled

    model = _streamed("llama").cuda()
    assert compiled.cuda_graphs_wanted("inductor", "cuda")
    expected = _tokens(_every_compiled_loop(model, False, "cuda"))
    skips = counters["inductor"]["cudagraph_skips"]
    _fresh_graphs()
    assert _tokens(_every_compiled_loop(model, True, "cuda")) == expected
    assert counters["inductor"]["cudagraph_skips"] == skips, "inductor skipped CUDA graphs for a compiled pass"
    assert isinstance(compiled._compiled_pass("inductor", "cuda"), compiled.GraphedStep)
    monkeypatch.setenv("STREAMSPEC_CUDA_GRAPHS", "0")
    assert not compiled.cuda_graphs_wanted("inductor", "cuda")
