"""streamspec's own bf16 CPU kernel (`streamspec.native`, `streamspec/csrc/bf16_linear.cpp`):
the products of float64 up to bf16's rounding for every shape (padding of rows and inputs, bias,
3-D and strided inputs), a row's bits independent of the rows beside it, the passes of a few rows
routed to it and longer ones to oneDNN, eager and compiled."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from streamspec import native
from streamspec.kernels import PackedLinear, cpu_kernels_available, pack_linear_layers, packed_dtypes

_WANTED = native.cpu_has_avx512_bf16() and os.environ.get("STREAMSPEC_NATIVE_KERNELS", "1") not in ("0", "false", "off", "no")


@pytest.fixture(scope="module")
def kernel():
    if not _WANTED:
        pytest.skip("this CPU has no AVX-512 BF16 (or STREAMSPEC_NATIVE_KERNELS=0)")
    module = native.bf16_linear()
    # where the CPU has the instructions the kernel must build: a broken build is a failure here
    assert module is not None, "streamspec's bf16 kernel did not build on a CPU with AVX-512 BF16"
    return module


def _within_bf16_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    # one rounding of the output to bf16 (2^-8 relative) and float32 sums of K products
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    if x.numel() == 0:
        return
    bound = exact.abs() * 2.0 ** -8 + 1e-6 * x.shape[-1] * (x.double().abs().max() * w.double().abs().max() + 1)
    assert ((out.double() - exact).abs() <= bound).all(), (out.double() - exact).abs().max()


@pytest.mark.parametrize("n, k", [(96, 48), (13, 45), (8, 32), (9, 33), (7, 1), (1536, 576), (40, 100)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 7])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_is_the_exact_product_up_to_bf16_rounding(kernel, n, k, rows, bias):
    torch.manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    packed = kernel.pack(w)
    _within_bf16_rounding(kernel.linear(x, packed, n, b), x, w, b)
    # 3-D and strided inputs
    x3 = torch.randn(2, rows, 2 * k, dtype=torch.bfloat16)[..., ::2]
    out = kernel.linear(x3, packed, n, b)
    assert out.shape == (2, rows, n)
    _within_bf16_rounding(out.reshape(-1, n), x3.reshape(-1, k), w, b)


def test_the_kernel_refuses_what_it_cannot_multiply(kernel):
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.pack(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="2-D"):
        kernel.pack(torch.randn(2, 8, 32, dtype=torch.bfloat16))
    packed = kernel.pack(torch.randn(8, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="inputs"):
        kernel.linear(torch.randn(1, 16, dtype=torch.bfloat16), packed, 8, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(1, 64, dtype=torch.bfloat16), packed, 8, torch.randn(5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.linear(torch.randn(1, 64), packed, 8, None)


class _Counting:
    """Stands in for the kernel module, counting its products."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def pack(self, w):
        return self.module.pack(w)

    def linear(self, *args):
        self.calls += 1
        return self.module.linear(*args)


@pytest.fixture
def counting(kernel, monkeypatch):
    spy = _Counting(kernel)
    monkeypatch.setattr(native, "_MODULE", spy)
    return spy


@pytest.mark.skipif(not cpu_kernels_available() or torch.bfloat16 not in packed_dtypes(), reason="no oneDNN bf16 here")
@pytest.mark.parametrize("compiled", [False, True])
def test_passes_of_a_few_rows_take_the_kernel_and_longer_ones_onednn(counting, compiled):
    torch.manual_seed(0)
    layer = nn.Linear(64, 40).to(torch.bfloat16).eval()
    reference = F.linear
    assert pack_linear_layers(layer) == 1 and type(layer) is PackedLinear
    run = torch.compile(lambda a: layer(a), fullgraph=True, dynamic=False) if compiled else layer
    with torch.no_grad():
        for rows, by_kernel in [(1, True), (native.MAX_ROWS, True), (native.MAX_ROWS + 1, False), (16, False)]:
            x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
            before = counting.calls
            out = run(x)
            assert (counting.calls > before) == by_kernel, rows
            _within_bf16_rounding(out[0], x[0], layer.weight, layer.bias)
            torch.testing.assert_close(out, reference(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
        # an in-place change of the weight reaches the kernel's layout too
        layer.weight.mul_(-1)
        x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
        _within_bf16_rounding(run(x)[0], x[0], layer.weight, layer.bias)


@pytest.mark.skipif(not cpu_kernels_available() or torch.bfloat16 not in packed_dtypes(), reason="no oneDNN bf16 here")
def test_layers_packed_without_the_kernel_stay_on_onednn(counting):
    layer = nn.Linear(64, 40).to(torch.bfloat16).eval()
    pack_linear_layers(layer, own_kernel=False)
    with torch.no_grad():
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
        layer.weight.add_(1)  # packed again, still without it
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
    assert counting.calls == 0


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(native, "_MODULE", native._UNSET)
    monkeypatch.setenv("STREAMSPEC_NATIVE_KERNELS", "0")
    assert native.bf16_linear() is None
    monkeypatch.setattr(native, "_MODULE", native._UNSET)  # decided again by the next caller


def test_a_row_gets_the_same_bits_whatever_rows_share_its_pass(kernel):
    """Each row's sums run in one order whatever else is in the pass: a row alone and the same row
    among others give identical bits (what lets a decoder on the kernel verify as it decodes)."""
    torch.manual_seed(1)
    w = torch.randn(100, 576, dtype=torch.bfloat16)
    packed = kernel.pack(w)
    x = torch.randn(7, 576, dtype=torch.bfloat16)
    together = kernel.linear(x, packed, 100, None)
    for i in range(7):
        assert torch.equal(kernel.linear(x[i:i + 1], packed, 100, None)[0], together[i])
