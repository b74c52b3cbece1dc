"""Cross-entropy through the LM head without materialising every logit at once.

With γ streams the top layers produce (1+γ)·T hidden states per sequence; their logits over a
49k vocabulary would be the largest tensor of a training step. Only positions with a target are
sent through the head, a chunk at a time, and under autograd each chunk is recomputed in the
backward pass instead of being stored.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def chunked_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, int]:
    """Sum of CE(head(hidden[i]), targets[i]) over rows whose target is not -100.

    Args:
        head: hidden [N, h] -> logits [N, V].
        hidden: [..., h] hidden states.
        targets: [...] token ids, -100 where no loss is taken.
        chunk_size: rows per head call.

    Returns the summed loss (a 0-dim tensor) and the number of rows it covers.
    """
    keep = targets != -100
    rows, labels = hidden[keep], targets[keep]
    count = int(labels.numel())
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, count, chunk_size):
        h, y = rows[start : start + chunk_size], labels[start : start + chunk_size]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, head, h, y, use_reentrant=False)
        else:
            total = total + _chunk_loss(head, h, y)
    return total, count
