"""What a CPU without AVX-512 BF16 runs (AVX2 only, or ``STREAMSPEC_NATIVE_KERNELS=0``): streamspec's
own C++ kernels do not load, oneDNN packs float32 layers only, and the bf16 copies a float32 model
drafts through (`use_bf16_draft_head`, `use_bf16_stream_rows`) are not made. The `avx2_view` fixture
makes any CPU look like that one, so every machine checks the path an AVX2 machine takes: linear
layers within rounding of the exact product, the copies refused and nothing changed, and decoding
giving the model's own tokens, the same tokens the kernels give where they run."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from conftest import packed_streamed_model, random_ids, within_bf16_rounding, within_float32_rounding
from streamspec import StreamConfig, add_streams, kernels, native
from streamspec.decoding import generate, generate_autoregressive
from streamspec.kernels import PackedLinear, cpu_kernels_available, pack_linear_layers
from streamspec.loading import load_for_inference

TREES = (dict(tree_top_k=(2, 1, 1)), dict(tree_top_k=1), dict(tree_top_k=3, tree_budget=7))


@contextlib.contextmanager
def avx2_cpu():
    """This process as on a CPU without AVX-512 BF16: no streamspec kernel, float32 packs only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "cpu_has_avx512_bf16", lambda: False)
        patch.setattr(native, "_MODULE", native._UNSET)  # decided again, as a fresh process would
        patch.setattr(kernels, "_PACKABLE", (torch.float32,) if cpu_kernels_available() else ())
        assert native.bf16_linear() is None and not native.ready()
        yield


@pytest.fixture
def avx2_view():
    with avx2_cpu():
        yield


@pytest.mark.parametrize("n, k", [(96, 48), (13, 45), (7, 1), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 3, 7, 25, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_without_the_kernel_are_the_product_up_to_rounding(avx2_view, n, k, rows, dtype):
    torch.manual_seed(n + k + rows)
    layer = nn.Linear(k, n).to(dtype).eval()
    packed = pack_linear_layers(layer)
    # float32 goes to oneDNN's pack where torch has it; bf16 stays on F.linear (oneDNN would emulate it)
    assert isinstance(layer, PackedLinear) == (packed > 0) == (dtype == torch.float32 and cpu_kernels_available())
    check = within_float32_rounding if dtype == torch.float32 else lambda *a: within_bf16_rounding(*a, unfused=True)
    x = torch.randn(rows, k, dtype=dtype)
    with torch.no_grad():
        check(layer(x), x, layer.weight, layer.bias)
        x3 = torch.randn(2, rows, 2 * k, dtype=dtype)[..., ::2]  # 3-D and strided
        check(layer(x3).reshape(-1, n), x3.reshape(-1, k), layer.weight, layer.bias)


def test_the_bf16_copies_are_refused_and_change_nothing(avx2_view, tiny_dir, tmp_path):
    model = packed_streamed_model(stream_adapter_rank=4)
    hidden = torch.randn(3, model.config.hidden_size)
    ids = random_ids(1, 12, seed=3)
    before = generate(model, ids, 24, tree_top_k=(2, 1, 1))
    assert not model.use_bf16_draft_head() and not model.use_bf16_stream_rows()
    assert "_bf16_draft_head" not in model.__dict__
    assert not any(getattr(m, "_streamspec_low_rows", None) is not None for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model.draft_head(hidden), model.head(hidden))
    after = generate(model, ids, 24, tree_top_k=(2, 1, 1))
    assert after.tokens.tolist() == before.tokens.tolist() and after.accepted_per_pass == before.accepted_per_pass
    # what load_for_inference turns on for a float32 model on a CPU with the kernels, it leaves off here
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    add_streams(base, StreamConfig(stream_layers=2, mode="lossless")).save_pretrained(
        tmp_path / "ckpt", tokenizer=load_for_inference(tiny_dir, cpu_kernels=False).tokenizer)
    loaded = load_for_inference(tmp_path / "ckpt", dtype="float32").model
    assert "_bf16_draft_head" not in loaded.__dict__
    assert not any(getattr(m, "_streamspec_low_rows", None) is not None for m in loaded.modules())
    assert any(isinstance(m, PackedLinear) for m in loaded.modules()) == cpu_kernels_available()


@pytest.mark.parametrize("arch, config", [("llama", dict(stream_adapter_rank=4)), ("llama", {}), ("gpt2", {})],
                         ids=["llama-adapters", "llama", "gpt2"])
def test_decoding_without_the_kernels_gives_the_models_own_tokens(arch, config):
    """On the fallback every draft tree decodes the model's own tokens, eager and compiled; where
    this CPU runs the kernels and the bf16 copies, they decode the same tokens."""
    ids = random_ids(1, 12, seed=3)
    with avx2_cpu():
        model = packed_streamed_model(arch, **config)
        reference = generate_autoregressive(model, ids, 40).tolist()
        for options in TREES:
            assert generate(model, ids, 40, **options).tokens.tolist() == reference, options
        if arch == "llama" and config:
            compiled = generate(model, ids, 40, tree_top_k=(2, 1, 1), compile="aot_eager")
            assert compiled.tokens.tolist() == reference
    fast = packed_streamed_model(arch, **config)  # this CPU as it is
    fast.use_bf16_draft_head()
    fast.use_bf16_stream_rows()
    assert generate_autoregressive(fast, ids, 40).tolist() == reference
    for options in TREES:
        assert generate(fast, ids, 40, **options).tokens.tolist() == reference, options
