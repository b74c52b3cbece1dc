"""Cross-entropy through the LM head without materialising every logit at once.

With γ streams the top layers produce (1+γ)·T hidden states per sequence; their logits over a
49k vocabulary would be the largest tensor of a training step. Only rows with a target are sent
through the head, a chunk at a time. For a plain linear head the gradients are computed in the
same pass (fused linear cross-entropy), so nothing is recomputed and no chunk's logits outlive
it; any other head goes through activation checkpointing per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels import PackedLinear
from .zero import gathered, is_partitioned


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Σ_i w_i · CE(x_i·Wᵀ + b, y_i); forward also computes the gradients, chunk by chunk."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, row_weights, chunk_size):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        per_row = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        # The loss scale of fp16 training arrives only in backward (grad_total): an fp16 buffer
        # would flush the small unscaled gradients to zero before it is applied, so keep float32.
        grad_x = torch.empty_like(x, dtype=torch.float32 if x.dtype == torch.float16 else x.dtype) if need_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, x.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            xs, ys, ws = x[rows], targets[rows], row_weights[rows]
            logits = F.linear(xs, weight, bias).float()
            lse = torch.logsumexp(logits, dim=-1)
            ce = lse - logits.gather(1, ys[:, None])[:, 0]
            per_row[rows] = ce
            total += (ce * ws).sum()
            if need_x or need_w or need_b:
                # d(w·CE)/dlogits = w·(softmax − onehot), reusing the logits buffer. The product
                # with the weight runs in its dtype on softmax − onehot (in [−1, 1]) and the row
                # weight w (1/rows of the term: tiny) is applied after, in float32, so nothing
                # underflows in a reduced-precision matmul.
                grad = logits.sub_(lse[:, None]).exp_()
                grad[torch.arange(len(ys), device=x.device), ys] -= 1
                if need_x:
                    grad_x[rows] = ((grad.to(weight.dtype) @ weight).float() * ws[:, None]).to(grad_x.dtype)
                grad.mul_(ws[:, None])
                if need_w:
                    grad_w += grad.t() @ xs.float()
                if need_b:
                    grad_b += grad.sum(0)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(per_row)
        return total, per_row

    @staticmethod
    def backward(ctx, grad_total, grad_per_row):
        # scaled (by fp16 training's loss scale, in grad_total) before the cast to the inputs' dtype
        grads = [None if g is None else (g * grad_total).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*grads, None, None, None)


def _checkpointed_rows(head, x, targets):
    return F.cross_entropy(head(x).float(), targets, reduction="none")


def frozen(module: nn.Module):
    """`module` as a function of its input only: its parameters are used detached, so a loss
    computed through it sends no gradient into them. When none of them trains (LoRA or lossless
    training, inference) that is the module itself, called as usual (as DeepSpeed ZeRO-3 needs:
    it gathers a module's partitioned weights around its calls)."""
    if not any(p.requires_grad for p in module.parameters()):
        return module
    if any(is_partitioned(p) for p in module.parameters()):
        raise NotImplementedError(
            f"a trainable {type(module).__name__} partitioned by ZeRO-3 cannot be used with detached weights: "
            "train LoRA (or lossless streams) under ZeRO-3, or use ZeRO-2 for a full fine-tune"
        )
    params = {name: p.detach() for name, p in module.named_parameters()}
    return lambda *args: torch.func.functional_call(module, params, args)


def weighted_cross_entropy(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_size: int = 256,
    freeze_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_i row_weights[i] · CE(head(hidden[i]), targets[i]) over [N, h] rows that all have a target.

    Args:
        head: the LM head module (hidden -> logits).
        hidden: [N, h] rows, already through the final norm.
        targets: [N] token ids (no -100 here: select rows first).
        row_weights: [N] float weights (e.g. a term's weight ÷ its row count).
        chunk_size: rows per head call.
        freeze_head: send no gradient into the head's parameters (only into `hidden`).

    Returns the weighted sum (a differentiable 0-dim tensor) and each row's CE (detached).
    """
    row_weights = row_weights.to(torch.float32)
    fused = type(head) in (nn.Linear, PackedLinear) and head.weight.dim() == 2
    head_trains = not freeze_head and any(p.requires_grad for p in head.parameters())
    if fused and not (head_trains and is_partitioned(head.weight)):
        # The forward pass computes every gradient, so a ZeRO-3 weight is gathered for it only
        # (backward needs no weight). A trainable one takes the checkpointed path instead: its
        # gradient must reach it through a call of the head module, whose hooks ZeRO-3 serves.
        with gathered(head.parameters()):
            weight, bias = head.weight, head.bias
            if freeze_head:
                weight, bias = weight.detach(), None if bias is None else bias.detach()
            return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, row_weights, chunk_size)
    # Any other head (a peft-wrapped one, say): checkpoint each chunk instead.
    if freeze_head:
        head = frozen(head)
    per_row = []
    for start in range(0, hidden.shape[0], chunk_size):
        x, y = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if torch.is_grad_enabled():
            per_row.append(checkpoint(_checkpointed_rows, head, x, y, use_reentrant=False))
        else:
            per_row.append(_checkpointed_rows(head, x, y))
    ce = torch.cat(per_row) if per_row else hidden.new_zeros(0, dtype=torch.float32)
    return (ce * row_weights).sum(), ce.detach()


@torch.no_grad()
def cross_entropy_and_hits(head, hidden: torch.Tensor, targets: torch.Tensor,
                           chunk_size: int = 256) -> tuple[float, torch.Tensor]:
    """Summed CE and, per row, whether its top-1 prediction equals the target, chunk by chunk."""
    loss_sum, hits = 0.0, []
    for start in range(0, hidden.shape[0], chunk_size):
        logits = head(hidden[start : start + chunk_size]).float()
        y = targets[start : start + chunk_size]
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        hits.append(logits.argmax(-1) == y)
    return loss_sum, torch.cat(hits) if hits else targets.new_zeros(0, dtype=torch.bool)


def cross_entropy_and_top1(head, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int = 256) -> tuple[float, int]:
    """Summed CE and the number of rows whose top-1 prediction equals the target, chunk by chunk."""
    loss_sum, hits = cross_entropy_and_hits(head, hidden, targets, chunk_size)
    return loss_sum, int(hits.sum())
