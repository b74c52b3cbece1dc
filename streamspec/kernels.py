"""Faster fp32 linear layers on CPU for decoding (oneDNN with weights packed once).

On a CPU, torch sends an fp32 `nn.Linear` to the BLAS (MKL): a matrix-vector product for one row
and a general matrix product for more. For the shapes of decoding, a few rows against a large
weight, those kernels leave most of the machine idle. Measured with `python eval/linear_kernels.py` on
this project's 2-core dev machine of earlier sessions (AMD EPYC, torch 2.13 CPU; on a later
session's Intel Xeon the layers were slower packed: docs/benchmarks.md): the 210 linear layers of
SmolLM2-135M's 30 decoder layers, each weight read from memory as in a real forward, and its
49,152-token LM head, in ms (median of 7):

    rows                  1      4     16     40    160
    layers, nn.Linear   25.8   37.7   41.4   65.5  182.2
    layers, packed      14.2   13.6   18.3   30.3   82.6
    head, nn.Linear      6.7   11.4   13.6   20.6   62.9
    head, packed         2.3    2.3    3.1    6.0   19.7

Verifying a draft (several rows) then costs about what one token costs, which is the regime
speculative decoding is built for. `pack_linear_layers(model)` switches every fp32 CPU
`nn.Linear` of a model (of any model: a streamed one, or the transformers baseline it is compared
with) to oneDNN's inner product with a weight packed once into oneDNN's blocked layout. The
packed copy costs the linear weights' memory a second time. Results equal `nn.Linear`'s up to
fp32 rounding (the summation order differs). Only inference uses them: with autograd recording
and a weight that wants gradients, or under autocast, the layer runs `F.linear` as before. A weight
changed in place by a tracked op (``copy_``, ``load_state_dict``) or replaced by a new tensor is
packed again at its next call; a change through ``.data`` is not seen (see `pack_linear_layers`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

# Rows the packed layout is tuned for; any number of rows works (measured: 4..64 all alike).
_PACK_HINT = 16


def cpu_kernels_available() -> bool:
    """Whether this torch build has oneDNN's packed linear kernels."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose no-grad fp32 CPU calls go to oneDNN with a packed weight. Made only by
    `pack_linear_layers` (it changes the class of existing layers; parameters, state dict and
    saving are untouched)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (
            x.device.type != "cpu"
            or w.device.type != "cpu"
            or x.dtype != torch.float32
            or w.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)))
            or torch.is_autocast_enabled("cpu")
            or torch.compiler.is_compiling()  # a compiled graph chooses its own kernels (the packed
        ):                                    # weight's cache key reads a storage address)
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, _packed(self), b, "none", [], "")

    def __getstate__(self):
        # Copies and pickles leave the packed weight behind (an opaque oneDNN tensor); they pack
        # their own at their first call.
        state = self.__dict__.copy()
        state.pop("_streamspec_packed", None)
        return state


def _packed(layer: nn.Linear) -> torch.Tensor:
    """The layer's packed weight, packed again when the weight was replaced or changed in place
    (known by the weight's storage address and version counter: a new tensor that happened to
    reuse the old address with the same version would go unseen, as would a ``.data`` change)."""
    w = layer.weight
    key = (w.data_ptr(), w._version)
    cached = layer.__dict__.get("_streamspec_packed")
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_HINT))
        layer.__dict__["_streamspec_packed"] = cached  # a plain attribute: not a parameter or buffer
    return cached[1]


def pack_linear_layers(model: nn.Module) -> int:
    """Switch every fp32 CPU `nn.Linear` of `model` to `PackedLinear` and pack its weight now (so
    the first timed call does not pay for it). Layers on another device or in another dtype, and
    subclasses of `nn.Linear`, are left as they are. Returns how many layers were switched
    (0 when none qualify). Undo with `unpack_linear_layers`.

    Pack after the weights are final (loaded, LoRA merged). A weight changed in place through
    autograd-visible ops (``copy_``, ``load_state_dict``) is packed again at its next call; one
    changed through ``.data`` is not seen: call this again (it re-packs packed layers).

    Raises RuntimeError when this torch build has no oneDNN (see `cpu_kernels_available`).
    """
    if not cpu_kernels_available():
        raise RuntimeError("this torch build has no oneDNN (torch.backends.mkldnn); keep the default kernels")
    count = 0
    for module in model.modules():
        if type(module) in (nn.Linear, PackedLinear) and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = PackedLinear
            module.__dict__.pop("_streamspec_packed", None)  # packing again picks up any change
            _packed(module)
            count += 1
    return count


def pack_if_available(model: nn.Module) -> int:
    """`pack_linear_layers` when this torch build has oneDNN, else nothing (returns 0)."""
    return pack_linear_layers(model) if cpu_kernels_available() else 0


def unpack_linear_layers(model: nn.Module) -> int:
    """Turn `PackedLinear` layers back into `nn.Linear` and free their packed weights. Returns how
    many layers were changed."""
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("_streamspec_packed", None)
            count += 1
    return count


@contextlib.contextmanager
def default_linear_kernels(model: nn.Module):
    """Inside the block, `model`'s packed layers run torch's default `F.linear` (their packed
    weights are kept for afterwards): to time the same model both ways in one process."""
    layers = [m for m in model.modules() if type(m) is PackedLinear]
    for layer in layers:
        layer.__class__ = nn.Linear
    try:
        yield
    finally:
        for layer in layers:
            layer.__class__ = PackedLinear
