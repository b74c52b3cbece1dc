"""The evaluation side of studies (`streamspec.training.study`): each point's chain measured on
held-out prompts, for the held-out columns of `streamspec.evaluation.capacity.capacity_table`."""

from __future__ import annotations

from pathlib import Path


def evaluate_chain(checkpoint: str | Path, folder: str | Path, task: str = "sql", limit: int = 30,
                   max_new_tokens: int = 128) -> Path:
    """`folder`: the `streamspec eval` of a checkpoint's chain (with `generate` and prompt lookup
    beside it) on `limit` held-out prompts of `task`, for `run_rows`' held-out columns; a folder
    that holds one already is kept."""
    from .benchmark import run_benchmark

    folder = Path(folder)
    if not (folder / "benchmark.json").is_file():
        run_benchmark(str(checkpoint), task=task, limit=limit, tree_top_k=1, thresholds=(), lookup=None,
                      tree_budget=None, max_new_tokens=max_new_tokens, out_dir=str(folder), peers=(),
                      skip=("baseline_default_kernels", "streamed_ar", "tree"))
    return folder
