"""weighted_cross_entropy: the fused and the checkpointed paths equal a naive full-logits loss,
in value and in gradients, whatever the chunk size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from streamspec.patch.loss import weighted_cross_entropy


def _naive(head, x, y, w):
    ce = F.cross_entropy(head(x).float(), y, reduction="none")
    return (ce * w).sum(), ce


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
@pytest.mark.parametrize("wrap", [False, True], ids=["fused", "checkpointed"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_naive_loss_and_gradients(chunk_size, wrap, bias):
    torch.manual_seed(chunk_size)
    linear = nn.Linear(8, 13, bias=bias)
    head = nn.Sequential(linear) if wrap else linear  # a non-Linear head takes the checkpointed path
    x = torch.randn(11, 8, requires_grad=True)
    y = torch.randint(0, 13, (11,))
    w = torch.rand(11)
    params = [x, linear.weight] + ([linear.bias] if bias else [])

    expected, expected_rows = _naive(head, x, y, w)
    got, rows = weighted_cross_entropy(head, x, y, w, chunk_size=chunk_size)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(rows, expected_rows.detach())
    assert not rows.requires_grad
    for a, b in zip(_grads(got * 2.5, params), _grads(expected * 2.5, params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_frozen_head_gets_no_gradient_and_no_grad_mode_works():
    linear = nn.Linear(8, 13)
    linear.requires_grad_(False)
    x = torch.randn(5, 8, requires_grad=True)
    y = torch.randint(0, 13, (5,))
    loss, _ = weighted_cross_entropy(linear, x, y, torch.ones(5), chunk_size=2)
    loss.backward()
    assert linear.weight.grad is None and x.grad is not None
    with torch.no_grad():
        value, rows = weighted_cross_entropy(linear, x, y, torch.ones(5))
    torch.testing.assert_close(value, rows.sum())


def test_empty_rows_give_zero():
    linear = nn.Linear(4, 6)
    loss, rows = weighted_cross_entropy(linear, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert loss.item() == 0 and rows.numel() == 0


@pytest.mark.parametrize("wrap", [False, True], ids=["fused", "checkpointed"])
def test_fp16_gradients_are_scaled_before_the_cast(wrap):
    """fp16 training multiplies the loss by a scale so that small gradients survive the cast to
    fp16; the fused path computes its gradients in the forward pass, before that scale is known,
    and must keep them until backward in float32. Row weights of 1/rows make the unscaled input
    gradients smaller than fp16's smallest subnormal: with the scale they must come out as the
    float32 reference, with none flushed to zero."""
    torch.manual_seed(0)
    rows, hidden, vocab, scale = 64, 16, 50, 2.0**16
    linear = nn.Linear(hidden, vocab, bias=False).half()
    head = nn.Sequential(linear) if wrap else linear
    x = torch.randn(rows, hidden).half().requires_grad_(True)
    y = torch.randint(0, vocab, (rows,))
    w = torch.full((rows,), 1e-5 / rows)  # as for a term of many rows with a small weight

    x32 = x.detach().float().requires_grad_(True)
    head32 = nn.Linear(hidden, vocab, bias=False)
    head32.weight.data = linear.weight.data.float()
    expected = torch.autograd.grad(_naive(head32, x32, y, w)[0], [x32])[0]  # float32 throughout
    assert (expected.abs() < 6e-8).float().mean() > 0.5, "the test needs gradients that fp16 cannot hold unscaled"

    loss, _ = weighted_cross_entropy(head, x, y, w, chunk_size=16, freeze_head=True)
    (grad,) = torch.autograd.grad(loss * scale, [x])
    assert grad.dtype == torch.float16
    got = grad.float() / scale
    assert not ((got == 0) & (expected != 0)).any(), "gradients flushed to zero"
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-3 * expected.abs().max().item())
