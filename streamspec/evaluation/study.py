"""The evaluation side of studies (`streamspec.training.study`): each point's chain measured on
held-out prompts, for the held-out columns of `streamspec.evaluation.capacity.capacity_table`."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def evaluate_chain(checkpoint: str | Path, folder: str | Path, task: str = "sql", limit: int = 30,
                   max_new_tokens: int = 128) -> Path | None:
    """`folder`: the `streamspec eval` of a checkpoint's chain (with `generate` and prompt lookup
    beside it) on `limit` held-out prompts of `task`, for `run_rows`' held-out columns; a folder
    that holds one already is kept. None for streams streamspec's decoders cannot run (they read
    the next token: ``next_token_input``), whose validation top-1 is their measure."""
    from ..patch.checkpoint import read_checkpoint_meta
    from .benchmark import run_benchmark

    if read_checkpoint_meta(checkpoint)["stream_config"].get("next_token_input"):
        logger.info("%s: its streams read the next token; no held-out chain to measure", checkpoint)
        return None
    folder = Path(folder)
    if not (folder / "benchmark.json").is_file():
        run_benchmark(str(checkpoint), task=task, limit=limit, tree_top_k=1, thresholds=(), lookup=None,
                      tree_budget=None, max_new_tokens=max_new_tokens, out_dir=str(folder), peers=(),
                      skip=("baseline_default_kernels", "streamed_ar", "tree"))
    return folder
