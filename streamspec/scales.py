"""The scales the streams are built in, shared by the patch (training, streamspec's decoders) and the
vLLM drafter (which runs in vLLM's own environment: torch only here)."""

from __future__ import annotations

import torch

# added to the mean square of an embedding before its root is taken (`over_rms`)
EMBEDDING_EPS = 1e-6


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square over the last dimension, in float32 and detached (a scale, not a path for
    gradients): the unit the stream vectors and the next-token term are expressed in."""
    return x.detach().float().pow(2).mean(-1, keepdim=True).sqrt()


def over_rms(x: torch.Tensor) -> torch.Tensor:
    """`x` over its root mean square (the denominator detached): a token's input embedding as the
    next-token map reads it."""
    return x / x.detach().pow(2).mean(-1, keepdim=True).add(EMBEDDING_EPS).sqrt()
