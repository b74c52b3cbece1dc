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


def test_session_compiled_equals_uncompiled(models):
    model = models["gpt2"]
    ids = random_ids(1, 8, seed=4)[0].tolist()
    results = []
    for compile in (False, "aot_eager"):
        session = DecodingSession(model, tree_top_k=(2, 1, 1), compile=compile)
        session.extend(ids)
        first = session.generate(6).tokens
        session.extend([5, 6, 7])
        second = session.generate(9).tokens
        session.rollback(len(ids) + 4)
        third = session.generate(7).tokens
        results.append((first, second, third))
    assert results[0] == results[1]


def test_bad_combinations_are_refused(models):
    model = models["llama"]
    ids = random_ids(1, 5, seed=0)
    with pytest.raises(ValueError, match="prune_threshold"):
        generate(model, ids, 4, prune_threshold=0.1, compile=True)
    with pytest.raises(ValueError, match="batch"):
        generate(model, random_ids(2, 5, seed=0), 4, compile=True)
    with pytest.raises(ValueError, match="compile must be"):
        generate(model, ids, 4, compile="tensorrt")
    with pytest.raises(ValueError, match="prune_threshold"):
        DecodingSession(model, prune_threshold=0.1, compile=True)
    with pytest.raises(ValueError, match="streamed models"):
        DecodingSession(make_model("llama"), compile=True)
