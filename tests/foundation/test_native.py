"""streamspec's own CPU kernels (`streamspec.native`, `streamspec/csrc/bf16_linear.cpp`):
the products of float64 up to bf16's (float32's) rounding for every shape (padding of rows and inputs, bias,
3-D and strided inputs), a row's bits independent of the rows beside it, the passes of a few rows
routed to it and longer ones to oneDNN, eager and compiled."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from streamspec import native
from streamspec.kernels import PackedLinear, cpu_kernels_available, pack_linear_layers, packed_dtypes, unpack_linear_layers

from conftest import NativeSpy, native_op_calls, within_bf16_rounding, within_float32_rounding, within_rounding

_WANTED = native.cpu_has_avx512_bf16() and os.environ.get("STREAMSPEC_NATIVE_KERNELS", "1") not in ("0", "false", "off", "no")


@pytest.fixture(scope="module")
def kernel():
    if not _WANTED:
        pytest.skip("this CPU has no AVX-512 BF16 (or STREAMSPEC_NATIVE_KERNELS=0)")
    module = native.bf16_linear()
    # where the CPU has the instructions the kernel must build: a broken build is a failure here
    assert module is not None, "streamspec's bf16 kernel did not build on a CPU with AVX-512 BF16"
    return module


@pytest.mark.parametrize("n, k", [(96, 48), (13, 45), (8, 32), (9, 33), (7, 1), (1536, 576), (40, 100)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 6, 7, 8, 12, 13, 14, 25])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_is_the_exact_product_up_to_rounding(kernel, n, k, rows, bias, dtype):
    torch.manual_seed(n * 1000 + k + rows)
    check = within_bf16_rounding if dtype == torch.bfloat16 else within_float32_rounding
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    x = torch.randn(rows, k, dtype=dtype)
    packed = kernel.pack(w)
    check(kernel.linear(x, packed, n, b), x, w, b)
    # 3-D and strided inputs
    x3 = torch.randn(2, rows, 2 * k, dtype=dtype)[..., ::2]
    out = kernel.linear(x3, packed, n, b)
    assert out.shape == (2, rows, n)
    check(out.reshape(-1, n), x3.reshape(-1, k), w, b)


def test_the_kernel_refuses_what_it_cannot_multiply(kernel):
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel.pack(torch.randn(8, 32, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="both bfloat16 or both float32"):
        kernel.linear(torch.randn(1, 32), kernel.pack(torch.randn(8, 32, dtype=torch.bfloat16)), 8, None)
    with pytest.raises(RuntimeError, match="inputs"):
        kernel.linear(torch.randn(1, 16), kernel.pack(torch.randn(8, 32)), 8, None)
    with pytest.raises(RuntimeError, match="2-D"):
        kernel.pack(torch.randn(2, 8, 32, dtype=torch.bfloat16))
    packed = kernel.pack(torch.randn(8, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="inputs"):
        kernel.linear(torch.randn(1, 16, dtype=torch.bfloat16), packed, 8, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(1, 64, dtype=torch.bfloat16), packed, 8, torch.randn(5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.linear(torch.randn(1, 64), packed, 8, None)


@pytest.fixture
def counting(kernel, monkeypatch):
    spy = NativeSpy(kernel)
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
        for rows, by_kernel in [(1, True), (native.MAX_ROWS, True), (native.MAX_ROWS + 1, False), (2 * native.MAX_ROWS, False)]:
            x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
            before = counting.calls
            result = []
            ops = native_op_calls(lambda: result.append(run(x)))  # (compiled graphs call the C++ operator)
            out = result[0]
            assert (counting.calls > before or ops["linear"] > 0) == by_kernel, rows
            within_bf16_rounding(out[0], x[0], layer.weight, layer.bias)
            torch.testing.assert_close(out, reference(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
        # an in-place change of the weight reaches the kernel's layout too
        layer.weight.mul_(-1)
        x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
        within_bf16_rounding(run(x)[0], x[0], layer.weight, layer.bias)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [7, 8, 14, 29])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_pass(kernel, dtype, rows):
    """Each row's sums run in one order whatever else is in the pass: a row alone and the same row
    among others give identical bits (what lets a decoder on the kernel verify as it decodes)."""
    torch.manual_seed(1)
    w = torch.randn(100, 576, dtype=dtype)
    packed = kernel.pack(w)
    x = torch.randn(rows, 576, dtype=dtype)
    together = kernel.linear(x, packed, 100, None)
    for i in range(rows):
        assert torch.equal(kernel.linear(x[i:i + 1], packed, 100, None)[0], together[i])
    assert torch.equal(kernel.linear(x[2:5], packed, 100, None), together[2:5])


def _attention_float64(q, k, v, mask, scale):
    groups, heads = k.shape[1], q.shape[1]
    kk = k.double().repeat_interleave(heads // groups, dim=1)
    vv = v.double().repeat_interleave(heads // groups, dim=1)
    scores = q.double() @ kk.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask.double()
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return (probs @ vv).transpose(1, 2)  # [B, T, H, D]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [8, 20, 40, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("length, rows", [(0, 1), (5, 1), (16, 3), (37, 8), (100, 2), (70, 29), (33, 64)])
def test_the_attention_kernel_is_attention_up_to_rounding(kernel, dim, length, rows, dtype):
    """Every head size the kernel takes (its 16-, 32-, 64-, 128- and 256-wide paths and their
    tails), caches shorter and longer than its 16-key blocks, keys sliced from a longer buffer,
    a mask read with a stride, a row that may see nothing (zeros, as sdpa gives), passes of up to
    64 rows (the values' sums shared by up to four rows of a key-value head); bf16 within its
    rounding, float32 within float32's."""
    torch.manual_seed(dim * 100 + length + rows)
    q = torch.randn(2, 6, rows, dim, dtype=dtype)
    cache_k = torch.randn(2, 2, length + 9, dim, dtype=dtype)
    cache_v = torch.randn(2, 2, length + 9, dim, dtype=dtype)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]  # the stored part of a longer cache
    allowed = torch.rand(2, 1, rows, length) > 0.3
    if length:
        allowed[..., 0] = True
        allowed[1, 0, rows - 1] = False  # a row that may see nothing
    wide = torch.zeros(2, 1, rows, 2 * max(length, 1))
    mask = wide[..., ::2][..., :length]  # last stride 2
    mask.masked_fill_(~allowed, float("-inf"))
    out = kernel.decode_attention(q, k, v, mask, dim ** -0.5)
    expected = _attention_float64(q, k, v, mask, dim ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    if length:
        assert (out[1, rows - 1] == 0).all()
    boolean = kernel.decode_attention(q, k, v, torch.zeros(2, 1, rows, 2 * max(length, 1), dtype=torch.bool)
                                      [..., ::2][..., :length].copy_(allowed), dim ** -0.5)
    assert torch.equal(boolean, out)  # a boolean mask reads as the additive one
    none = kernel.decode_attention(q, k, v, None, dim ** -0.5)
    torch.testing.assert_close(none.double(), _attention_float64(q, k, v, None, dim ** -0.5), rtol=tol, atol=tol)
    # a row's output does not depend on the rows and heads it shares a pass with
    last = kernel.decode_attention(q[:, :, -1:], k, v, mask[:, :, -1:], dim ** -0.5)
    assert torch.equal(last[:, 0], out[:, -1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("open_keys", [1, 15, 16, 37, 64])
def test_attention_over_a_buffer_with_a_shut_tail_has_the_bits_of_the_open_keys_alone(kernel, dtype, open_keys):
    """A compiled pass attends over a cache buffer of fixed capacity whose tail is not written
    yet (shut by its mask: false, -inf or the dtype's lowest); `generate` attends over the keys
    written so far. Every row's output has the same bits both ways, whatever the keys' count
    modulo the kernel's 16-key blocks, and a row the mask shuts out of every key by a finite lowest
    value still weighs every key alike, as sdpa does."""
    torch.manual_seed(open_keys)
    capacity, dim = 80, 64
    q = torch.randn(1, 9, 3, dim, dtype=dtype)
    k, v = torch.randn(1, 3, capacity, dim, dtype=dtype), torch.randn(1, 3, capacity, dim, dtype=dtype)
    allowed = torch.rand(1, 1, 3, open_keys) > 0.2
    allowed[..., -1] = True  # each row's own, last, key
    for shut in ("bool", float("-inf"), torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min):
        def mask_of(a):
            return a if shut == "bool" else torch.zeros(a.shape).masked_fill(~a, shut)
        full = torch.zeros(1, 1, 3, capacity, dtype=torch.bool)
        full[..., :open_keys] = allowed
        over_buffer = kernel.decode_attention(q, k, v, mask_of(full), dim ** -0.5)
        written = kernel.decode_attention(q, k[:, :, :open_keys], v[:, :, :open_keys], mask_of(allowed), dim ** -0.5)
        assert torch.equal(over_buffer, written), shut
    lowest = torch.full((1, 1, 3, capacity), torch.finfo(torch.float32).min)  # every key shut by a finite value
    out = kernel.decode_attention(q, k, v, lowest, dim ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    alike = v.double().mean(2).repeat_interleave(3, dim=1)[:, None].expand(1, 3, 9, dim)  # [B, T, H, D]
    torch.testing.assert_close(out.double(), alike, rtol=tol, atol=tol)


def test_the_attention_kernel_refuses_what_it_cannot_attend(kernel):
    q = torch.randn(1, 4, 1, 64, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 10, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must all be bfloat16 or all float32"):
        kernel.decode_attention(q.float(), k, v, None, 0.1)  # mixed dtypes
    with pytest.raises(RuntimeError, match="must all be bfloat16 or all float32"):
        kernel.decode_attention(q.half(), k.half(), v.half(), None, 0.1)
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        kernel.decode_attention(torch.randn(1, 3, 1, 64, dtype=torch.bfloat16), k, v, None, 0.1)
    with pytest.raises(RuntimeError, match="float32 additive or boolean mask"):
        kernel.decode_attention(q, k, v, torch.ones(1, 1, 1, 10, dtype=torch.int64), 0.1)


@pytest.mark.skipif(not cpu_kernels_available() or torch.bfloat16 not in packed_dtypes(), reason="no oneDNN bf16 here")
def test_an_input_of_another_width_is_refused_not_multiplied(kernel):
    layer = nn.Linear(64, 16).to(torch.bfloat16).eval()
    pack_linear_layers(layer)
    with torch.no_grad(), pytest.raises(RuntimeError):
        layer(torch.randn(1, 40, dtype=torch.bfloat16))  # an input of another width: oneDNN (which refuses it), never the kernel


def test_attention_with_autograd_keeps_its_gradients(kernel):
    """With autograd recording, the decoding attention takes torch's operators (the kernel has
    no backward): the gradients arrive."""
    from types import SimpleNamespace

    from streamspec.kernels import decode_attention_forward

    q = torch.randn(1, 6, 1, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.randn(1, 2, 12, 16, dtype=torch.bfloat16), torch.randn(1, 2, 12, 16, dtype=torch.bfloat16)
    out, _ = decode_attention_forward(SimpleNamespace(num_key_value_groups=3, is_causal=True), q, k, v,
                                      torch.ones(1, 1, 1, 12, dtype=torch.bool), scaling=0.25)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_attention_calls_the_kernel(counting, dtype, backend):
    """Inside a compiled graph the decoding attention is the C++ operator
    ``streamspec_native::decode_attention`` (its shape function right), the same result as eager."""
    from types import SimpleNamespace

    from streamspec.kernels import decode_attention_forward

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q = torch.randn(1, 6, 2, 64, dtype=dtype)
    k, v = torch.randn(1, 2, 40, 64, dtype=dtype), torch.randn(1, 2, 40, 64, dtype=dtype)
    mask = torch.rand(1, 1, 2, 40) > 0.2
    with torch.no_grad():
        eager = decode_attention_forward(module, q, k, v, mask, scaling=0.125)[0]
        assert counting.counts["decode_attention"] == 1  # eager: through the module
        step = torch.compile(lambda *a: decode_attention_forward(module, *a, scaling=0.125)[0], backend=backend,
                             fullgraph=True, dynamic=False)
        step(q, k, v, mask)
        compiled = []
        ops = native_op_calls(lambda: compiled.append(step(q, k, v, mask)))
    assert ops["decode_attention"] == 1 and torch.equal(compiled[0], eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_layers_take_the_cpp_operator_and_see_every_weight_change(kernel, dtype):
    """Inside a compiled graph a packed layer of a few rows is ``streamspec_native::linear_of``,
    which finds the weight's pack in C++: the very pack the layer made (the same bits as eager),
    packed again when the weight changes in place or is replaced, never served stale."""
    if dtype not in packed_dtypes():
        pytest.skip("this CPU does not pack this dtype")
    torch.manual_seed(1)
    layer = nn.Linear(63, 70).to(dtype).eval()  # an odd K and a partial last tile
    pack_linear_layers(layer)
    step = torch.compile(lambda a: layer(a), fullgraph=True, dynamic=False)
    x = torch.randn(1, 3, 63, dtype=dtype)
    with torch.no_grad():
        own = layer.__dict__["_streamspec_packed"][1][1]  # the pack the layer made
        step(x)  # (compiles)
        out = []
        assert native_op_calls(lambda: out.append(step(x)))["linear"] == 1
        assert torch.equal(out[0], layer(x))  # compiled and eager: one kernel
        assert kernel.pack_of(layer.weight).data_ptr() == own.data_ptr()  # and one pack, not a second
        layer.weight.mul_(-3)  # in place: the version moves
        assert torch.equal(step(x), layer(x))
        within_rounding(step(x)[0], x[0], layer.weight, layer.bias)
        layer.weight = nn.Parameter(torch.randn(70, 63, dtype=dtype))  # a new tensor
        assert torch.equal(step(x), layer(x))
        within_rounding(step(x)[0], x[0], layer.weight, layer.bias)


def test_linear_of_refuses_another_width_and_drops_dead_weights(kernel):
    weight = torch.randn(16, 63, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 62 inputs"):  # (62 would fit the padded pack of 63)
        torch.ops.streamspec_native.linear_of(torch.randn(1, 62, dtype=torch.bfloat16), weight, None)
    gc.collect()  # (the weights of earlier tests that are gone)
    held = kernel.packs_held()
    torch.ops.streamspec_native.linear_of(torch.randn(1, 63, dtype=torch.bfloat16), weight, None)
    assert kernel.packs_held() == held + 1
    del weight
    gc.collect()
    assert kernel.packs_held() == held
    layer = nn.Linear(32, 8).to(torch.bfloat16)
    pack_linear_layers(layer)
    assert kernel.packs_held() == held + 1
    unpack_linear_layers(layer)
    assert kernel.packs_held() == held
    # a packed layer that dies takes its pack along (its weight's finalizer), with no sweep asked for
    layer = nn.Linear(32, 8).to(torch.bfloat16)
    pack_linear_layers(layer)
    assert kernel.packs_held(sweep=False) == held + 1
    del layer
    gc.collect()
    assert kernel.packs_held(sweep=False) == held
    # packed again without streamspec's kernel: the C++ operator's pack goes too
    layer = nn.Linear(32, 8).to(torch.bfloat16)
    pack_linear_layers(layer)
    pack_linear_layers(layer, own_kernel=False)
    assert kernel.packs_held(sweep=False) == held
