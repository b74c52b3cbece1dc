"""Pure functions that lay out main and stream positions and who may attend to whom.

Conventions used throughout streamspec:

- A forward pass has ``P`` cached (past) main positions and ``T`` new main positions.
- In the MSA layers the sequence is ``[T main positions] + [S slots × γ streams]``: slot ``s``
  belongs to main position ``index[b, s]`` and its stream ``j`` (1..γ) sits at
  ``T + s·γ + (j−1)``. ``valid[b, s]`` is False for slots that only pad the batch.
- Masks are boolean "may attend" tensors of shape ``[B, queries, keys]``; `to_bias` turns one
  into the additive mask the HF attention kernels take.

Nothing here touches a model, so every rule is tested on its own.
"""

from __future__ import annotations

import torch


def carrying_positions(real: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Which positions carry γ streams. This rule defines the model in shared mode.

    A position carries streams when its next-token target is trained (``labels[t+1] != -100``):
    prompt positions carry none except the last one, whose target is the first completion token.
    Without labels (inference) every real position carries them; at decoding time this means the
    last prompt position and every generated position, as in training.

    Args:
        real: [B, T] bool, True for real (non-padding) tokens.
        labels: [B, T] token labels aligned with the inputs (HF convention), or None.
    """
    if labels is None:
        return real.clone()
    carry = torch.zeros_like(real)
    carry[:, :-1] = labels[:, 1:] != -100
    return carry & real


def last_real_positions(real: torch.Tensor) -> torch.Tensor:
    """[B] the index of each row's last real position (left or right padding), from [B, T] bool."""
    return (torch.arange(real.shape[1], device=real.device) * real).argmax(dim=1)


def stream_slots(carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the carrying positions of each row into ``S`` = max-per-row slots.

    Returns ``index`` [B, S] (positions, in increasing order; padding slots point at some
    non-carrying position) and ``valid`` [B, S].
    """
    counts = carry.sum(dim=1)
    num_slots = int(counts.max()) if carry.numel() else 0
    # A stable sort of "not carrying" puts the carrying positions first, in their order.
    order = torch.sort((~carry).to(torch.int8), dim=1, stable=True).indices
    index = order[:, :num_slots]
    valid = torch.arange(num_slots, device=carry.device)[None, :] < counts[:, None]
    return index, valid


def position_ids_from_mask(real: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens, so left and right padding give the same result."""
    return (real.long().cumsum(dim=1) - 1).clamp(min=0)


def stream_position_ids(position_ids: torch.Tensor, index: torch.Tensor, num_streams: int) -> torch.Tensor:
    """Position id of stream j at position t is pos(t) + j: the position of the token it stands in
    for (stream j predicts the token at t+1+j, as the main stream at t+j predicts t+j+1).

    Returns [B, S·γ] in slot-major order.
    """
    base = position_ids.gather(1, index)
    offsets = torch.arange(1, num_streams + 1, device=position_ids.device)
    return (base[:, :, None] + offsets).flatten(1)


def main_allowed(new_allowed: torch.Tensor, key_real: torch.Tensor) -> torch.Tensor:
    """Who a main query may attend to among ``P`` past and ``T`` new main keys.

    Args:
        new_allowed: [B or 1, T, T] bool, new-to-new visibility (causal, or a tree's ancestors).
        key_real: [B, P+T] bool, True for real (cached or new) keys.

    Returns [B, T, P+T]. A padding query may always see itself, so that no row of the softmax
    is empty (its output is never read).
    """
    batch, total = key_real.shape
    num_new = new_allowed.shape[-1]
    past = total - num_new
    allowed = torch.cat(
        [key_real[:, None, :past].expand(batch, num_new, past), new_allowed & key_real[:, None, past:]], dim=-1
    )
    diag = torch.arange(num_new, device=key_real.device)
    allowed[:, diag, past + diag] |= ~key_real[:, past:]
    return allowed


def stream_allowed(
    main_ok: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, num_streams: int, shared: bool
) -> torch.Tensor:
    """Who may attend to whom in an MSA layer, over ``[T main] + [S·γ streams]`` queries and
    ``[P past] + [T main] + [S·γ streams]`` keys (METHOD §1):

    - stream j of position t sees what main t sees (main keys ≤ t) and streams 1..j of t;
    - main t sees main keys as usual and, in shared mode only, all γ streams of its own position;
    - no query ever sees another position's streams.

    Returns [B, T+S·γ, P+T+S·γ] bool.
    """
    batch, num_new, num_keys = main_ok.shape
    num_slots = index.shape[1]
    g = num_streams
    device = main_ok.device

    # main -> streams: only the slots of the query's own position (and only in shared mode)
    own = (index[:, None, :] == torch.arange(num_new, device=device)[None, :, None]) & valid[:, None, :]
    main_to_streams = (own & shared)[..., None].expand(batch, num_new, num_slots, g).flatten(2)

    # streams -> main: the row of the position the slot belongs to
    rows = main_ok.gather(1, index[:, :, None].expand(batch, num_slots, num_keys))
    stream_to_main = rows[:, :, None, :].expand(batch, num_slots, g, num_keys).reshape(batch, num_slots * g, num_keys)

    # streams -> streams: same slot, stream j' <= j
    same_slot = torch.eye(num_slots, dtype=torch.bool, device=device)
    lower = torch.ones(g, g, dtype=torch.bool, device=device).tril()
    stream_to_stream = (same_slot[:, None, :, None] & lower[None, :, None, :]).reshape(num_slots * g, num_slots * g)

    top = torch.cat([main_ok, main_to_streams], dim=-1)
    bottom = torch.cat([stream_to_main, stream_to_stream.expand(batch, -1, -1)], dim=-1)
    return torch.cat([top, bottom], dim=1)


def to_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [B, Q, K] → additive [B, 1, Q, K] mask (0 where allowed, dtype's min elsewhere)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, neg)[:, None]


def causal(num_new: int, device: torch.device | None = None) -> torch.Tensor:
    """[1, T, T] lower-triangular visibility among new positions."""
    return torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()[None]


def row_allowed(prompt_real: torch.Tensor, row_lengths: torch.Tensor, width: int, num_new: int) -> torch.Tensor:
    """Who a main query may attend to in a `streamspec.decoding.cache.RowCache`, where row b's stored
    entries are its prompt (``prompt_real`` [B, T0], padding included) then the tokens it
    accepted, ``row_lengths[b]`` in all, and this pass's ``num_new`` entries follow them.

    Returns [B, num_new, width + num_new] over the cache's region (``width`` ≥ every row's
    length): new query i of row b sees row b's real entries before ``row_lengths[b] + i``, itself
    included; entries past a row's own (another row is longer, or rejected drafts) are hidden.
    """
    batch, prompt = prompt_real.shape
    total = width + num_new
    real = torch.cat([prompt_real, prompt_real.new_ones(batch, total - prompt)], dim=1)
    keys = torch.arange(total, device=prompt_real.device)
    limit = row_lengths[:, None, None] + torch.arange(num_new, device=prompt_real.device)[None, :, None]
    return real[:, None, :] & (keys[None, None, :] <= limit)
