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

from typing import TYPE_CHECKING

import torch
from torch import nn
import torch.nn.functional as F

from ..arch import ArchSpec, arch_spec
from ..config import StreamConfig
from .layout import (
    stream_allowed,
    stream_position_ids,
    to_bias,
)
from .loss import frozen
from .stream_modules import (
    STREAM_ROWS,
    StreamAdapter,
    StreamRows,
    ValueRotation,
    remove_stream_modules,
    replace_submodule,
)
from .prefix import KVCapture, KVPrefix
from .saving import save_streamed
from .decoder import DecoderParts, _is_peft
from .forward import StreamedOutput, TrainingForward  # noqa: F401 (StreamedOutput: re-exported)
from .parameters import StreamAdapters, StreamParameters, _adapter_target, linear_targets

if TYPE_CHECKING:  # only named in signatures: the patch does not depend on decoding
    from .cache import MainStreamCache


_LOSSLESS_NO_LORA = "mode='lossless' keeps the base frozen and exact; it cannot take a LoRA adapter"


class StreamedModel(TrainingForward, DecoderParts):
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
        this project's 2-core CPU, within its noise; docs/benchmarks.md, "The step at the machine's limit").
        Only in lossless mode (in shared mode the main stream attends to the streams, so their
        rounding would reach the tokens) and for a float32 model packed for streamspec's CPU
        kernels (`pack_linear_layers`, as `load_for_inference` does on a CPU) where they run in
        bf16; returns whether it is on.
        The copies (the MSA layers' linear weights once more, in bf16) are never saved, and are
        made again when an eager call finds a weight changed (a compiled graph keeps those it was
        traced with). Training is untouched: calls that record gradients run in float32."""
        from ..devices import formulation
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
        so the LoRA rate barely moves them; not the early-exit adapter, the stream adapters or the
        next-token map (full matrices, at the LoRA rate)."""
        return [p for name, p in self.streams.named_parameters()
                if not name.startswith(("exit_", "adapters.", "next_token_map."))]

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
        next_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MSA layers. Streams are made for the positions in `index` [B, S] (see
        `streamspec.patch.layout`); returns main [B, T, h] and stream [B, S, γ, h] final hidden states
        (before the final norm). Each layer call tells the stream modules, if any, how many leading
        rows are main rows (see `streamspec.patch.stream_modules.StreamRows`). `next_tokens` [B, S]:
        the token after each slot's position, for streams that read it (``next_token_input``)."""
        batch, num_new, width = hidden.shape
        g = self.stream_config.num_streams
        num_slots = index.shape[1]
        origin = hidden.gather(1, index[:, :, None].expand(batch, num_slots, width))
        streams = self.streams(origin, self._next_embeds(next_tokens)).reshape(batch, num_slots * g, width)
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

    # -- offline training: the frozen main stream computed once (streamspec.training.activations)
    @torch.no_grad()
    def capture_main(self, lower: torch.Tensor, position_ids: torch.Tensor, main_ok: torch.Tensor | None):
        """The main stream through the MSA layers alone (lossless mode: it never sees a stream).
        Returns its final hidden states [B, T, h] and each MSA layer's main keys and values
        ``{layer_idx: [B, kv_heads, T, head_dim]}`` (what `run_streams` attends to). `main_ok`
        None: no mask, the attention's own causal rule (`causal_alone`)."""
        self._require_lossless("capture_main")
        capture = KVCapture()
        bias = None if main_ok is None else to_bias(main_ok, lower.dtype)
        main = self._run_msa(lower, position_ids, bias, capture, num_main=lower.shape[1])
        expected = list(range(self.num_lower_layers, len(self.layers)))
        if sorted(capture.keys) != expected:
            raise RuntimeError(f"the MSA layers reported keys for layers {sorted(capture.keys)}, expected {expected}")
        return main, capture.keys, capture.values

    def run_streams(self, origin: torch.Tensor, position_ids: torch.Tensor, main_ok: torch.Tensor,
                    index: torch.Tensor, valid: torch.Tensor, prefix: KVPrefix,
                    next_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Stream rows only through the MSA layers, attending to the main keys and values in
        `prefix` (from `capture_main`): in lossless mode the same stream states as `run_upper`
        from `origin` [B, S, h], the hidden states at the input of layer N−Ns of the positions in
        `index`. Returns [B, S, γ, h] (before the final norm)."""
        self._require_lossless("run_streams")
        batch, num_slots, width = origin.shape
        g = self.stream_config.num_streams
        num_main = main_ok.shape[1]
        x = self.streams(origin, self._next_embeds(next_tokens)).reshape(batch, num_slots * g, width)
        pos = stream_position_ids(position_ids, index, g)
        allowed = stream_allowed(main_ok, index, valid, g, shared=False)[:, num_main:]
        x = self._run_msa(x, pos, to_bias(allowed, x.dtype), prefix, num_main=0)
        return x.reshape(batch, num_slots, g, width)

    def _next_embeds(self, next_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """The input embeddings of `next_tokens` (read from the table: the embedding module itself
        never runs, so offline training leaves the base's layers untouched; gathered when ZeRO-3
        partitions it)."""
        if next_tokens is None:
            return None
        from .zero import gathered

        weight = self.hf_model.get_input_embeddings().weight
        with gathered([weight]):
            return F.embedding(next_tokens, weight)

    def _require_lossless(self, what: str) -> None:
        if self.stream_config.mode != "lossless":
            raise ValueError(f"{what} needs mode='lossless': in shared mode the main stream attends to the "
                             "streams, so it is not a fixed function of the text")


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
