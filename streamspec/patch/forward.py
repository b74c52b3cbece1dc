"""The training and scoring forward of a `streamspec.patch.model.StreamedModel`
(`TrainingForward.forward`: main, stream and early-exit predictions, and the loss), its
validation sums (`evaluate_counts`) and its output (`StreamedOutput`). The decoding passes live on
the model itself (`run_lower`, `run_upper`, `run_streams`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..arch import sliding_window
from .layout import carrying_positions, causal, last_real_positions, main_allowed, position_ids_from_mask, stream_slots
from .loss import cross_entropy_and_hits
from .objective import check_activations, loss_terms, main_outputs, offline_total_loss, stored_main_counts, total_loss
from .prefix import KVPrefix


@dataclass
class StreamedOutput(ModelOutput):
    """Output of `StreamedModel.forward`.

    Attributes:
        loss: α0·CE(main) + Σj αj·CE(stream j) + CE(early exit), when labels are given.
        loss_parts: each term before weighting: ``main``, ``stream_1``..``stream_γ``, ``early_exit``.
        logits: [B, T, V] main-stream logits (None when labels are given, unless asked for).
        stream_logits: [B, T, γ, V]; ``[:, t, j-1]`` predicts the token at t+1+j. Positions that
            carry no streams (see `stream_mask`) hold NaN.
        early_exit_logits: [B, T, V] logits read at the input of layer N−Ns.
        stream_mask: [B, T] bool, True where a position carries streams.
    """

    loss: torch.Tensor | None = None
    loss_parts: dict[str, torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    stream_logits: torch.Tensor | None = None
    early_exit_logits: torch.Tensor | None = None
    stream_mask: torch.Tensor | None = None


def chain_counts(streams_right: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, int]:
    """``chain_j_correct`` / ``chain_j_count`` for j ≥ 2 from each stream's (right, has a target)
    masks: of the positions where streams 1..j all have a target, those where all are right."""
    sums: dict[str, int] = {}
    if not streams_right:
        return sums
    right, keep = streams_right[0]
    for j, (right_j, keep_j) in enumerate(streams_right[1:], start=2):
        right, keep = right & right_j, keep & keep_j
        sums.update({f"chain_{j}_correct": int((right & keep).sum()), f"chain_{j}_count": int(keep.sum())})
    return sums


class TrainingForward:
    """The forward a `StreamedModel` trains and scores with (a mixin: it uses the model's
    `run_lower`, `run_upper`, `run_streams`, `head` and `early_exit_head`)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
        loss_chunk_size: int = 256,
        streams_at: str = "all",
        activations: dict[str, torch.Tensor] | None = None,
    ) -> StreamedOutput:
        """Main, stream and early-exit predictions for a batch, and the loss when labels are given.

        Args:
            input_ids: [B, T] token ids.
            attention_mask: [B, T], 1 for real tokens, 0 for padding (left or right).
            labels: [B, T] labels aligned with input_ids (HF convention: the model shifts them),
                -100 where no loss is taken. Decides which positions carry streams (see
                `streamspec.patch.layout.carrying_positions`).
            return_logits: also return the full logits tensors; default: only without labels.
            loss_chunk_size: positions per LM-head call in the loss.
            streams_at: without labels, which positions carry streams: ``"all"`` (every real
                position: stream predictions everywhere) or ``"last"`` (each row's last real
                position only: what decoding computes for a prompt, so in shared mode the last
                position's main logits are exactly decoding's first step; with ``"all"`` they
                differ there, since every earlier main position also attended to its own streams).
                With labels the labels decide, and this must stay ``"all"``.
            activations: offline training (lossless mode): the frozen main stream's stored
                activations for this batch, as `streamspec.training.activations.ActivationCollator`
                makes them; only the streams run, and loss and gradients equal the online path's.
        """
        if streams_at not in ("all", "last"):
            raise ValueError(f"streams_at must be 'all' or 'last', got {streams_at!r}")
        if streams_at != "all" and labels is not None:
            raise ValueError("streams_at='last' is for inference; with labels the labels decide which positions carry streams")
        if activations is None and labels is not None and not return_logits and self.runs_main_apart():
            activations = self.frozen_main(input_ids, attention_mask, labels, loss_chunk_size)
        if activations is not None:
            if labels is None or return_logits:
                raise ValueError("activations are for offline training: they need labels and give no logits")
            hidden = self._offline_hidden(input_ids, attention_mask, labels, activations)
            loss, parts = offline_total_loss(self, *hidden, loss_chunk_size)
            return StreamedOutput(loss=loss, loss_parts=parts, stream_mask=hidden[-1])
        lower, main, streams, index, valid, carry, labels = self._hidden(input_ids, attention_mask, labels, streams_at)
        if return_logits is None:
            return_logits = labels is None
        out = StreamedOutput(stream_mask=carry)
        if labels is not None:
            out.loss, out.loss_parts = total_loss(self, loss_terms(self, lower, main, streams, index, valid, labels), loss_chunk_size)
        if return_logits:
            out.logits = self.head(main)
            out.early_exit_logits = self.early_exit_head(lower)
            out.stream_logits = self._scatter_stream_logits(streams, index, valid, input_ids.shape[1])
        return out

    @torch.no_grad()
    def evaluate_counts(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
        chunk_size: int = 256, activations: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Sums for validation, per term (``main``, ``stream_j``, ``early_exit``): ``{term}_loss_sum``,
        ``{term}_correct`` (top-1 equals the target; for stream j the token at t+1+j) and
        ``{term}_count``; and for j ≥ 2 ``chain_j_correct`` / ``chain_j_count``: positions where
        streams 1..j are all right, of those where all have a target (what a chain's draft j is
        accepted at when decoding this text). Needs labels; never builds the full logits."""
        sums, streams_right, _ = self._scored(input_ids, attention_mask, labels, chunk_size, activations)
        sums.update(chain_counts(streams_right))
        return sums

    @torch.no_grad()
    def stream_hits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None, chunk_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position t and stream j, whether stream j's top-1 at t is its target (the token at
        t+1+j) and whether it has one: two [batch, length, γ] bool tensors. A greedy chain that
        decodes this text accepts, in the pass after the one that ended at t, the leading run of
        right drafts at t (`streamspec.training.draft_accuracy.chain_passes`)."""
        _, streams_right, index = self._scored(input_ids, attention_mask, labels, chunk_size, None)
        shape = (*input_ids.shape, len(streams_right))
        right = torch.zeros(shape, dtype=torch.long, device=input_ids.device)
        has_target = torch.zeros_like(right)
        for j, (hit, keep) in enumerate(streams_right):  # slots to positions (padding slots add nothing)
            right[:, :, j].scatter_add_(1, index, (hit & keep).long())
            has_target[:, :, j].scatter_add_(1, index, keep.long())
        return right > 0, has_target > 0

    def _scored(self, input_ids, attention_mask, labels, chunk_size, activations):
        """`evaluate_counts`' sums before the chain's, each stream's slot-shaped (right, has a
        target) masks, and the slots' positions."""
        if labels is None:
            raise ValueError("evaluate_counts needs labels")
        head = self.hf_model.get_output_embeddings()
        sums: dict[str, float] = {}
        if activations is None and self.runs_main_apart():
            activations = self.frozen_main(input_ids, attention_mask, labels, chunk_size)
        if activations is not None:
            lower, streams, index, valid, labels, stored, _ = self._offline_hidden(input_ids, attention_mask, labels, activations)
            sums.update(stored_main_counts(labels, stored))
            terms = loss_terms(self, lower, None, streams, index, valid, labels, own=stored.get("own"))
        else:
            lower, main, streams, index, valid, _, labels = self._hidden(input_ids, attention_mask, labels)
            terms = loss_terms(self, lower, main, streams, index, valid, labels)
        streams_right = []  # per stream: (right, has a target), each slot-shaped
        for name, hidden, target, _, transform in terms:
            keep = target != -100
            loss_sum, hits = cross_entropy_and_hits(head, transform(hidden[keep]), target[keep], chunk_size)
            sums.update({f"{name}_loss_sum": loss_sum, f"{name}_correct": int(hits.sum()), f"{name}_count": int(keep.sum())})
            if name.startswith("stream_"):
                right = torch.zeros_like(keep)
                right[keep] = hits
                streams_right.append((right, keep))
        return sums, streams_right, index

    def _hidden(self, input_ids, attention_mask, labels, streams_at: str = "all"):
        """The shared forward: final main and stream hidden states (before the final norm) and the
        hidden states at the input of layer N−Ns, with the stream layout."""
        real, labels = self._check_inputs(input_ids, attention_mask, labels)
        carry = carrying_positions(real, labels)
        if streams_at == "last":  # each row's last real position only, as decoding a prompt does
            carry = torch.zeros_like(real)
            carry[torch.arange(real.shape[0], device=real.device), last_real_positions(real)] = True
        index, valid = stream_slots(carry)
        position_ids = position_ids_from_mask(real)
        main_ok = main_allowed(causal(input_ids.shape[1], input_ids.device), real)
        lower = self.run_lower(input_ids, position_ids, main_ok)
        main, streams = self.run_upper(lower, position_ids, main_ok, index, valid,
                                       next_tokens=self._next_tokens(input_ids, index))
        return lower, main, streams, index, valid, carry, labels

    #: False: training and validation run the main rows through the MSA layers with the stream
    #: rows even when `runs_main_apart` could (the path of shared mode; a reference for the tests
    #: and for `streamspec.training.profiling.offline_step_time`)
    main_apart: bool = True

    def runs_main_apart(self) -> bool:
        """Lossless mode with the base frozen: the main stream is then a fixed function of the text,
        so training and validation compute it apart (`frozen_main`, no gradients) and run only the
        stream rows through the MSA layers with gradients, as offline training does. Not under
        gradient checkpointing: a checkpointed layer drops the main keys the stream rows read."""
        return (self.main_apart and self.stream_config.mode == "lossless"
                and not self._checkpointing()
                and not any(p.requires_grad for p in self.base.parameters()))

    def _checkpointing(self) -> bool:
        """Whether the base's layers run under gradient (activation) checkpointing."""
        hf = self.hf_model
        # transformers 5 names it is_activation_checkpointing (is_gradient_checkpointing before)
        return bool(hf.is_activation_checkpointing if hasattr(type(hf), "is_activation_checkpointing")
                    else hf.is_gradient_checkpointing)

    @torch.no_grad()
    def frozen_main(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor,
                    chunk: int = 256) -> dict[str, torch.Tensor]:
        """What the frozen main stream computes for a batch (lossless mode), in the layout offline
        training stores it (`streamspec.training.activations`): ``hidden`` [B, T, h] at the input of
        layer N−Ns, each MSA layer's main ``keys`` and ``values`` [B, Ns, kv_heads, T, head_dim], and
        the main term's ``main_ce`` and ``own`` [B, T] (`streamspec.patch.objective.main_outputs`)."""
        self._require_lossless("frozen_main")
        if labels is None:
            raise ValueError("frozen_main needs labels: they say which positions the main term scores")
        real, labels = self._check_inputs(input_ids, attention_mask, labels)
        position_ids = position_ids_from_mask(real)
        # without a mask where the attention's causal rule is the whole rule (its kernels then skip
        # the keys after each query); padded rows' outputs are never read
        main_ok = None if self.causal_alone(real) else main_allowed(causal(input_ids.shape[1], input_ids.device), real)
        lower = self.run_lower(input_ids, position_ids, main_ok)
        final, keys, values = self.capture_main(lower, position_ids, main_ok)
        layers = sorted(keys)
        main_ce, own = main_outputs(self.head, final, labels, chunk)
        return {"hidden": lower, "keys": torch.stack([keys[i] for i in layers], 1),
                "values": torch.stack([values[i] for i in layers], 1), "own": own, "main_ce": main_ce}

    def _offline_hidden(self, input_ids, attention_mask, labels, activations):
        """`_hidden` from the frozen main stream's activations (lossless mode; stored, or
        `frozen_main`'s): the hidden states at the input of layer N−Ns at the carrying positions,
        the MSA layers' main keys and values, and what the main stream predicted; only the stream
        rows run. Returns (lower, streams, index, valid, labels, stored, carry)."""
        self._require_lossless("offline training (activations)")
        if self._checkpointing() and self.training and torch.is_grad_enabled():
            raise ValueError("offline training runs only the stream rows, which read the stored main keys that a "
                             "checkpointed layer drops: turn gradient checkpointing off")
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
        streams = self.run_streams(origin, position_ids, main_ok, index, valid, prefix,
                                   next_tokens=self._next_tokens(input_ids, index))
        return lower, streams, index, valid, labels, stored, carry

    def _next_tokens(self, input_ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor | None:
        """For streams that read the next token (``next_token_input``): the text's token after each
        slot's position [B, S] (a slot at the row's end reads its own token: it carries no target)."""
        if not self.stream_config.next_token_input:
            return None
        return input_ids.gather(1, (index + 1).clamp(max=input_ids.shape[1] - 1))

    def _check_inputs(self, input_ids, attention_mask, labels):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a [batch, length] LongTensor")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: need at least one token")
        if attention_mask is None:
            real = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
                )
            real = attention_mask.bool()
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
            if ((labels != -100) & ~real).any():
                raise ValueError("labels must be -100 wherever attention_mask is 0 (padding has no target)")
        window = sliding_window(self.config)
        if window is not None and input_ids.shape[1] > window:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds the model's sliding window {window}")
        return real, labels

    def _scatter_stream_logits(self, streams, index, valid, num_positions):
        batch, num_slots, g, _ = streams.shape
        logits = self.head(streams)
        full = logits.new_full((batch, num_positions, g, logits.shape[-1]), float("nan"))
        b, s = valid.nonzero(as_tuple=True)
        full[b, index[b, s]] = logits[b, s]
        return full
