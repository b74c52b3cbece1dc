"""What every model that decodes through streamspec's tree verifier shares: a transformers causal
LM's own modules (embeddings, decoder layers, final norm, LM head) and the forward through its
lower layers. `streamspec.patch.model.StreamedModel` (speculative streams in the top layers) and
`streamspec.patch.medusa.MedusaModel` (draft heads on the last hidden state) build on it.

A subclass sets ``base`` (the causal LM, possibly inside a peft wrapper) and ``arch``
(`streamspec.arch.ArchSpec`) and says how many layers `run_lower` runs (``num_lower_layers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..kernels import Bf16Copy
from .layout import to_bias

if TYPE_CHECKING:  # only named in signatures: the patch does not depend on decoding
    from .cache import MainStreamCache


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class DecoderParts(nn.Module):
    """The causal LM's own modules, and the forward through its lower layers."""

    base: nn.Module

    @property
    def hf_model(self) -> nn.Module:
        """The transformers causal-LM model (inside the peft wrapper when there is one)."""
        return self.base.get_base_model() if _is_peft(self.base) else self.base

    @property
    def decoder(self) -> nn.Module:
        return getattr(self.hf_model, self.arch.decoder)

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.decoder, self.arch.layers)

    @property
    def num_lower_layers(self) -> int:
        raise NotImplementedError

    @property
    def num_drafts(self) -> int:
        """How many tokens past the next one each position drafts: γ streams, or Medusa heads."""
        raise NotImplementedError

    def run_upper(self, hidden: torch.Tensor, position_ids: torch.Tensor, main_ok: torch.Tensor, index: torch.Tensor,
                  valid: torch.Tensor, cache: MainStreamCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What follows `run_lower`: main hidden states [B, T, h] and, for the positions in `index`
        [B, S] (`valid` [B, S]), the drafts' hidden states [B, S, num_drafts, h], before the final norm."""
        raise NotImplementedError

    # -- training hooks: what a trainer asks of a draft model, whatever its kind ----------------
    def own_rate_parameters(self) -> list[nn.Parameter]:
        """Parameters that train at their own learning rate (``training.stream_learning_rate``)."""
        return []

    def save_training_checkpoint(self, directory, tokenizer=None) -> None:
        """Write what a training checkpoint of this model holds (its own format; loaded back by
        `streamspec.patch.resume.load_draft_checkpoint`)."""
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, main_ok: torch.Tensor, slots: torch.Tensor,
             cache: MainStreamCache | None = None, valid: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding pass: `tokens` [B, T] at `positions` [B, T], who may see whom `main_ok`
        [B, T, P+T] (cached keys first), drafts at the positions `slots` [B, S] (all valid unless
        `valid`), through `cache`. Returns main [B, T, h] and draft [B, S, num_drafts, h] hidden
        states (before the final norm; `head` gives logits). Callers that act between the lower
        and the upper layers (tree pruning) call `run_lower` and `run_upper` themselves."""
        lower = self.run_lower(tokens, positions, main_ok, cache)
        if valid is None:
            valid = torch.ones_like(slots, dtype=torch.bool)
        return self.run_upper(lower, positions, main_ok, slots, valid, cache)

    @property
    def config(self):
        return self.hf_model.config

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: hidden states -> logits."""
        norm = getattr(self.decoder, self.arch.norm)
        return self.hf_model.get_output_embeddings()(norm(hidden))

    def draft_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head for the drafts' rows alone (the next pass's candidates, never what a pass
        verifies): `head`, or after `use_bf16_draft_head` on a float32 model, the final norm in
        float32 and a bfloat16 copy of the LM head (logits in float32). Drafts are guesses the
        next pass verifies against the float32 head, so the tokens decoded are the same either
        way; only which candidates are drafted may differ, at near-ties."""
        # (an attribute lookup, not the instance dict's: compiled graphs then guard on it, so a model
        # drafting through the copy and one without never share a graph)
        follow = getattr(self, "_bf16_draft_head", None)
        if follow is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return self.head(hidden)
        draft = follow.of(self.hf_model.get_output_embeddings())
        if draft is None:  # the LM head was moved or cast where no copy applies
            return self.head(hidden)
        norm = getattr(self.decoder, self.arch.norm)
        return draft(norm(hidden).to(torch.bfloat16)).float()

    def use_bf16_draft_head(self, on: bool = True) -> bool:
        """Draft through a bfloat16 copy of the LM head (`draft_head`), packed for streamspec's CPU
        kernels: on a CPU a draft's LM head reads the whole vocabulary's weights for a few rows,
        so half the bytes is most of the time saved (SmolLM2-135M: 113 MB of float32 weights a
        draft, 57 MB in bf16; docs/benchmarks.md, "The step at the machine's limit"). Only for a float32 model whose LM head is an
        `nn.Linear` on the CPU, where `streamspec.native`'s kernels run; returns whether it is on.
        The copy is kept outside the module's parameters and state dict (never saved), and made
        again when an eager call finds the LM head's weight changed (a compiled graph keeps the
        copy it was traced with: its drafts may then be worse, never its tokens)."""
        self.__dict__.pop("_bf16_draft_head", None)
        follow = Bf16Copy(self.hf_model.get_output_embeddings()) if on else None
        if follow is None or follow.copy is None:
            return False
        self.__dict__["_bf16_draft_head"] = follow  # (not a submodule: outside the state dict)
        return True

    def _call_layer(self, layer, hidden, bias, position_ids, position_embeddings, cache, **kwargs):
        extra = {"position_ids": position_ids, "position_embeddings": position_embeddings} if self.arch.rotary else {}
        out = layer(hidden, attention_mask=bias, cache=cache, **extra, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def _rotary(self, hidden, position_ids):
        if self.arch.rotary is None:
            return None
        return getattr(self.decoder, self.arch.rotary)(hidden, position_ids)

    def causal_alone(self, real: torch.Tensor) -> bool:
        """Whether the main rows of a batch with real positions `real` [B, T] need no mask: every
        row's real tokens come first (right padding, or none) and the attention is sdpa, which
        applies the causal rule itself without a mask (every pad key then follows each real query
        of its row). Mistral's sliding window is no exception: inputs are never longer than it."""
        return self.config._attn_implementation == "sdpa" and bool((real[:, 1:] <= real[:, :-1]).all())

    def run_lower(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        main_ok: torch.Tensor | None,
        cache: MainStreamCache | None = None,
    ) -> torch.Tensor:
        """Embeddings and the lower `num_lower_layers` layers over main positions: hidden states
        at the input of the next layer, [B, T, h]. `main_ok` None: no mask, the attention's own
        causal rule (`causal_alone`)."""
        hidden = self.arch.embed(self.decoder, input_ids, position_ids)
        bias = None if main_ok is None else to_bias(main_ok, hidden.dtype)
        rotary = self._rotary(hidden, position_ids)
        if cache is not None:
            cache.main_length = None
        for layer in self.layers[: self.num_lower_layers]:
            hidden = self._call_layer(layer, hidden, bias, position_ids, rotary, cache)
        return hidden
