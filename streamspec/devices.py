"""Devices and dtypes by name: what ``--device`` and ``--dtype`` accept everywhere, and the dtype
a saved model is in. A foundation module: of streamspec it uses only `streamspec.assets`."""

from __future__ import annotations

import json
import logging
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
        return torch.bfloat16 if kind == "cuda" else torch.float32
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
