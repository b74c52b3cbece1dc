"""What streamspec needs to know about each supported architecture, in one small table.

The stream patch never copies modeling code: it calls the model's own embeddings, decoder
layers, rotary embedding, final norm and LM head. The only per-architecture facts are where
those modules live, how a decoder layer is called, and where the attention values come from
(for the ``value_rotation`` stream init).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """Where the pieces of one architecture family live.

    Args:
        decoder: attribute of the causal-LM model holding the decoder stack.
        layers: attribute of the decoder holding the list of decoder layers.
        norm: attribute of the decoder holding the final norm.
        rotary: attribute of the decoder holding the rotary embedding, or None (learned positions).
        value_proj: path, inside a decoder layer, of the module whose output holds the values.
        value_part: (index, parts) when that module's output is a fused projection split into
            `parts` equal chunks of which values are chunk `index` (GPT-2's c_attn); else None.
        embed: `(decoder, input_ids, position_ids) -> hidden states`.
    """

    decoder: str
    layers: str
    norm: str
    rotary: str | None
    value_proj: str
    value_part: tuple[int, int] | None
    embed: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _embed_tokens(decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    return decoder.embed_tokens(input_ids)


def _embed_gpt2(decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    return decoder.drop(decoder.wte(input_ids) + decoder.wpe(position_ids))


_LLAMA_LIKE = ArchSpec(
    decoder="model",
    layers="layers",
    norm="norm",
    rotary="rotary_emb",
    value_proj="self_attn.v_proj",
    value_part=None,
    embed=_embed_tokens,
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "gpt2": ArchSpec(
        decoder="transformer",
        layers="h",
        norm="ln_f",
        rotary=None,
        value_proj="attn.c_attn",
        value_part=(2, 3),
        embed=_embed_gpt2,
    ),
}

# Attention kernels that take an arbitrary additive mask; streams and trees need one
# ("streamspec_sdpa": `streamspec.kernels.decode_attention_forward`, sdpa with a decoding path).
MASKED_ATTENTION = ("eager", "sdpa", "streamspec_sdpa")


def arch_spec(config) -> ArchSpec:
    """The table entry for a transformers config, or a ValueError listing what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"architecture {model_type!r} is not supported by streamspec; supported: {sorted(ARCHITECTURES)}"
        )
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in MASKED_ATTENTION:
        raise ValueError(
            f"attention implementation {attn!r} cannot take the stream/tree attention masks; load the model with "
            f"attn_implementation in {list(MASKED_ATTENTION)}"
        )
    return ARCHITECTURES[model_type]


def sliding_window(config) -> int | None:
    """The attention window the model applies, or None when attention is global."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", None) == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window


def context_positions(config) -> int | None:
    """The positions a model can attend over (``max_position_embeddings``, GPT-2's ``n_positions``),
    when its config says."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
