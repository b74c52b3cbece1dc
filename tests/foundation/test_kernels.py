"""Packed oneDNN linear kernels (`streamspec.kernels`): same results as `nn.Linear`, training
untouched, stale packs refreshed, decoding still exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from streamspec import StreamConfig, add_streams, native
from streamspec.decoding import generate, generate_autoregressive
from streamspec.kernels import (
    DECODE_ATTENTION,
    PackedLinear,
    cpu_kernels_available,
    decode_attention_forward,
    default_kernels,
    default_linear_kernels,
    pack_linear_layers,
    packed_dtypes,
    unpack_linear_layers,
    use_decode_attention,
)

from conftest import NativeSpy, make_model, random_ids

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="this torch build has no oneDNN")


def _ran_packed_kernel(fn) -> bool:
    """Whether `fn` ran a packed kernel: oneDNN's (seen by the profiler) or streamspec's own
    (`streamspec.native`, which passes of up to `native.MAX_ROWS` rows take where it runs; a spy
    stands in for its module)."""
    real = native.bf16_linear()
    spy = NativeSpy(real) if real is not None else None
    saved = native._MODULE
    native._MODULE = spy if spy is not None else saved
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        native._MODULE = saved
    return (spy is not None and spy.counts["linear"] > 0) or any(
        "_linear_pointwise" in e.key or e.key.startswith("streamspec_native::linear") for e in prof.key_averages())


@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48), (0, 48)])
def test_packed_linear_matches_nn_linear(shape):
    layer = nn.Linear(48, 96)
    reference_layer = nn.Linear(48, 96)
    reference_layer.load_state_dict(layer.state_dict())
    assert pack_linear_layers(layer) == 1 and type(layer) is PackedLinear
    x = torch.randn(shape)
    with torch.no_grad():
        assert _ran_packed_kernel(lambda: layer(x))
        torch.testing.assert_close(layer(x), reference_layer(x), rtol=1e-5, atol=1e-5)
        # a non-contiguous input of the same shape
        xt = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
        assert xt.shape == x.shape and (x.numel() == 0 or not xt.is_contiguous())
        torch.testing.assert_close(layer(xt), reference_layer(xt), rtol=1e-5, atol=1e-5)


def test_training_path_is_untouched():
    """With autograd recording, packed layers run F.linear: same gradients as nn.Linear."""
    torch.manual_seed(0)
    layer, reference = nn.Linear(16, 8), nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    pack_linear_layers(layer)
    x = torch.randn(4, 16)
    assert not _ran_packed_kernel(lambda: layer(x).sum().backward())
    reference(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=0, atol=0)


def test_changed_weights_are_packed_again():
    layer = nn.Linear(16, 8)
    pack_linear_layers(layer)
    x = torch.randn(3, 16)

    def expected():
        return x @ layer.weight.t() + layer.bias

    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected(), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(layer(x), expected(), rtol=1e-5, atol=1e-5)
        layer.load_state_dict(nn.Linear(16, 8).state_dict())
        torch.testing.assert_close(layer(x), expected(), rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(8, 16))  # a new tensor
        torch.testing.assert_close(layer(x), expected(), rtol=1e-5, atol=1e-5)
        layer.weight.data.mul_(3)  # through .data: not seen until packed again
        assert not torch.allclose(layer(x), expected())
        pack_linear_layers(layer)
        torch.testing.assert_close(layer(x), expected(), rtol=1e-5, atol=1e-5)


def test_unpack_and_default_kernels_restore_nn_linear():
    model = make_model("llama")
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    keys = set(model.state_dict())
    assert pack_linear_layers(model) == len(names) > 0
    assert set(model.state_dict()) == keys  # nothing saved changes
    x = random_ids(1, 6, 0)
    with torch.no_grad():
        with default_linear_kernels(model):
            assert all(type(m) is not PackedLinear for m in model.modules())
            assert not _ran_packed_kernel(lambda: model(x))
        assert _ran_packed_kernel(lambda: model(x))
    assert unpack_linear_layers(model) == len(names)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in names)
    assert not any("_streamspec_packed" in m.__dict__ for m in model.modules())


def test_other_dtypes_are_left_alone():
    model = make_model("llama").to(torch.float16)
    assert pack_linear_layers(model) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())


@pytest.mark.skipif(torch.bfloat16 not in packed_dtypes(), reason="this CPU has no native bf16 in oneDNN")
def test_bfloat16_layers_are_packed_and_match():
    torch.manual_seed(0)
    layer = nn.Linear(48, 96).to(torch.bfloat16)
    reference = nn.Linear(48, 96).to(torch.bfloat16)
    reference.load_state_dict(layer.state_dict())
    assert pack_linear_layers(layer) == 1 and type(layer) is PackedLinear
    with torch.no_grad():
        # passes of more rows than streamspec's own bf16 kernel takes (tests/foundation/test_native.py) run oneDNN
        x = torch.randn(native.MAX_ROWS + 1, 48, dtype=torch.bfloat16)
        assert _ran_packed_kernel(lambda: layer(x))
        torch.testing.assert_close(layer(x), reference(x), rtol=2e-2, atol=2e-2)
        x = torch.randn(2, 48, dtype=torch.bfloat16)  # either kernel, the same product
        torch.testing.assert_close(layer(x), reference(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [10, 2 * native.MAX_ROWS])
def test_compiled_graphs_call_the_packed_operator_and_see_weight_changes(dtype, rows):
    """Under torch.compile a packed layer is an operator with the layer's own pack: passes of up
    to `native.MAX_ROWS` rows ``streamspec_native::linear_of`` where streamspec's kernel runs,
    longer ones (or without the kernel) ``streamspec::packed_linear``; a weight changed in place
    afterwards is packed again, never served stale."""
    if dtype not in packed_dtypes():
        pytest.skip("this CPU does not pack this dtype")
    torch.manual_seed(0)
    layer = nn.Linear(32, 24).to(dtype).eval()
    pack_linear_layers(layer)
    x = torch.randn(2, rows // 2, 32, dtype=dtype)
    step = torch.compile(lambda a: layer(a), fullgraph=True, dynamic=False)
    operator = ("streamspec_native::linear_of" if rows <= native.MAX_ROWS and native.bf16_linear() is not None
                else "streamspec::packed_linear")
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        assert _ran_op(lambda: step(x), operator)
        torch.testing.assert_close(step(x), expected, rtol=1e-2, atol=1e-2)
        layer.weight.mul_(-2)
        torch.testing.assert_close(step(x), F.linear(x, layer.weight, layer.bias), rtol=1e-2, atol=1e-2)


def test_the_operator_tells_a_weight_from_its_transposed_view_and_unpacking_frees_packs():
    """The operator finds a pack by the weight's address: a transposed view of a square weight
    (same address, shape, dtype, version) is not served the weight's pack; unpacking a model
    drops its packs."""
    from streamspec.kernels import _PACKS, packed_linear

    layer = nn.Linear(16, 16, bias=False).eval()
    pack_linear_layers(layer)
    x = torch.randn(3, 16)
    mine = [key for key, entry in _PACKS.items() if entry[0]() is layer.weight]
    assert len(mine) == 1
    with torch.no_grad():
        torch.testing.assert_close(packed_linear(x, layer.weight), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_linear(x, layer.weight.t()), F.linear(x, layer.weight.t()),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_linear(x, layer.weight), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert _PACKS[mine[0]][0]() is layer.weight  # the view's pack did not replace the weight's
    unpack_linear_layers(layer)
    assert not any(entry[0]() is layer.weight for entry in _PACKS.values())


def _ran_op(fn, name: str) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(name in event.key for event in prof.key_averages())


@pytest.mark.parametrize("rows", [1, 3, 12, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["float", "bool", "per_head", "none"])
@pytest.mark.parametrize("own_kernel", [False, True])
def test_decode_attention_equals_sdpa(rows, dtype, mask_kind, own_kernel, monkeypatch):
    """The grouped decoding attention computes what transformers' sdpa computes (grouped-query
    heads, additive, boolean and per-head masks, no mask for one row), within rounding: on
    torch's operators, and in bf16 and float32 on streamspec's own kernel (`streamspec.native`),
    which takes passes longer than the grouped path's (48 rows: a tree's stream layers)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from streamspec import native

    if mask_kind == "none" and rows > 1:
        pytest.skip("several rows without a mask go to sdpa itself")
    if own_kernel:
        if not native.cpu_has_avx512_bf16():
            pytest.skip("streamspec's own attention kernel runs on CPUs with AVX-512 BF16")
        assert native.bf16_linear() is not None, "streamspec's kernels did not build on a CPU with AVX-512 BF16"
        assert rows <= native.ATTENTION_MAX_ROWS  # the kernel at every row count here
        spy = NativeSpy(native.bf16_linear())  # the test must not pass on torch's path
        monkeypatch.setattr(native, "_MODULE", spy)
    if not own_kernel:
        monkeypatch.setattr(native, "_MODULE", None)
    torch.manual_seed(rows)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q = torch.randn(2, 6, rows, 16, dtype=dtype)
    k, v = torch.randn(2, 2, 40, 16, dtype=dtype), torch.randn(2, 2, 40, 16, dtype=dtype)
    allowed = torch.rand(2, 1, rows, 40) > 0.3
    allowed[..., 0] = True
    if rows > 1:
        allowed[1, 0, 1] = False  # a padded query that may see nothing: zeros, as sdpa gives
    mask = {"float": torch.zeros(2, 1, rows, 40, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min),
            "bool": allowed, "per_head": allowed.expand(2, 6, rows, 40).clone(), "none": None}[mask_kind]
    ours, _ = decode_attention_forward(module, q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q.double(), k.double(), v.double(),
                                       mask.double() if mask is not None and mask.is_floating_point() else mask,
                                       scaling=0.3)
    assert ours.shape == theirs.shape == (2, rows, 6, 16) and ours.dtype == dtype
    if own_kernel:
        assert spy.counts["decode_attention"], "streamspec's attention kernel did not run"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert not ours.isnan().any()
    torch.testing.assert_close(ours.double(), theirs, rtol=tol, atol=tol)


def test_decode_attention_decodes_exactly_and_default_kernels_restore_sdpa():
    """A model switched to the decoding attention decodes speculatively exactly as one token per
    pass does, within fp32 rounding of sdpa's logits; `default_kernels` runs sdpa again."""
    model = add_streams(make_model("llama", 3), StreamConfig(stream_layers=2)).eval()
    prompt = random_ids(1, 9, 3)
    with torch.no_grad():
        sdpa_logits = model(prompt).logits
    assert use_decode_attention(model) and model.config._attn_implementation == DECODE_ATTENTION
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, sdpa_logits, rtol=1e-4, atol=1e-5)
    reference = generate_autoregressive(model, prompt, 16)
    for k in (1, 3):
        assert torch.equal(generate(model, prompt, 16, tree_top_k=k).tokens, reference)
    with default_kernels(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == DECODE_ATTENTION
    # a model kept on torch's attention operators (not streamspec's kernel) stays so afterwards
    use_decode_attention(model, own_kernel=False)
    with default_kernels(model):
        pass
    layers = [m for m in model.modules() if "_streamspec_native_attention" in m.__dict__]
    assert layers and all(m.__dict__["_streamspec_native_attention"] is False for m in layers)


def test_eager_models_keep_their_attention():
    model = make_model("llama")
    model.config._attn_implementation = "eager"
    assert not use_decode_attention(model) and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_decoding_with_packed_kernels_is_exact(arch):
    """Speculative decoding with packed kernels reproduces one-token-per-pass decoding with
    them, and the logits stay within fp32 rounding of the default kernels."""
    for seed in range(2):
        model = add_streams(make_model(arch, seed), StreamConfig(stream_layers=2)).eval()
        prompt = random_ids(1, 4 + seed, seed)
        with torch.no_grad():
            default_logits = model(prompt).logits
        pack_linear_layers(model)
        with torch.no_grad():
            torch.testing.assert_close(model(prompt).logits, default_logits, rtol=1e-4, atol=1e-5)
        reference = generate_autoregressive(model, prompt, 16)
        for k, threshold in [(1, None), (3, None), (2, 0.01)]:
            assert torch.equal(generate(model, prompt, 16, tree_top_k=k, prune_threshold=threshold).tokens, reference)


def test_tied_head_follows_its_embedding():
    """SmolLM2-style tied weights: changing the embedding in place changes the packed head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    pack_linear_layers(model)
    x = torch.randn(2, 16)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1)
        torch.testing.assert_close(model.lm_head(x), x @ model.model.embed_tokens.weight.t(), rtol=1e-5, atol=1e-5)


def test_copies_and_autocast_and_losses():
    import copy

    model = add_streams(make_model("llama"), StreamConfig(stream_layers=2)).eval()
    ids = random_ids(2, 6, 0)
    with torch.no_grad():
        before = model(ids).logits
    pack_linear_layers(model)
    twin = copy.deepcopy(model)  # e.g. save_pretrained(merge=True) copies the base
    assert not any("_streamspec_packed" in m.__dict__ for m in twin.modules())
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, before, rtol=1e-4, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the dtype, as for nn.Linear
            assert not _ran_packed_kernel(lambda: model(ids))
    # training losses through a packed model (autograd on): the same as through nn.Linear
    labels = ids.clone()
    packed_loss = model(ids, labels=labels).loss
    unpack_linear_layers(model)
    torch.testing.assert_close(packed_loss, model(ids, labels=labels).loss, rtol=0, atol=0)


def test_batches_decode_exactly_with_packed_kernels():
    model = add_streams(make_model("llama", 1), StreamConfig(stream_layers=2)).eval()
    pack_linear_layers(model)
    prompts = [random_ids(1, n, n) for n in (3, 6)]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, 6 - prompt.shape[1]:] = prompt[0]
        mask[row, 6 - prompt.shape[1]:] = 1
    out = generate(model, ids, 10, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        assert torch.equal(out.tokens[row, : out.lengths[row]], generate_autoregressive(model, prompt, 10)[0])
