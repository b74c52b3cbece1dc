"""Studies: a recipe trained at several points (recipe overrides), each point resumable; with
each point's chain measured on held-out prompts (`streamspec.evaluation.study.evaluate_chain`),
what the next run should change (more data, more capacity) is read from one table
(`streamspec.evaluation.capacity.capacity_table`).

A point's folder is ``OUT/NAME``. A point whose training finished (``training_summary.json``) is
not trained again; one with a complete checkpoint resumes from it (a study stopped anywhere, on
any machine with its folders, continues with the same command). With a time budget
(`train_study`'s ``max_minutes``) the point in training stops with a checkpoint when the budget
runs out (``training.max_minutes``; its summary says ``stopped_by_time``), later points wait, and
the same command continues.

    python eval/scale_study.py --study sql-data --out runs/study-sql
    python eval/scale_study.py --study chat-data --out runs/study-chat
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SQL_SCALE = "recipes/smollm2-135m/sql_streams_scale.yaml"
CHAT = "recipes/smollm2-135m/chat_streams.yaml"
# Every point starts from fresh streams (ranks differ from the shipped weights'), at the learning
# rates the shipped streams started with; one pass over its data
_FROM_SCRATCH = {"training.init_from": None, "training.learning_rate": 1e-3, "training.stream_learning_rate": 1e-2,
                 "training.report_to": "none"}
# The capacity points see the same 30% of the set; their stores are the whole set's, so each rank
# reads one store; Ns 6 needs other layers' activations and trains online instead
_CAPACITY_DATA = {"data.train_fraction": 0.3}


@dataclass(frozen=True)
class Point:
    name: str
    overrides: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Study:
    recipe: str
    points: tuple[Point, ...]
    about: str
    task: str = "sql"  # whose held-out prompts each point's chain is measured on


# one point of both studies (trained once: the same folder): rank 64, Ns 4, 30% of the set
_BASE_30 = Point("data-30", {**_FROM_SCRATCH, **_CAPACITY_DATA})

STUDIES: dict[str, Study] = {
    "sql-data": Study(SQL_SCALE, (
        Point("data-10", {**_FROM_SCRATCH, "data.train_fraction": 0.1}),
        _BASE_30,
        Point("data-100", dict(_FROM_SCRATCH)),
    ), "data scaling at fixed capacity (rank-64 adapters, Ns 4): 10 / 30 / 100% of the SQL set, one pass each"),
    "sql-capacity": Study(SQL_SCALE, (
        _BASE_30,
        Point("rank-128", {**_FROM_SCRATCH, **_CAPACITY_DATA, "streams.stream_adapter_rank": 128}),
        Point("rank-256", {**_FROM_SCRATCH, **_CAPACITY_DATA, "streams.stream_adapter_rank": 256}),
        # rank 576 = min(in, out) of every linear of SmolLM2-135M's layers: a full-rank stream-only
        # change of each top-layer linear (the main rows keep the base's weights: still exact)
        Point("full-rank", {**_FROM_SCRATCH, **_CAPACITY_DATA, "streams.stream_adapter_rank": 576}),
        # both levers together: the full rank on the whole set (what neither reached alone)
        Point("full-rank-100", {**_FROM_SCRATCH, "streams.stream_adapter_rank": 576}),
        Point("ns-6", {**_FROM_SCRATCH, **_CAPACITY_DATA, "streams.stream_layers": 6, "data.cache_activations": False}),
        # the streams also read the token after their position (what a drafter after the verify pass
        # knows: vLLM's DFlash layout); validation top-1 only, streamspec's decoders cannot run them
        Point("next-token", {**_FROM_SCRATCH, **_CAPACITY_DATA, "streams.next_token_input": True}),
    ), "capacity at fixed data (30% of the SQL set, one pass): adapter rank 64 / 128 / 256 / full, Ns 4 / 6, "
       "the streams reading the next token, and the full rank on the whole set"),
    # the chat recipe trains from fresh streams already, offline; its shares of the whole chat set
    "chat-data": Study(CHAT, (
        Point("data-10", {"data.train_fraction": 0.1, "training.report_to": "none"}),
        Point("data-30", {"data.train_fraction": 0.3, "training.report_to": "none"}),
        Point("data-100", {"training.report_to": "none"}),
    ), "data scaling at fixed capacity (rank-64 adapters, Ns 4): 10 / 30 / 100% of the chat set, one pass each; "
       "held-out chains on MT-bench's first turns", task="chat"),
}


def study_points(name: str, only: list[str] | None = None) -> tuple[Study, list[Point]]:
    """The study and the points to run (all, or those named in `only`)."""
    if name not in STUDIES:
        raise ValueError(f"no study {name!r}; studies: {sorted(STUDIES)}")
    study = STUDIES[name]
    known = [p.name for p in study.points]
    unknown = sorted(set(only or ()) - set(known))
    if unknown:
        raise ValueError(f"study {name!r} has no point(s) {unknown}; its points: {known}")
    return study, [p for p in study.points if not only or p.name in only]


def point_overrides(point: Point, out: Path, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``key=value`` overrides of one point, its output folder included, then `extra`: the
    ones every point shares (``data.activations_path=DIR``: a store built already); an extra
    override may not change what the point varies."""
    values = {**point.overrides, "training.output_dir": str(out / point.name)}
    for item in extra:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise ValueError(f"an override is KEY=VALUE (e.g. data.activations_path=runs/store), got {item!r}")
        if key in values:
            raise ValueError(f"{key} is what the study sets for point {point.name}; it cannot be overridden")
    return [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in values.items()] + list(extra)


def has_checkpoint(folder: Path) -> bool:
    return any((p / "trainer_state.json").is_file() for p in folder.glob("checkpoint-*"))


def point_finished(folder: Path) -> bool:
    """Whether a point's training ran to its end: a summary, not one of a time budget's stop."""
    from .trainer import SUMMARY_FILE

    summary = folder / SUMMARY_FILE
    return summary.is_file() and not json.loads(summary.read_text()).get("stopped_by_time", False)


def point_progress(folder: Path) -> str:
    """Where an unfinished point stands: its latest complete checkpoint's step, or not started."""
    states = [p / "trainer_state.json" for p in folder.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    if not states:
        return "not started"
    state = max((json.loads(p.read_text()) for p in states), key=lambda s: s["global_step"])
    return f"step {state['global_step']} of {state['max_steps']}"


def train_point(study: Study, point: Point, out: Path, recipe_root: Path = Path("."),
                overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """Train one point (or resume it; nothing when it finished); its output folder."""
    from .recipe import load_recipe
    from .trainer import run_training

    folder = out / point.name
    if point_finished(folder):
        logger.warning("study point %s: trained already (%s)", point.name, folder)
        return folder
    recipe = load_recipe(recipe_root / study.recipe, point_overrides(point, out, overrides))
    resume = has_checkpoint(folder)
    logger.warning("study point %s: %s", point.name, "resuming" if resume else "training")
    run_training(recipe, resume=resume)
    return folder


def train_study(name: str, out: str | Path, only: list[str] | None = None, recipe_root: Path = Path("."),
                overrides: list[str] | tuple[str, ...] = (), max_minutes: float | None = None,
                ) -> tuple[Study, list[Point], list[Path]]:
    """Train a study's points in order (each resumed or kept as above), every point with
    `overrides` too (``key=value``); the study, its points and their output folders (whether each
    finished: `point_finished`). `max_minutes`: training stops when that much time has passed,
    the point in training with a checkpoint, and later points are not started."""
    study, points = study_points(name, only)
    out = Path(out)
    for point in points:  # a bad override fails before any point trains
        point_overrides(point, out, overrides)
    if max_minutes is not None:
        if not max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {max_minutes!r}")
        if any(item.split("=", 1)[0].strip() == "training.max_minutes" for item in overrides):
            raise ValueError("give the study's time budget as max_minutes (--max-minutes), not training.max_minutes")
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    runs = []
    for point in points:
        extra = list(overrides)
        if deadline is not None and not point_finished(out / point.name):
            left = (deadline - time.monotonic()) / 60
            if left <= 0:
                logger.warning("study point %s: waits (the time budget is spent)", point.name)
                runs.append(out / point.name)
                continue
            extra.append(f"training.max_minutes={left:.6g}")
        runs.append(train_point(study, point, out, recipe_root, extra))
    return study, points, runs
