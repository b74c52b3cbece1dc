"""Offline training's forward pieces (`streamspec.training.activations`): in lossless mode the main
stream is a fixed function of the text, so it is computed once (`capture_main`: its final hidden
states and the MSA layers' main keys and values) and each later epoch runs only the stream rows
against the stored activations (`run_streams`, `_offline_hidden`). A mixin of `StreamedModel`."""

from __future__ import annotations

import torch

from .layout import carrying_positions, causal, main_allowed, position_ids_from_mask, stream_allowed, \
    stream_position_ids, stream_slots, to_bias
from .objective import check_activations
from .prefix import KVCapture, KVPrefix


class OfflineStreams:
    """`StreamedModel`'s offline-training methods (see the module docstring)."""

    @torch.no_grad()
    def capture_main(self, lower: torch.Tensor, position_ids: torch.Tensor, main_ok: torch.Tensor):
        """The main stream through the MSA layers alone (lossless mode: it never sees a stream).
        Returns its final hidden states [B, T, h] and each MSA layer's main keys and values
        ``{layer_idx: [B, kv_heads, T, head_dim]}`` (what `run_streams` attends to)."""
        self._require_lossless("capture_main")
        capture = KVCapture()
        main = self._run_msa(lower, position_ids, to_bias(main_ok, lower.dtype), capture, num_main=lower.shape[1])
        expected = list(range(self.num_lower_layers, len(self.layers)))
        if sorted(capture.keys) != expected:
            raise RuntimeError(f"the MSA layers reported keys for layers {sorted(capture.keys)}, expected {expected}")
        return main, capture.keys, capture.values

    def run_streams(self, origin: torch.Tensor, position_ids: torch.Tensor, main_ok: torch.Tensor,
                    index: torch.Tensor, valid: torch.Tensor, prefix: KVPrefix) -> torch.Tensor:
        """Stream rows only through the MSA layers, attending to the main keys and values in
        `prefix` (from `capture_main`): in lossless mode the same stream states as `run_upper`
        from `origin` [B, S, h], the hidden states at the input of layer N−Ns of the positions in
        `index`. Returns [B, S, γ, h] (before the final norm)."""
        self._require_lossless("run_streams")
        batch, num_slots, width = origin.shape
        g = self.stream_config.num_streams
        num_main = main_ok.shape[1]
        x = self.streams(origin).reshape(batch, num_slots * g, width)
        pos = stream_position_ids(position_ids, index, g)
        allowed = stream_allowed(main_ok, index, valid, g, shared=False)[:, num_main:]
        x = self._run_msa(x, pos, to_bias(allowed, x.dtype), prefix, num_main=0)
        return x.reshape(batch, num_slots, g, width)

    def _require_lossless(self, what: str) -> None:
        if self.stream_config.mode != "lossless":
            raise ValueError(f"{what} needs mode='lossless': in shared mode the main stream attends to the "
                             "streams, so it is not a fixed function of the text")

    def _offline_hidden(self, input_ids, attention_mask, labels, activations):
        """`_hidden` from stored activations (lossless mode): the hidden states at the input of layer
        N−Ns at the carrying positions, the MSA layers' main keys and values, and what the main
        stream predicted; only the stream rows run. Returns (lower, streams, index, valid, labels,
        stored, carry)."""
        self._require_lossless("offline training (activations)")
        real, labels = self._check_inputs(input_ids, attention_mask, labels)
        stored = check_activations(activations, input_ids.shape, len(self.layers) - self.num_lower_layers)
        carry = carrying_positions(real, labels)
        index, valid = stream_slots(carry)
        position_ids = position_ids_from_mask(real)
        main_ok = main_allowed(causal(input_ids.shape[1], input_ids.device), real)
        lower = stored["hidden"]
        origin = lower.gather(1, index[:, :, None].expand(*index.shape, lower.shape[-1]))
        layers = range(self.num_lower_layers, len(self.layers))
        prefix = KVPrefix({i: stored["keys"][:, n] for n, i in enumerate(layers)},
                          {i: stored["values"][:, n] for n, i in enumerate(layers)})
        streams = self.run_streams(origin, position_ids, main_ok, index, valid, prefix)
        return lower, streams, index, valid, labels, stored, carry
