"""A key/value cache that keeps main-stream entries only.

Streams keep no cache of their own (METHOD §1): their keys and values exist only inside the
forward pass that made them. The HF attention modules call ``cache.update(k, v, layer_idx)``
with every query's keys and attend to what it returns, so this cache returns past + all new
entries (streams included, for this pass) but stores only the first ``main_length`` new ones.
"""

from __future__ import annotations

import torch


class MainStreamCache:
    """Per-layer main-stream keys/values, [B, kv_heads, length, head_dim] each."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # How many of the next update's entries are main positions (None: all of them).
        self.main_length: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        n = key_states.shape[-2] if self.main_length is None else self.main_length
        past_k, past_v = self.keys[layer_idx], self.values[layer_idx]
        keys = key_states[..., :n, :] if past_k is None else torch.cat([past_k, key_states[..., :n, :]], dim=-2)
        values = value_states[..., :n, :] if past_v is None else torch.cat([past_v, value_states[..., :n, :]], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        if n == key_states.shape[-2]:
            return keys, values
        return (
            torch.cat([keys, key_states[..., n:, :]], dim=-2),
            torch.cat([values, value_states[..., n:, :]], dim=-2),
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        k = self.keys[layer_idx]
        return 0 if k is None else k.shape[-2]

    def keep(self, prefix_length: int, new_index: torch.Tensor, layers: range | None = None) -> None:
        """Keep the first `prefix_length` entries, then the entries at `new_index` (positions after
        the prefix, e.g. an accepted tree path), contiguous and in that order; in `layers` only
        (default all)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is None or (layers is not None and i not in layers):
                continue
            idx = torch.cat([torch.arange(prefix_length, device=k.device), prefix_length + new_index.to(k.device)])
            self.keys[i], self.values[i] = k.index_select(-2, idx), v.index_select(-2, idx)

    def crop(self, length: int) -> None:
        """Drop every entry at or after `length`."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]
