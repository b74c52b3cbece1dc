"""Decoding a streamed model.

`generate_autoregressive` is plain greedy decoding of a `StreamedModel`, one token per forward
pass, with the main-stream KV cache: the reference that speculative decoding must reproduce. The
carrying rule (`streamspec.layout.carrying_positions`) holds here too: the last prompt position
and every generated position carry γ streams, so in shared mode the main stream sees them
exactly as in training.
"""

from __future__ import annotations

import torch

from .cache import MainStreamCache
from .layout import causal, main_allowed
from .model import StreamedModel


@torch.no_grad()
def generate_autoregressive(
    model: StreamedModel, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None
) -> torch.Tensor:
    """Greedy decoding, one token per pass. `input_ids` is [1, T]; returns the new tokens [1, n]
    (stopping after an EOS token, which is included)."""
    if not isinstance(model, StreamedModel):
        raise TypeError(f"generate_autoregressive needs a StreamedModel, got {type(model).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [1, T] tensor, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    device = input_ids.device
    cache = MainStreamCache(len(model.layers))
    one_slot = torch.zeros(1, 1, dtype=torch.long, device=device)  # streams at the last new position
    valid = torch.ones(1, 1, dtype=torch.bool, device=device)
    tokens, generated = input_ids, []
    past = 0
    for _ in range(max_new_tokens):
        n = tokens.shape[1]
        positions = torch.arange(past, past + n, device=device)[None]
        main_ok = main_allowed(causal(n, device), torch.ones(1, past + n, dtype=torch.bool, device=device))
        lower = model.run_lower(tokens, positions, main_ok, cache)
        main, _ = model.run_upper(lower, positions, main_ok, one_slot + (n - 1), valid, cache)
        token = model.head(main[:, -1]).argmax(-1, keepdim=True)
        generated.append(token)
        past += n
        tokens = token
        if int(token) in stop:
            break
    return torch.cat(generated, dim=1)
