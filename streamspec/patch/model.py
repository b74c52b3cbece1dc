"""The stream patch: `add_streams(model, config) -> StreamedModel`.

A `StreamedModel` owns the HF causal LM (optionally wrapped by peft) and the few new parameters
(`StreamParameters`). Its forward runs the model's own modules in two parts:

- the lower N−Ns decoder layers over the main positions only, as the base model would;
- the top Ns (MSA) layers over ``[main positions] + [γ streams of each carrying position]`` with
  the attention rules of `streamspec.patch.layout.stream_allowed`.

Just before the MSA layers, a rank-`prune_rank` adapter and the model's own final norm and LM
head give the early-exit logits used to prune draft trees.

What acts on stream rows inside the MSA layers (value rotation, stream adapters) is a set of
wrapper modules put in place of the layers' own modules once (`streamspec.patch.stream_modules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..arch import ArchSpec, arch_spec, sliding_window
from ..config import StreamConfig
from .layout import (
    carrying_positions,
    causal,
    last_real_positions,
    main_allowed,
    position_ids_from_mask,
    stream_allowed,
    stream_position_ids,
    stream_slots,
    to_bias,
)
from .loss import cross_entropy_and_top1, frozen
from .stream_modules import (
    STREAM_ROWS,
    StreamAdapter,
    StreamRows,
    ValueRotation,
    remove_stream_modules,
    replace_submodule,
)
from .offline import OfflineStreams
from .saving import save_streamed
from .decoder import DecoderParts, _is_peft
from .objective import loss_terms, offline_total_loss, stored_main_counts, total_loss
from .parameters import StreamAdapters, StreamParameters, _adapter_target, linear_targets

if TYPE_CHECKING:  # only named in signatures: the patch does not depend on decoding
    from .cache import MainStreamCache


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


_LOSSLESS_NO_LORA = "mode='lossless' keeps the base frozen and exact; it cannot take a LoRA adapter"


class StreamedModel(OfflineStreams, DecoderParts):
    """A causal LM with speculative streams in its top `stream_layers` layers. Build with
    `add_streams`."""

    def __init__(self, base: nn.Module, config: StreamConfig) -> None:
        super().__init__()
        if not isinstance(config, StreamConfig):
            raise TypeError(f"config must be a StreamConfig, got {type(config).__name__}")
        self.base = base
        self.stream_config = config
        hf = self.hf_model
        self.arch: ArchSpec = arch_spec(hf.config)
        config.check_model(hf.config.num_hidden_layers)
        if config.mode == "lossless" and _is_peft(base):
            raise ValueError(_LOSSLESS_NO_LORA)
        hidden = hf.config.hidden_size
        param = next(hf.parameters())
        self.streams = StreamParameters(config, hidden)
        if config.stream_adapter_rank is not None:
            targets = [linear_targets(layer) for layer in self.layers[self.num_lower_layers :]]
            self.streams.adapters = StreamAdapters(targets, config.stream_adapter_rank)
        self.streams.to(device=param.device, dtype=param.dtype)
        if config.mode == "lossless":
            for p in self.base.parameters():
                p.requires_grad_(False)
        self._rows = StreamRows()
        self._stream_hooks: list = []
        self._has_stream_modules = False
        self.insert_stream_modules()

    # -- the model's own modules ----------------------------------------------------------------
    @property
    def num_lower_layers(self) -> int:
        return len(self.layers) - self.stream_config.stream_layers

    @property
    def num_drafts(self) -> int:
        return self.stream_config.num_streams

    @property
    def has_lora(self) -> bool:
        return _is_peft(self.base)

    def early_exit_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Early-exit logits from hidden states at the input of layer N−Ns.

        The adapter is an estimator for pruning, trained by its own next-token loss; that loss
        must not reshape the base (its layers, LoRA, final norm or LM head) to suit layer N−Ns,
        so the input is detached and the norm and head are used with detached weights.
        """
        return frozen(self.hf_model.get_output_embeddings())(self.early_exit_hidden(hidden))

    def early_exit_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Adapter then final norm (with detached weights), on a detached input: see early_exit_head."""
        return frozen(getattr(self.decoder, self.arch.norm))(self.streams.early_exit(hidden.detach()))

    def add_lora(self, lora_config) -> "StreamedModel":
        """Attach a peft LoRA adapter to the base (shared mode only); returns self."""
        from peft import get_peft_model

        if self.stream_config.mode == "lossless":
            raise ValueError(_LOSSLESS_NO_LORA)
        if self.has_lora:
            raise ValueError("a LoRA adapter is already attached")
        # peft must find its targets as the plain linears they are; the stream modules then go
        # around the LoRA layers (a value rotation must turn the values LoRA has adapted too)
        self.remove_stream_modules()
        self.base = get_peft_model(self.base, lora_config)
        self.insert_stream_modules()
        return self

    def insert_stream_modules(self) -> None:
        """Put the stream modules in place in the MSA layers, as the stream config and the stream
        adapters `streams` holds now ask (replacing any already there): a `ValueRotation` around the
        value projection for ``stream_init="value_rotation"``, a `StreamAdapter` around each
        linear with an adapter. Done once by the constructor and by `add_lora`; call it again after
        replacing `streams.adapters`."""
        self.remove_stream_modules()
        cfg = self.stream_config
        adapters = getattr(self.streams, "adapters", None)
        if cfg.stream_init != "value_rotation" and adapters is None:
            return
        attention = self.arch.value_proj.rpartition(".")[0]  # the module holding the value projection
        for i, layer in enumerate(self.layers[self.num_lower_layers :]):
            if cfg.stream_init == "value_rotation":
                replace_submodule(
                    layer, self.arch.value_proj,
                    lambda m: ValueRotation(m, self._rows, cfg.num_streams, self.arch.value_part),
                )
            if adapters is not None:
                for key, pair in adapters.layers[i].items():
                    replace_submodule(layer, _adapter_target(key), lambda m, pair=pair: StreamAdapter(m, self._rows, pair))
            # the row split reaches them through the attention's keyword arguments (see StreamRows)
            hook = layer.get_submodule(attention).register_forward_pre_hook(self._rows.take, with_kwargs=True)
            self._stream_hooks.append(hook)
        self._has_stream_modules = True

    def remove_stream_modules(self) -> None:
        """Put the MSA layers' own modules back (see `insert_stream_modules`)."""
        for hook in self._stream_hooks:
            hook.remove()
        self._stream_hooks.clear()
        self._has_stream_modules = False
        remove_stream_modules(self.hf_model)

    def use_bf16_stream_rows(self, on: bool = True) -> bool:
        """Run the stream rows of a decoding pass through bfloat16 copies of the MSA layers' linear
        layers (`streamspec.kernels.LowPrecisionRows`), the main rows through the float32 layers as
        before. Stream rows only draft: the next pass verifies their guesses against the float32
        main stream, so the tokens decoded are the model's own either way (only which candidates
        are drafted may differ, at near-ties), and the main rows' bits are unchanged (streamspec's
        kernels compute each row on its own). In a 7-node confidence tree's pass of the shipped
        SQL streams, 21 of the 28 rows in each of the 4 MSA layers are stream rows: their products
        read bf16 weights (side by side, `eval/bf16_stream_rows_ab.py`: −2% to +4% tokens/s on
        this project's 2-core CPU, within its noise; docs/benchmarks.md, "Eighteenth session").
        Only in lossless mode (in shared mode the main stream attends to the streams, so their
        rounding would reach the tokens) and for a float32 model packed for streamspec's CPU
        kernels (`pack_linear_layers`, as `load_for_inference` does on a CPU) where they run in
        bf16; returns whether it is on.
        The copies (the MSA layers' linear weights once more, in bf16) are never saved, and are
        made again when an eager call finds a weight changed (a compiled graph keeps those it was
        traced with). Training is untouched: calls that record gradients run in float32."""
        from ..decoding.formulation import formulation
        from ..kernels import PackedLinear, use_low_precision_rows

        # only where the device's formulation of a pass keeps stream rows apart (the CPU); on CUDA
        # they run in the same matmuls as the main rows
        apart = formulation(next(self.parameters()).device, native_ready=False).bf16_stream_rows
        linears = [m for layer in self.layers[self.num_lower_layers :] for m in layer.modules() if type(m) is PackedLinear]
        split = use_low_precision_rows(linears, self._rows, on and apart and self.stream_config.mode == "lossless") > 0
        self.__dict__["_bf16_stream_rows"] = split  # (read by the compiled loops' graph keys)
        return split

    def save_pretrained(self, directory, merge: bool = False, tokenizer=None):
        """Write a streamed checkpoint: only the new weights (and LoRA adapter), or with
        ``merge=True`` a self-contained folder with the base (LoRA merged). See
        `streamspec.patch.checkpoint`; load it back with `streamspec.load_streamed`."""
        return save_streamed(self, directory, merge=merge, tokenizer=tokenizer)

    # -- training hooks (see DecoderParts) -------------------------------------------------------
    def own_rate_parameters(self) -> list[nn.Parameter]:
        """The stream identifiers (and low-rank init map): few, in units of the hidden state's RMS,
        so the LoRA rate barely moves them; not the early-exit adapter or the stream adapters."""
        return [p for name, p in self.streams.named_parameters() if not name.startswith(("exit_", "adapters."))]

    def save_training_checkpoint(self, directory, tokenizer=None) -> None:
        """A streamed checkpoint; a full fine-tune (no LoRA, base trainable) carries the base along."""
        merge = not self.has_lora and any(p.requires_grad for p in self.base.parameters())
        self.save_pretrained(directory, merge=merge, tokenizer=tokenizer if merge else None)

    def num_stream_parameters(self) -> int:
        """Parameters added by the patch (stream identifiers, init map, early-exit adapter)."""
        return sum(p.numel() for p in self.streams.parameters())

    # -- forward pieces (shared by training and decoding) ---------------------------------------
    def run_upper(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        main_ok: torch.Tensor,
        index: torch.Tensor,
        valid: torch.Tensor,
        cache: MainStreamCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MSA layers. Streams are made for the positions in `index` [B, S] (see
        `streamspec.patch.layout`); returns main [B, T, h] and stream [B, S, γ, h] final hidden states
        (before the final norm). Each layer call tells the stream modules, if any, how many leading
        rows are main rows (see `streamspec.patch.stream_modules.StreamRows`)."""
        batch, num_new, width = hidden.shape
        g = self.stream_config.num_streams
        num_slots = index.shape[1]
        origin = hidden.gather(1, index[:, :, None].expand(batch, num_slots, width))
        streams = self.streams(origin).reshape(batch, num_slots * g, width)
        x = torch.cat([hidden, streams], dim=1)
        pos = torch.cat([position_ids, stream_position_ids(position_ids, index, g)], dim=1)
        allowed = stream_allowed(main_ok, index, valid, g, shared=self.stream_config.mode == "shared")
        x = self._run_msa(x, pos, to_bias(allowed, x.dtype), cache, num_main=num_new)
        return x[:, :num_new], x[:, num_new:].reshape(batch, num_slots, g, width)

    def _run_msa(self, x: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, cache, num_main: int) -> torch.Tensor:
        """The MSA layers over rows `x` whose first `num_main` are main rows (the rest stream rows)."""
        rotary = self._rotary(x, pos)
        if cache is not None:
            cache.main_length = num_main
        rows = {STREAM_ROWS: num_main} if self._has_stream_modules else {}
        for layer in self.layers[self.num_lower_layers :]:
            # with stream modules each layer's attention takes the split from its keyword arguments
            # (`StreamRows`); without, only bf16 stream rows (`use_bf16_stream_rows`) read it, here
            self._rows.num_main = None if rows else num_main
            x = self._call_layer(layer, x, bias, pos, rotary, cache, **rows)
            if rows and self._rows.num_main != num_main:
                raise RuntimeError(
                    f"{type(layer).__name__} did not pass its keyword arguments on to its attention module: the "
                    "stream modules cannot tell stream rows from main rows"
                )
        self._rows.num_main = None  # what runs next may be the plain model's own forward
        if cache is not None:
            cache.main_length = None
        return x

    # -- training / scoring forward -------------------------------------------------------------
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
        if activations is not None:
            if labels is None or return_logits:
                raise ValueError("activations are for offline training: they need labels and give no logits")
            hidden = self._offline_hidden(input_ids, attention_mask, labels, activations)
            loss, parts = offline_total_loss(self, *hidden, loss_chunk_size)
            return StreamedOutput(loss=loss, loss_parts=parts, stream_mask=hidden[-1])
        if streams_at not in ("all", "last"):
            raise ValueError(f"streams_at must be 'all' or 'last', got {streams_at!r}")
        if streams_at != "all" and labels is not None:
            raise ValueError("streams_at='last' is for inference; with labels the labels decide which positions carry streams")
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
        ``{term}_count``. Needs labels; never builds the full logits."""
        if labels is None:
            raise ValueError("evaluate_counts needs labels")
        head = self.hf_model.get_output_embeddings()
        sums: dict[str, float] = {}
        if activations is not None:
            lower, streams, index, valid, labels, stored, _ = self._offline_hidden(input_ids, attention_mask, labels, activations)
            sums.update(stored_main_counts(labels, stored))
            terms = loss_terms(self, lower, None, streams, index, valid, labels, own=stored.get("own"))
        else:
            lower, main, streams, index, valid, _, labels = self._hidden(input_ids, attention_mask, labels)
            terms = loss_terms(self, lower, main, streams, index, valid, labels)
        for name, hidden, target, _, transform in terms:
            keep = target != -100
            loss_sum, correct = cross_entropy_and_top1(head, transform(hidden[keep]), target[keep], chunk_size)
            sums.update({f"{name}_loss_sum": loss_sum, f"{name}_correct": correct, f"{name}_count": int(keep.sum())})
        return sums

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
        main, streams = self.run_upper(lower, position_ids, main_ok, index, valid)
        return lower, main, streams, index, valid, carry, labels

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

def add_streams(model: nn.Module, config: StreamConfig | None = None) -> StreamedModel:
    """Patch a transformers causal LM (or a peft model around one) with speculative streams.

    Args:
        model: a causal-LM instance of a supported architecture (llama, qwen2, mistral, gpt2).
        config: the streams to add; default `StreamConfig()`.
    """
    if isinstance(model, StreamedModel):
        raise ValueError("this model already has streams")
    if isinstance(model, DecoderParts):  # a MedusaModel: heads, not a transformers causal LM
        raise ValueError(f"this model already has draft heads ({type(model).__name__}): add streams to its base")
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"add_streams needs a transformers causal-LM model, got {type(model).__name__}")
    return StreamedModel(model, config if config is not None else StreamConfig())
