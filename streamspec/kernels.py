"""Faster CPU kernels for decoding: linear layers through oneDNN with weights packed once (float32,
and bfloat16 on CPUs with native bf16), also inside compiled graphs, and a decoding pass's
attention without the grouped heads' copies.

On a CPU, torch sends an fp32 `nn.Linear` to the BLAS (MKL): a matrix-vector product for one row
and a general matrix product for more. For the shapes of decoding, a few rows against a large
weight, those kernels leave most of the machine idle. Measured with `python eval/linear_kernels.py` on
a 2-core AMD EPYC (torch 2.13 CPU; on an Intel Xeon the layers were slower packed:
docs/benchmarks.md, "Another CPU: the Intel Xeon"): the 210 linear layers of
SmolLM2-135M's 30 decoder layers, each weight read from memory as in a real forward, and its
49,152-token LM head, in ms (median of 7):

    rows                  1      4     16     40    160
    layers, nn.Linear   25.8   37.7   41.4   65.5  182.2
    layers, packed      14.2   13.6   18.3   30.3   82.6
    head, nn.Linear      6.7   11.4   13.6   20.6   62.9
    head, packed         2.3    2.3    3.1    6.0   19.7

Verifying a draft (several rows) then costs about what one token costs, which is the regime
speculative decoding is built for. `pack_linear_layers(model)` switches every float32 (and, where
`packed_dtypes` says so, bfloat16) CPU `nn.Linear` of a model (of any model: a streamed one, or the
transformers baseline it is compared with) to oneDNN's inner product with a weight packed once
into oneDNN's blocked layout; in bfloat16 a 1536x576 layer at one row took 0.16 ms packed against
0.32 ms through `F.linear` (one thread, AMD EPYC with AVX-512 BF16). The packed copy costs the
linear weights' memory a second time. Results equal `nn.Linear`'s up to rounding (the summation
order differs). Only inference uses them: with autograd recording and a weight that wants
gradients, or under autocast, the layer runs `F.linear` as before. A weight changed in place by a
tracked op (``copy_``, ``load_state_dict``) or replaced by a new tensor is packed again at its
next call; a change through ``.data`` is not seen (see `pack_linear_layers`). In a compiled graph
a packed layer is the ``streamspec::packed_linear`` operator (`packed_linear`): the graph keeps
the weight as its input and the operator finds the layer's pack by the weight's address, checked
against the live weight and its version, so the on-disk compile cache still serves the graph.

`use_decode_attention(model)` (`streamspec.attention`, re-exported here) runs a decoding pass's
attention without the grouped heads' copies. `default_kernels` runs a model on torch's and
transformers' defaults inside a block.

On CPUs with AVX-512 BF16, bf16 and float32 layers and the bf16 decoding attention also use
streamspec's own C++ kernels for passes of up to 64 rows (`streamspec.native`, built on first use):
a weight read as one sequential stream, the cache read in place; longer passes (prompts) stay on
oneDNN and torch's operators.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import native

# Rows the packed layout is tuned for; any number of rows works (measured: 4..64 all alike).
_PACK_HINT = 16


def cpu_kernels_available() -> bool:
    """Whether this torch build has oneDNN's packed linear kernels."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packable() -> tuple[torch.dtype, ...]:
    if not cpu_kernels_available():
        return ()
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


_PACKABLE = _packable()  # decided once: a compiled graph reads it as a constant


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes `pack_linear_layers` packs on this machine: float32, and bfloat16 where oneDNN
    has native bf16 kernels (CPUs with AVX-512 BF16 or AMX; elsewhere oneDNN would emulate it)."""
    return _PACKABLE


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose no-grad float32/bfloat16 CPU calls go to packed kernels: streamspec's
    own (`streamspec.native`) for passes of up to `native.MAX_ROWS` rows where it runs, else oneDNN.
    Made only by `pack_linear_layers` (it changes the class of existing layers; parameters, state
    dict and saving are untouched). Inside a compiled graph the call is an operator opaque to the
    compiler with the same kernels, so compiled decoding steps get them too: for passes of up to
    `native.MAX_ROWS` rows where streamspec's kernel runs, ``streamspec_native::linear_of`` (C++
    from the graph to the kernel, the weight's pack found in C++ by the weight and its version),
    else ``streamspec::packed_linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (
            x.device.type != "cpu"
            or w.device.type != "cpu"
            or x.dtype != w.dtype
            or w.dtype not in _PACKABLE
            or (b is not None and b.dtype != w.dtype)
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)))
            or torch.is_autocast_enabled("cpu")
        ):
            return F.linear(x, w, b)
        # (an attribute lookup, not the instance dict's: compiled graphs then guard on it, so a layer
        # with a split and one without never share a graph)
        low = getattr(self, "_streamspec_low_rows", None)
        if low is not None and x.dim() >= 2:
            full = low.full_rows(self)
            if full is not None and full < x.shape[-2]:  # the trailing rows through the bf16 copy
                return torch.cat([self._packed_forward(x[..., :full, :]), low(self, x[..., full:, :])], dim=-2)
        return self._packed_forward(x)

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if torch.compiler.is_compiling():
            # (the shapes are static: the kernel is chosen once, when the graph is traced)
            if (getattr(self, "_streamspec_own", True) and native.ready() and x.shape[-1] == w.shape[1]
                    and x.numel() <= native.MAX_ROWS * x.shape[-1]):
                return torch.ops.streamspec_native.linear_of(x, w, b)  # the C++ operator, its pack found in C++
            return torch.ops.streamspec.packed_linear(x, w, b)
        return _run_packed(x, _packed(self), w, b)

    def __getstate__(self):
        # Copies and pickles leave the packed weight behind (an opaque oneDNN tensor); they pack
        # their own at their first call.
        state = self.__dict__.copy()
        state.pop("_streamspec_packed", None)
        return state


def weight_state(weight: torch.Tensor) -> tuple:
    """What tells a weight changed: the tensor, its storage (moved, cast, ``.data`` replaced), its
    dtype and its version counter (changed in place)."""
    return id(weight), weight.data_ptr(), weight.dtype, weight._version


def bf16_copy(layer: nn.Module) -> nn.Linear | None:
    """A bfloat16 copy of a float32 CPU `nn.Linear`, packed for streamspec's kernels (outside any
    module tree: not a parameter, never saved), or None where those kernels do not run."""
    if (not isinstance(layer, nn.Linear) or layer.weight.dtype != torch.float32 or layer.weight.device.type != "cpu"
            or torch.bfloat16 not in packed_dtypes() or native.bf16_linear() is None):
        return None
    # (skip_init: no random initialisation of weights about to be overwritten)
    copy = torch.nn.utils.skip_init(nn.Linear, layer.in_features, layer.out_features, bias=layer.bias is not None,
                                    dtype=torch.bfloat16)
    with torch.no_grad():
        copy.weight.copy_(layer.weight)
        if layer.bias is not None:
            copy.bias.copy_(layer.bias)
    copy.requires_grad_(False)
    pack_linear_layers(copy)
    return copy.eval()


class Bf16Copy:
    """A `bf16_copy` of a layer that follows the layer's weight: `of` finds, in an eager call, the
    weight replaced (moved, cast, ``.data`` set) or changed in place and copies it again (None
    where a copy no longer applies, until it does again); a compiled graph keeps the copy it was
    traced with (drafts from it may then be worse, never the tokens a float32 pass verifies)."""

    def __init__(self, layer: nn.Module) -> None:
        self.copy = bf16_copy(layer)
        self.source = weight_state(layer.weight)

    def of(self, layer: nn.Module) -> nn.Linear | None:
        """The copy of `layer` as it is now (None: none applies)."""
        if not torch.compiler.is_compiling() and self.source != weight_state(layer.weight):
            self.copy, self.source = bf16_copy(layer), weight_state(layer.weight)
        return self.copy


class LowPrecisionRows(Bf16Copy):
    """What `use_low_precision_rows` gives a float32 `PackedLinear`: in its inference calls, the
    rows after the first ``rows.num_main`` (along the second-to-last dimension; all rows alike
    while that is None) run through a bfloat16 copy of the layer (`Bf16Copy`, which follows the
    weight), their outputs cast back to float32. The leading rows run through the float32 layer
    as before, and since streamspec's kernels compute each row on its own, their bits are the same
    as without the split. A streamed model uses it for its stream rows, which only draft
    (`StreamedModel.use_bf16_stream_rows`)."""

    def __init__(self, layer: nn.Linear, rows) -> None:
        super().__init__(layer)
        self.rows = rows  # any object with a `num_main` attribute: int or None

    def full_rows(self, layer: nn.Linear) -> int | None:
        """How many leading rows stay in float32 (None: every row)."""
        num_main = self.rows.num_main
        if num_main is None or self.of(layer) is None:
            return None
        return num_main

    def __call__(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.copy(x.to(torch.bfloat16)).to(x.dtype)


def use_low_precision_rows(layers, rows, on: bool = True) -> int:
    """Give each float32 CPU `PackedLinear` of `layers` a `LowPrecisionRows` split by `rows`
    (``on=False``: take it away). Returns how many layers have one now."""
    count = 0
    for layer in layers:
        if type(layer) is not PackedLinear:
            continue
        layer.__dict__.pop("_streamspec_low_rows", None)
        if on:
            low = LowPrecisionRows(layer, rows)
            if low.copy is not None:
                layer.__dict__["_streamspec_low_rows"] = low
                count += 1
    return count


# Packed weights by the address, shape, strides and dtype of the weight they pack, for the
# compiled operator (which sees the weight tensor, not its layer): (the weight, weakly; its
# version when packed; the pack).
_PACKS: dict[tuple, tuple] = {}


def _pack_key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype


def _make_pack(weight: torch.Tensor, own: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(oneDNN's packed weight, streamspec's own layout or None): the second for bf16 and float32
    weights where `streamspec.native.bf16_linear` runs (passes of up to `native.MAX_ROWS` rows take
    it), unless `own` is False."""
    w = weight.detach()
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT)
    kernel = native.bf16_linear() if own and w.dtype in (torch.bfloat16, torch.float32) else None
    return onednn, (kernel.pack(w) if kernel is not None else None)


def _run_packed(x: torch.Tensor, packs: tuple, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    onednn, own = packs
    # (an input of another width goes to oneDNN, which refuses it as F.linear does)
    if own is not None and x.shape[-1] == weight.shape[1] and x.numel() <= native.MAX_ROWS * x.shape[-1]:
        return native.bf16_linear().linear(x, own, weight.shape[0], bias)
    return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")


def _packed(layer: nn.Linear, own: bool | None = None) -> tuple:
    """The layer's packs (`_make_pack`), made again when the weight was replaced or changed in
    place (known by the weight's storage address and version counter: a new tensor that happened to
    reuse the old address with the same version would go unseen, as would a ``.data`` change)."""
    w = layer.weight
    key = (w.data_ptr(), w._version)
    cached = layer.__dict__.get("_streamspec_packed")
    if own is None:  # as the layer was packed (`pack_linear_layers(own_kernel=...)`)
        own = layer.__dict__.get("_streamspec_own", True)
    if cached is None or cached[0] != key:
        cached = (key, _make_pack(w, own))
        layer.__dict__["_streamspec_packed"] = cached  # a plain attribute: not a parameter or buffer
        _register_pack(w, cached[1])
    return cached[1]


def _register_pack(weight: torch.Tensor, packed: tuple) -> None:
    if native.ready():  # the same pack for the C++ operator of compiled graphs (or none: oneDNN alone)
        if packed[1] is not None:
            native.bf16_linear().remember_pack(weight, packed[1])
        else:
            native.bf16_linear().forget_pack(weight)
    key = _pack_key(weight)
    entry = _PACKS.get(key)
    known = entry is not None and entry[0]() is weight
    _PACKS[key] = (weakref.ref(weight), weight._version, packed)
    if not known:  # one finalizer per weight: the packs go with it (the C++ operator's too)
        weakref.finalize(weight, _drop_pack, key, weight._cdata)


def _drop_pack(key: tuple, impl: int | None = None) -> None:
    if impl is not None and native.ready():
        native.bf16_linear().forget_impl(impl)
    entry = _PACKS.get(key)
    if entry is not None and entry[0]() is None:
        del _PACKS[key]


def _forget_pack(weight: torch.Tensor) -> None:
    if native.ready():
        native.bf16_linear().forget_pack(weight)
    key = _pack_key(weight)
    entry = _PACKS.get(key)
    if entry is not None and entry[0]() is weight:
        del _PACKS[key]


def _pack_of(weight: torch.Tensor) -> tuple:
    """The packed form of `weight` for the compiled operator: the one its layer packed when that
    weight (this address, shape, strides and dtype: a transposed view of a square weight is
    another entry) is alive and unchanged since (same version); else packed now (and kept while
    the tensor lives)."""
    entry = _PACKS.get(_pack_key(weight))
    if entry is not None:
        owner = entry[0]()
        if owner is not None and owner._version == entry[1] and owner.data_ptr() == weight.data_ptr():
            return entry[2]  # (a weight whose .data was replaced has moved: its old entry is stale)
    # a stale entry's weight is packed again as it was (with or without streamspec's own kernel)
    packed = _make_pack(weight, own=entry is None or entry[2][1] is not None)
    _register_pack(weight, packed)
    return packed


def _packed_linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _run_packed(x, _pack_of(weight), weight, bias)


# A plain library operator (a CPU kernel and a shape function), not `torch.library.custom_op`:
# its dispatch costs ~4 µs a call against ~20 µs, over the ~210 layers of a step (measured here).
_LIBRARY = torch.library.Library("streamspec", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear_cpu, "CPU")


torch.library.register_fake("streamspec::packed_linear")(native.linear_shape)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN with `weight` packed once: the
    ``streamspec::packed_linear`` operator compiled graphs call for `PackedLinear` (float32 or
    bfloat16 on a CPU; inference only, no autograd)."""
    return torch.ops.streamspec.packed_linear(x, weight, bias)


def pack_linear_layers(model: nn.Module, own_kernel: bool = True) -> int:
    """Switch every CPU `nn.Linear` of `model` in a dtype of `packed_dtypes` (float32, and bfloat16
    on CPUs with native bf16) to `PackedLinear` and pack its weight now (so the first timed call
    does not pay for it). Layers on another device or in another dtype, and subclasses of
    `nn.Linear`, are left as they are. Returns how many layers were switched
    (0 when none qualify). Undo with `unpack_linear_layers`.

    Pack after the weights are final (loaded, LoRA merged). A weight changed in place through
    autograd-visible ops (``copy_``, ``load_state_dict``) is packed again at its next call; one
    changed through ``.data`` is not seen: call this again (it re-packs packed layers).

    bfloat16 and float32 layers also get streamspec's own kernel for passes of up to
    `native.MAX_ROWS` rows where it runs (`streamspec.native`; it costs the weights' memory once
    more); ``own_kernel=False`` keeps them on oneDNN alone (to compare the two).

    Raises RuntimeError when this torch build has no oneDNN (see `cpu_kernels_available`).
    """
    if not cpu_kernels_available():
        raise RuntimeError("this torch build has no oneDNN (torch.backends.mkldnn); keep the default kernels")
    dtypes = packed_dtypes()
    count = 0
    for module in model.modules():
        if (type(module) in (nn.Linear, PackedLinear) and module.weight.device.type == "cpu"
                and module.weight.dtype in dtypes):
            module.__class__ = PackedLinear
            module.__dict__.pop("_streamspec_packed", None)  # packing again picks up any change
            module.__dict__["_streamspec_own"] = own_kernel
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
            module.__dict__.pop("_streamspec_own", None)
            _forget_pack(module.weight)
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


# -- attention for decoding passes (streamspec.attention; re-exported) ---------------------------
from .attention import (  # noqa: E402,F401
    DECODE_ATTENTION,
    DECODE_ATTENTION_MAX_QUERIES,
    decode_attention_forward,
    use_decode_attention,
    use_sdpa_attention,
)


@contextlib.contextmanager
def default_kernels(model: nn.Module):
    """Inside the block, `model` runs torch's and transformers' defaults: `F.linear` for its packed
    layers (`default_linear_kernels`) and ``sdpa`` attention where it ran `decode_attention_forward`
    (both restored afterwards): what the benchmark's default-kernel rows and peers run."""
    config = getattr(getattr(model, "hf_model", model), "config", None)
    switched = config is not None and getattr(config, "_attn_implementation", None) == DECODE_ATTENTION
    own = [m for m in model.modules() if m.__dict__.get("_streamspec_native_attention") is False]
    if switched:
        use_sdpa_attention(model)
    try:
        with default_linear_kernels(model):
            yield
    finally:
        if switched:
            use_decode_attention(model)
            for layer in own:  # layers kept on torch's operators (`use_decode_attention(own_kernel=False)`) stay so
                layer.__dict__["_streamspec_native_attention"] = False

