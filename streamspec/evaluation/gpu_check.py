"""The GPU check (`eval/gpu_check.py`, `make gpu-check`): what streamspec does on a CUDA machine, in
one run of a few minutes, importing only torch, transformers and peft (and streamspec).

Parts (their rows: `streamspec.evaluation.gpu_rows`):

- ``a`` exactness: tiny models of every architecture and mode, eager and compiled, equal to
  greedy one-token decoding;
- ``b`` the end-to-end table on the default model with the shipped SQL streams (10 held-out Spider
  questions, float32 and bfloat16): transformers `generate` eager, compiled and with prompt
  lookup; streamspec one token a pass, chain, tree, tree + lookup, confidence tree (compiled), CRR,
  identical outputs;
- ``c`` the cost of one compiled pass (1 row, chain, tree (2,1,1), a 15-row lookup tree) on the
  default model and random-weight Llama-3.2-1B and Llama-3.1-8B shapes in bf16, with a
  torch.profiler split of one pass (GPU kernel time, kernels, host time);
- ``d`` one training step's time and peak memory at the 1B shape (next-token LoRA, lossless
  streams with stream adapters, shared streams with LoRA);
- ``e`` SpecReason's costs: prefill and decode tokens/s at the Qwen2.5-Coder-1.5B and 0.5B shapes.

The check degrades row by row (`RowRunner`): a row that raises or runs past its part's time
budget is recorded as such and the rest still run; the JSON (``--out``) is rewritten after every
row. Nothing is downloaded: the default model ships offline in a package, the other shapes are
random weights of their configs. ``--device cpu --quick`` runs small versions of every part on a
CPU (what the tests run).
"""

from __future__ import annotations

import json
import platform
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .gpu_rows import Row, rows_of

# Packages the check must not import (a GPU user's environment need not have them).
FORBIDDEN_IMPORTS = ("deepspeed", "wandb", "datasets", "llama_cpp", "xllamacpp", "vllm")
PARTS = ("a", "b", "c", "d", "e")
# Seconds each part may take on a GPU host, compiles included (8 minutes in all).
BUDGETS = {"a": 70, "b": 190, "c": 130, "d": 45, "e": 25}


@dataclass
class RowRunner:
    """Runs rows one by one, each within what is left of its part's budget: a row that raises is
    ``failed`` (with the error), one still running when the budget ends is ``timed out`` (a
    SIGALRM, where the platform has it), rows after the budget are ``skipped``; the others are
    ``ok``. After every row the results so far are written to `out` (JSON) and the row printed."""

    out: Path | None
    header: dict = field(default_factory=dict)
    results: list[dict] = field(default_factory=list)
    echo: Callable[[str], None] = print

    def run_part(self, part: str, rows: list[Row] | Callable[[], list[Row]], budget: float) -> None:
        start = time.perf_counter()
        try:
            rows = rows() if callable(rows) else rows
        except Exception as err:  # the part's set-up failed: one row says so
            rows = [Row(part, "set-up", _raiser(err))]
        for row in rows:
            left = budget - (time.perf_counter() - start)
            if left <= 0:
                self._record(row, "skipped (out of the part's time budget)", {}, 0.0)
                continue
            began = time.perf_counter()
            try:
                with _time_limit(left):
                    figures = row.run() or {}
                status = "ok"
            except _RowTimeout:
                status, figures = f"timed out (part budget {budget:.0f} s)", {}
            except Exception as err:
                status, figures = f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", {
                    "traceback": traceback.format_exc(limit=3)}
            self._record(row, status, figures, time.perf_counter() - began)

    def _record(self, row: Row, status: str, figures: dict, seconds: float) -> None:
        entry = {"part": row.part, "row": row.name, "status": status, "seconds": round(seconds, 1), **figures}
        self.results.append(entry)
        self.echo(f"[{row.part}] {row.name}: {status} " + _cells(figures))
        self.save()

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps({**self.header, "rows": self.results}, indent=2, default=str) + "\n")

    def table(self) -> str:
        """Every row in one Markdown table (the figures as ``key=value`` cells)."""
        lines = ["| part | row | status | figures |", "|---|---|---|---|"]
        for r in self.results:
            figures = {k: v for k, v in r.items() if k not in ("part", "row", "status", "seconds", "traceback")}
            lines.append(f"| {r['part']} | {r['row']} | {r['status']} | {_cells(figures)} |")
        return "\n".join(lines)


class _RowTimeout(Exception):
    pass


def _raiser(err: Exception) -> Callable[[], dict]:
    def run() -> dict:
        raise err
    return run


class _time_limit:
    """Raise `_RowTimeout` in the main thread after `seconds` (SIGALRM; elsewhere no limit)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = hasattr(signal, "SIGALRM") and _main_thread()

    def __enter__(self):
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 0.01))
        return self

    def __exit__(self, *exc) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)

    @staticmethod
    def _fire(*_):
        raise _RowTimeout()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _cells(figures: dict) -> str:
    shown = {k: v for k, v in figures.items() if k != "traceback"}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def forbidden_imports() -> list[str]:
    """The modules of `FORBIDDEN_IMPORTS` this process has imported."""
    return sorted({name.split(".")[0] for name in sys.modules} & set(FORBIDDEN_IMPORTS))


def machine(device: torch.device) -> dict:
    """What the figures were measured on."""
    from ..devices import cpu_model

    info = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}
    import transformers

    info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def run_check(device: str = "auto", parts: str | tuple[str, ...] = PARTS, quick: bool = False,
              out: str | Path | None = "gpu_check.json", budget_scale: float = 1.0) -> RowRunner:
    """Run the check's `parts` on `device` (``auto``: CUDA if present); returns the runner (its
    `results`, `table()`). `quick`: small versions of every part (a CPU runs them in minutes).
    `budget_scale` multiplies every part's time budget."""
    from ..devices import resolve_device

    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"parts must be among {list(PARTS)}, got {unknown}")
    target = resolve_device(device)
    runner = RowRunner(Path(out) if out is not None else None,
                       header={"device": str(target), "quick": quick, "machine": machine(target)})
    for part in parts:
        budget = BUDGETS[part] * budget_scale * (4 if quick and target.type == "cpu" else 1)
        runner.run_part(part, lambda part=part: rows_of(part, target, quick), budget)
    runner.header["forbidden_imports"] = forbidden_imports()
    runner.save()
    return runner
