"""Main-stream keys and values of the MSA layers, computed once and attended to by streams alone.

In lossless mode the main stream never sees a stream, so its keys and values in the MSA layers are
a fixed function of the text. Offline training (`streamspec.training.activations`) computes them
once per example (`KVCapture`), stores them, and later runs only the stream rows through the MSA
layers, each layer attending to the stored main entries followed by the pass's own stream
entries (`KVPrefix`). Both speak the cache protocol the HF attention modules use
(``update(key_states, value_states, layer_idx)`` returns the keys and values to attend to).
"""

from __future__ import annotations

import torch


class KVCapture:
    """Records what each layer's attention computed for its (main) rows, and attends to just that."""

    main_length: int | None = None

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # nothing came before this pass


class KVPrefix:
    """Stored main keys/values [B, kv_heads, T, head_dim] per layer index, put before each layer's
    new (stream) entries; nothing new is stored."""

    main_length: int | None = 0

    def __init__(self, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor]) -> None:
        if set(keys) != set(values):
            raise ValueError("KVPrefix needs keys and values for the same layers")
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx not in self.keys:
            raise KeyError(f"no stored main keys for layer {layer_idx} (stored: {sorted(self.keys)})")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        return (torch.cat([keys.to(key_states.dtype), key_states], dim=-2),
                torch.cat([values.to(value_states.dtype), value_states], dim=-2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return next(iter(self.keys.values())).shape[-2]
