"""What the streams change inside the MSA layers, as modules put in place once.

Two changes act on stream rows only, in the top Ns decoder layers:

- `ValueRotation` (``stream_init="value_rotation"``) rotates stream j's attention values;
- `StreamAdapter` (``stream_adapter_rank``) adds a low-rank residual to a linear layer's output.

Each is a wrapper that keeps the module it replaces as ``base_layer`` (as peft wraps a layer) and
is put in place of it by `StreamedModel.insert_stream_modules`, so gradient checkpointing,
``torch.compile``, DeepSpeed and ``copy.deepcopy`` see an ordinary module tree. A wrapper leaves
main rows exactly as the base layer made them. Like peft's, its state dict names the wrapped
module's entries ``base_layer.…``; what is saved as a transformers model or a peft adapter is saved
with the wrappers taken out (`stream_modules_taken_out`), so saved folders have the plain model's
keys, and a wrapper also loads a state dict of the plain model. The stream weights stay in
`StreamParameters`, which is what a streamed checkpoint saves; a wrapper only refers to them.

How a wrapper knows which rows are stream rows: see `StreamRows`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels import PackedLinear

# Keyword argument of an MSA decoder-layer call: how many leading rows are main rows.
STREAM_ROWS = "stream_rows"


class StreamRows:
    """The row split of the MSA-layer call in progress, shared by the stream modules of a model:
    the first `num_main` rows are main rows, the rest are γ stream rows per carrying position,
    position by position. None outside a streamed call (the plain model's own forward), where the
    stream modules pass everything through.

    `StreamedModel.run_upper` passes the split as a keyword argument of each MSA decoder-layer
    call (`STREAM_ROWS`); transformers decoder layers hand their extra keyword arguments on to
    their attention module, where `take` (a forward pre-hook, put in place with the wrappers)
    reads it before any linear of the layer runs (attention comes first in every supported
    layer). Why not a value set around the layer loop: gradient checkpointing runs a layer's
    forward again during backward, after that loop has ended (and perhaps after other forwards
    have changed such a value). It replays the layer call with the same arguments, so the split,
    being one of them, is seen identically by the recomputation. A pre-hook on the attention
    module runs inside the checkpointed region, unlike one on the decoder layer (transformers
    checkpoints the layer's ``forward``, not its hooks).
    """

    def __init__(self) -> None:
        self.num_main: int | None = None

    def take(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        self.num_main = kwargs.pop(STREAM_ROWS, None)  # the attention itself never sees it
        return args, kwargs


class StreamModule(nn.Module):
    """A wrapper of `base_layer` that changes the stream rows of its output (`stream_rows`)."""

    def __init__(self, base_layer: nn.Module, rows: StreamRows) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.rows = rows  # not a module: shared, never saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        num_main = self.rows.num_main
        if num_main is None or num_main >= out.shape[1]:
            return out
        return self.stream_rows(x, out, num_main)

    def stream_rows(self, x: torch.Tensor, out: torch.Tensor, num_main: int) -> torch.Tensor:
        raise NotImplementedError

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        # A state dict of the plain model (a merged checkpoint's base, say) holds the wrapped
        # module's entries under this module's own name: they go to `base_layer`. Entries already
        # named as in this model (its own state dict) stay. `state_dict` holds this module's
        # entries only; its children are loaded from it afterwards.
        own = self.state_dict(prefix=prefix, keep_vars=True)
        for key in [k for k in state_dict if k.startswith(prefix) and k not in own]:
            state_dict[prefix + "base_layer." + key[len(prefix) :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool, adapter_names) -> nn.Module:
        """peft's ``merge_and_unload``/``unload`` call this on a module with a ``base_layer``: the
        wrapper stays, and peft then merges or unloads the LoRA layer it wraps, if any."""
        return self


class ValueRotation(StreamModule):
    """Rotates stream j's attention values by j·π/(γ+1) in each consecutive pair of value
    channels. Wraps the module whose output holds the values; `part` is ``(index, parts)`` when
    that output is a fused projection of which the values are chunk `index` of `parts` (GPT-2)."""

    def __init__(self, base_layer: nn.Module, rows: StreamRows, num_streams: int, part: tuple[int, int] | None) -> None:
        super().__init__(base_layer, rows)
        weight = next(base_layer.parameters(), None)  # the buffers go where the values are made
        angle = torch.arange(1, num_streams + 1, dtype=torch.float32, device=weight.device if weight is not None else None)
        angle = angle * (math.pi / (num_streams + 1))
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)
        self.num_streams = num_streams
        self.part = part

    def stream_rows(self, x: torch.Tensor, out: torch.Tensor, num_main: int) -> torch.Tensor:
        width = out.shape[-1] // self.part[1] if self.part else out.shape[-1]
        start = self.part[0] * width if self.part else 0
        streams = out[:, num_main:]
        # [B, slots·γ, width] -> [B, slots, γ, width/2, 2]: stream j of every slot turns by angle j
        pairs = streams[..., start : start + width].unflatten(1, (-1, self.num_streams)).unflatten(-1, (-1, 2))
        cos, sin = self.cos.to(out)[:, None], self.sin.to(out)[:, None]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).flatten(1, 2)
        if torch.is_grad_enabled():
            streams = torch.cat([streams[..., :start], rotated, streams[..., start + width :]], dim=-1)
            return torch.cat([out[:, :num_main], streams], dim=1)
        out[:, num_main:, start : start + width] = rotated  # decoding: no copy of the whole output
        return out


class StreamAdapter(StreamModule):
    """Adds ``up(down(x))`` to the stream rows of a linear layer's output (`StreamAdapters` holds
    the weights; ``up`` starts at zero, so the streams start as without adapters)."""

    def __init__(self, base_layer: nn.Module, rows: StreamRows, pair: nn.Module) -> None:
        super().__init__(base_layer, rows)
        # Not registered as a submodule: the weights belong to `StreamParameters` (saved there,
        # trained there, never part of the base's parameters or state dict).
        object.__setattr__(self, "pair", pair)

    def stream_rows(self, x: torch.Tensor, out: torch.Tensor, num_main: int) -> torch.Tensor:
        down, up = self.pair.down, self.pair.up
        rows = x[:, num_main:].to(down.weight.dtype)  # float32 master weights in reduced-precision training
        if hasattr(down.weight, "ds_id"):
            # partitioned by DeepSpeed ZeRO-3, which gathers a module's weights around its calls only
            delta = up(down(rows)).to(out.dtype)
        elif type(down) is PackedLinear and type(up) is PackedLinear and down.weight.dtype in (torch.bfloat16,
                                                                                            torch.float32):
            # layers packed for decoding on a CPU (`streamspec.kernels`): a few rows through
            # streamspec's kernel, bf16 28 µs for both against 55 through F.linear (3 rows, rank 64);
            # float32 41 µs against 57 eager (3 rows, two threads of an AMD EPYC), and in a compiled
            # pass a C++ call each instead of two `aten::mm` (56 a pass, ~2.5 ms of a 7-node tree's 45)
            delta = up(down(rows)).to(out.dtype)
        else:
            # F.linear on the weights: two module calls per linear per pass would cost more than the
            # products themselves on a few decoding rows
            low = F.linear(rows, down.weight)
            if not torch.is_grad_enabled() and out.shape[0] == 1 and low.dtype == out.dtype:
                # decoding one sequence: the up projection added into the stream rows by the
                # product itself (addmm: one GEMM kernel on CUDA instead of a GEMM and an add)
                out[0, num_main:].addmm_(low[0], up.weight.t())
                return out
            delta = F.linear(low, up.weight).to(out.dtype)
        if torch.is_grad_enabled():
            return torch.cat([out[:, :num_main], out[:, num_main:] + delta], dim=1)
        out[:, num_main:] += delta
        return out


def unwrap(module: nn.Module) -> nn.Module:
    """The module a stack of stream modules wraps (`module` itself when it is none)."""
    while isinstance(module, StreamModule):
        module = module.base_layer
    return module


def replace_submodule(root: nn.Module, path: str, wrap) -> nn.Module:
    """Put ``wrap(current)`` in place of the submodule at dotted `path` of `root`; returns it."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    new = wrap(getattr(parent, name))
    setattr(parent, name, new)
    return new


def _take_out(root: nn.Module) -> list[tuple[nn.Module, str, StreamModule]]:
    """Put back, everywhere in `root`, the module each stack of stream modules wraps; returns
    ``(parent, name, outermost wrapper)`` for each stack taken out."""
    taken = []
    for parent in list(root.modules()):
        if isinstance(parent, StreamModule):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, StreamModule):
                taken.append((parent, name, child))
                setattr(parent, name, unwrap(child))
    return taken


def remove_stream_modules(root: nn.Module) -> int:
    """Take every stream module out of `root` for good (out of a copy of a streamed model's base,
    say, before saving it as a plain transformers model). Returns how many stacks were taken out."""
    return len(_take_out(root))


@contextlib.contextmanager
def stream_modules_taken_out(root: nn.Module):
    """Inside the block, `root` holds the modules the stream modules wrap (peft saves its adapter in
    its own layout, as if there were no wrappers); afterwards the very same wrappers are back (a
    compiled model sees the same modules)."""
    taken = _take_out(root)
    try:
        yield root
    finally:
        for parent, name, wrapper in taken:
            setattr(parent, name, wrapper)
