"""Devices and dtypes by name: what ``--device`` and ``--dtype`` accept everywhere, the dtype a
saved model is in, and how a decoding pass is formulated on each device type (`formulation`).
A foundation module: of streamspec it uses only `streamspec.assets` and `streamspec.native`."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""The values ``--dtype`` offers (the aliases in `DTYPES` are accepted too)."""


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` / None: ``cuda`` when CUDA is available, else ``cpu``; otherwise the device named,
    checked to exist here. Raises ValueError for an unknown name or a device this machine lacks."""
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from err
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for CUDA, but this torch build or machine has no CUDA device "
                             "(use --device cpu or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif resolved.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError(f"device {device!r}: MPS is not available here")
    elif resolved.type != "cpu":
        raise ValueError(f"unsupported device {device!r}: use auto, cpu, cuda, cuda:N or mps")
    return resolved


def auto_dtype(device_type: str) -> torch.dtype:
    """What ``--dtype auto`` loads a model in on a device type: bfloat16 on CUDA, float32 elsewhere
    (the pass's formulation there, `formulation`). Takes the type alone, so
    the choice is tested without the device."""
    return formulation(device_type, None, native_ready=False).auto_dtype


def resolve_dtype(dtype: str | torch.dtype | None = "auto", device: str | torch.device | None = "auto") -> torch.dtype:
    """``auto`` / None: bfloat16 on CUDA, float32 elsewhere (`device`: a torch.device, or a name
    as for `resolve_device`); else float32, bfloat16 or float16, by name or as a torch dtype.
    Raises ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype}")
        return dtype
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        # a torch.device is taken as it is (a model already placed there); a name is resolved
        kind = device.type if isinstance(device, torch.device) else resolve_device(device).type
        return auto_dtype(kind)
    name = dtype.strip().lower().removeprefix("torch.") if isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (or fp32, bf16, fp16), got {dtype!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def base_dtype(name_or_path: str | Path | None) -> torch.dtype:
    """The dtype a model's weights were saved in (its config's ``dtype`` / ``torch_dtype``), for
    commands that rewrite a model (`streamspec merge`, `export`) and should keep it. float32 when
    the config names none or cannot be read (a hub id offline)."""
    from .assets import DEFAULT_MODEL_ID

    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL_ID:
        return torch.float32  # the default model is converted to float32 (see streamspec.assets)
    config_file = Path(name_or_path) / "config.json"
    try:
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            saved = config.get("dtype") or config.get("torch_dtype")
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(name_or_path))
            saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    except (OSError, ValueError) as err:
        logger.warning("could not read the dtype of %s (%s); using float32", name_or_path, str(err).splitlines()[0])
        return torch.float32
    if saved is None:
        return torch.float32
    try:
        return resolve_dtype(saved if isinstance(saved, torch.dtype) else str(saved), "cpu")
    except ValueError:
        return torch.float32


def dtype_or_base(dtype: str | torch.dtype | None, base: str | Path | None) -> torch.dtype:
    """`dtype` when given (not None or ``auto``), else the base's saved dtype (`base_dtype`)."""
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        return base_dtype(base)
    return resolve_dtype(dtype, "cpu")


def cpu_model() -> str:
    """The CPU's model name as `lscpu` gives it ("AMD EPYC", "Intel(R) Xeon(R) ..."): what every
    measurement records beside its figures, since the machines change from run to run."""
    import platform
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


# How a decoding pass is formulated on a device: the one place where the CPU and CUDA ways of
# running the same pass are chosen (the tokens are the same either way; tests hold it).
#
# A batch-1 decoding pass is bound differently on the two:
#
# - on a CPU every row of a product costs its multiply-adds and every LM-head call reads the whole
#   head weight from memory, so the pass spends the fewest rows: the LM head over the main rows,
#   then over the accepted node's stream rows alone (`head_split`); the stream rows of a lossless
#   float32 model through bfloat16 copies of the MSA layers' linears (`bf16_stream_rows`, only
#   where streamspec's packed kernels run them); the host walk for uncompiled verification;
#   compiled graphs through inductor's C++ wrapper (`cpp_wrapper`);
# - on CUDA a few more rows in a product cost almost nothing while every kernel launch and every
#   host step costs microseconds, so the pass runs the stream rows in the same matmuls as the
#   main rows, one LM-head call over every row the pass needs, verification on the device, and a
#   compiled pass replays as one CUDA graph (`cuda_graphs`); ``--dtype auto`` is bfloat16 there
#   (`auto_dtype`).
#
# `formulation(device_type)` returns these choices; the decoding loops, the verifier, the compile
# step, the stream-row switch and `auto_dtype` all ask it.


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
    from . import native

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
