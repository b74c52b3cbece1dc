"""Attention for decoding passes on a CPU: `decode_attention_forward`, registered with transformers
as ``"streamspec_sdpa"`` and switched on by `use_decode_attention(model)` (what
`streamspec.loading.load_for_inference` does on a CPU). A pass of a few query rows (one token, a
draft tree) runs as two matrix products per key-value head group, or streamspec's own C++ kernel
(`streamspec.native`) that reads the cache in place; torch's CPU flash kernel spent ~0.9 ms a layer
on one bfloat16 query against 768 cached keys, ~0.15 ms this way. Longer passes (the prefill) go to
transformers' ``sdpa``. `streamspec.kernels` re-exports these names.
"""

from __future__ import annotations

import torch
from torch import nn

from . import native

#: The transformers attention implementation `use_decode_attention` switches a model to.
DECODE_ATTENTION = "streamspec_sdpa"
#: Passes of at most this many query rows (one token, a draft tree) take the grouped path of
#: torch's operators; bf16 and float32 passes that streamspec's own kernel takes go up to
#: `native.ATTENTION_MAX_ROWS`.
DECODE_ATTENTION_MAX_QUERIES = 32


def decode_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs):
    """transformers' ``sdpa`` attention, except for a decoding pass on a CPU: a few query rows
    against a long cache. There torch's CPU flash kernel costs ~0.9 ms a layer in bfloat16
    (SmolLM2-135M, one query, 768 cached keys, one thread of this project's AMD EPYC), mostly
    spent on the grouped heads' keys and values copied out per query head and on blocks sized
    for long queries; this path computes the same attention as two matrix products per key-value
    head group (the query heads that share a key head stacked as rows, nothing copied) with the
    scores and the softmax in float32 (as the flash kernel accumulates), ~0.15 ms. Same results
    up to rounding in the order of the sums (in bfloat16 the error against float64 is the flash
    kernel's). In bfloat16 and float32 on CPUs where `streamspec.native` runs, passes of up to
    `native.ATTENTION_MAX_ROWS` rows (without autograd) take its C++ kernel instead, which reads
    the cached keys and values in place (in bf16 rather than as float32 copies; in float32 2-3x
    faster than these operators for 1-60 rows against 768 keys, one thread). Anything else (longer queries, no mask for several rows, dropout, soft caps,
    position biases, attention sinks, key and value heads of other sizes, another device) goes to
    transformers' ``sdpa`` unchanged.
    `query` [B, H, T, D]; `key`/`value` [B, KV, L, D]; returns [B, T, H, D] as ``sdpa`` does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = query.shape[2]
    batch, heads, _, dim = query.shape
    # (the C++ kernel has no backward: with autograd recording, torch's operators)
    own = (rows <= native.ATTENTION_MAX_ROWS and native.ready() and getattr(module, "_streamspec_native_attention", True)
           and query.dtype == key.dtype == value.dtype and query.dtype in (torch.bfloat16, torch.float32) and dim <= 256
           and key.stride(-1) == 1 and value.stride(-1) == 1
           and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)))
    if ((rows > DECODE_ATTENTION_MAX_QUERIES and not own) or query.device.type != "cpu" or dropout
            or (attention_mask is None and rows > 1)
            or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux", "sinks"))
            or query.shape[1] % key.shape[1] or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups, length = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim ** -0.5
    if own:
        mask = None
        if attention_mask is not None:  # boolean, or additive float32; broadcast to [B, H, T, L] by the kernel
            mask = attention_mask[..., :length]
            mask = mask if mask.dtype == torch.bool else mask.float()
        # (in a compiled graph the C++ operator itself: no Python between the graph and the kernel)
        op = torch.ops.streamspec_native if torch.compiler.is_compiling() else torch.ops.streamspec
        return op.decode_attention(query, key, value, mask, float(scale)), None
    per_group = heads // groups
    q = query.reshape(batch, groups, per_group * rows, dim).float()
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale).view(batch, groups, per_group, rows, length)
    if attention_mask is not None:
        mask = attention_mask[..., :length]
        mask = (mask.view(mask.shape[0], 1, 1, rows, length) if mask.shape[1] == 1
                else mask.view(mask.shape[0], groups, per_group, rows, length))
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float())
    # a row that may see nothing (a padded query) gives zeros, as torch's sdpa does, not NaN that
    # would reach every later layer through that position's keys and values
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0).view(batch, groups, per_group * rows, length)
    out = torch.matmul(probs, value.float()).to(query.dtype)
    return out.view(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def _decode_attention_cpu(query, key, value, mask, scale):
    return native.bf16_linear().decode_attention(query, key, value, mask, scale)


_LIBRARY = torch.library.Library("streamspec", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")
_LIBRARY.impl("decode_attention", _decode_attention_cpu, "CPU")


torch.library.register_fake("streamspec::decode_attention")(native.attention_shape)


def _register_decode_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # the masks transformers builds: sdpa's


_register_decode_attention()


def use_decode_attention(model: nn.Module, own_kernel: bool = True) -> bool:
    """Switch `model` (a transformers model, or a streamed model around one) from ``sdpa`` to
    `decode_attention_forward` (registered with transformers as ``"streamspec_sdpa"``), for decoding on
    a CPU. True when switched (or already so); a model with another attention implementation
    (``eager``, flash kernels) is left as it is (False). Undo with `use_sdpa_attention`.
    In bfloat16 and float32 its passes run streamspec's own attention kernel (`streamspec.native`)
    where it builds, unless `own_kernel` is False (torch's operators, to compare the two)."""
    config = getattr(getattr(model, "hf_model", model), "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", DECODE_ATTENTION):
        return False
    config._attn_implementation = DECODE_ATTENTION
    for layer in model.modules():  # the attention layers (a plain attribute: nothing saved changes)
        if hasattr(layer, "layer_idx") and hasattr(layer, "config"):
            layer.__dict__["_streamspec_native_attention"] = bool(own_kernel)
    if own_kernel and any(p.dtype in (torch.bfloat16, torch.float32) and p.device.type == "cpu" for p in model.parameters()):
        native.bf16_linear()  # bf16 and float32 passes take streamspec's own attention kernel where it builds
    return True


def use_sdpa_attention(model: nn.Module) -> None:
    """Undo `use_decode_attention` (transformers' own ``sdpa`` again)."""
    config = getattr(getattr(model, "hf_model", model), "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == DECODE_ATTENTION:
        config._attn_implementation = "sdpa"
