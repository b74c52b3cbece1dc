"""How a decoding pass is formulated on a device: the one place where the CPU and CUDA ways of
running the same pass are chosen (the tokens are the same either way; tests hold it).

A batch-1 decoding pass is bound differently on the two:

- on a CPU every row of a product costs its multiply-adds and every LM-head call reads the whole
  head weight from memory, so the pass spends the fewest rows: the LM head over the main rows,
  then over the accepted node's stream rows alone (`head_split`); the stream rows of a lossless
  float32 model through bfloat16 copies of the MSA layers' linears (`bf16_stream_rows`, only
  where streamspec's packed kernels run them); the host walk for uncompiled verification;
  compiled graphs through inductor's C++ wrapper (`cpp_wrapper`);
- on CUDA a few more rows in a product cost almost nothing while every kernel launch and every
  host step costs microseconds, so the pass runs the stream rows in the same matmuls as the
  main rows, one LM-head call over every row the pass needs, verification on the device, and a
  compiled pass replays as one CUDA graph (`cuda_graphs`); ``--dtype auto`` is bfloat16 there
  (`auto_dtype`).

`formulation(device_type)` returns these choices; the decoding loops, the verifier, the compile
step, the stream-row switch and dtype resolution all ask it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def _env_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


@dataclass(frozen=True)
class Formulation:
    """The device-dependent choices of a decoding pass (see the module docstring).

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ``"mps"``.
        head_split: the LM head over the main rows, then over the accepted node's stream rows only
            (two calls, fewest rows); else one call over every row.
        bf16_stream_rows: stream rows may run through bf16 copies of the packed MSA linears
            (`StreamedModel.use_bf16_stream_rows`); else in the same matmuls as the main rows.
        host_walk: what ``verify="auto"`` means uncompiled: the host walk (else the device step).
        cpp_wrapper: a compiled pass runs inductor's C++ wrapper (``STREAMSPEC_CPP_WRAPPER=0``: off).
        cuda_graphs: a compiled pass replays as a CUDA graph (``STREAMSPEC_CUDA_GRAPHS=0``: off).
        auto_dtype: what ``--dtype auto`` loads a model in.
    """

    device_type: str
    head_split: bool
    bf16_stream_rows: bool
    host_walk: bool
    cpp_wrapper: bool
    cuda_graphs: bool
    auto_dtype: torch.dtype


def head_split(device_type: str) -> bool:
    """`Formulation.head_split` alone, cheap enough to ask inside a traced pass."""
    from .. import native

    return device_type == "cpu" and native.ready()


def formulation(device_type: str | torch.device, backend: str | None = "inductor",
                native_ready: bool | None = None) -> Formulation:
    """The pass's formulation on `device_type` (compiled with `backend`, or None uncompiled).
    `native_ready`: whether streamspec's own CPU kernels are loaded (default: ask
    `streamspec.native`); a device type is enough, so the choice is tested without a GPU."""
    kind = torch.device(device_type).type
    cpu = kind == "cpu"
    return Formulation(
        device_type=kind,
        head_split=head_split(kind) if native_ready is None else cpu and native_ready,
        bf16_stream_rows=cpu,
        host_walk=cpu,
        cpp_wrapper=cpu and backend == "inductor" and not _env_off("STREAMSPEC_CPP_WRAPPER"),
        cuda_graphs=kind == "cuda" and backend == "inductor" and not _env_off("STREAMSPEC_CUDA_GRAPHS"),
        auto_dtype=torch.bfloat16 if kind == "cuda" else torch.float32,
    )
