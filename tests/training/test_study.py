"""Studies: every point trained once, resumed from its checkpoint after a stop, never retrained."""

from __future__ import annotations

import json
import shutil

import pytest

from streamspec.training import study as study_module
from streamspec.training import trainer as trainer_module
from streamspec.evaluation.capacity import capacity_table
from streamspec.training.study import (
    STUDIES, Point, Study, point_finished, point_overrides, point_progress, study_points, train_study,
)


def _rows(path, count):
    path.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} plus {i}?", "completion": f"{2 * i}"}) + "\n"
                            for i in range(count)), encoding="utf-8")
    return str(path)


def test_a_study_trains_each_point_once_and_resumes_a_stopped_one(tiny_dir, tmp_path, monkeypatch, single_thread):
    common = {"model.name_or_path": str(tiny_dir), "model.dtype": "float32", "training.init_from": None,
              "training.report_to": "none", "training.max_steps": 2, "training.save_steps": 1,
              "training.logging_steps": 1, "training.eval_steps": 2, "training.batch_size": 2,
              "data.path": f"[{_rows(tmp_path / 'train.jsonl', 8)}]", "data.validation_path": _rows(tmp_path / "val.jsonl", 2),
              "data.max_length": 128}
    tiny = Study(study_module.SQL_SCALE, (Point("half", {**common, "data.train_fraction": 0.5}),
                                          Point("all", dict(common))), "a tiny study")
    monkeypatch.setitem(STUDIES, "tiny", tiny)
    calls = []
    real = trainer_module.run_training

    def recorded(recipe, resume=False):
        calls.append((recipe.training.output_dir, resume))
        return real(recipe, resume=resume)

    monkeypatch.setattr(trainer_module, "run_training", recorded)
    out = tmp_path / "study"
    shared = [f"data.activations_path={tmp_path / 'store'}"]  # one store every point reads
    _, points, runs = train_study("tiny", out, overrides=shared)
    assert [c[1] for c in calls] == [False, False] and runs == [out / "half", out / "all"]
    assert (tmp_path / "store" / "store.json").is_file()
    for run in runs:
        assert (run / "recipe.yaml").read_text().count(str(tmp_path / "store")) == 1
    table = capacity_table(runs)
    assert "data 50%" in table and len([line for line in table.splitlines() if line.startswith("| streams")]) == 2

    calls.clear()
    assert train_study("tiny", out, overrides=shared)[2] == runs and calls == [] and capacity_table(runs) == table  # kept

    (out / "all" / "training_summary.json").unlink()  # a point stopped after its first checkpoint
    shutil.rmtree(out / "all" / "checkpoint-2")
    train_study("tiny", out, ["all"], overrides=shared)
    assert calls == [(str(out / "all"), True)]  # resumed from checkpoint-1
    state = json.loads((out / "all" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2


def test_a_time_budget_stops_the_point_in_training_with_a_checkpoint_and_the_same_command_continues(
        tiny_dir, tmp_path, monkeypatch, single_thread):
    common = {"model.name_or_path": str(tiny_dir), "model.dtype": "float32", "training.init_from": None,
              "training.report_to": "none", "training.max_steps": 3, "training.save_steps": 100,
              "training.logging_steps": 1, "training.eval_steps": 100, "training.batch_size": 2,
              "data.path": f"[{_rows(tmp_path / 'train.jsonl', 8)}]", "data.validation_path": _rows(tmp_path / "val.jsonl", 2),
              "data.max_length": 128, "data.cache_activations": False}
    tiny = Study(study_module.SQL_SCALE, (Point("first", dict(common)), Point("second", dict(common))), "a tiny study")
    monkeypatch.setitem(STUDIES, "tiny", tiny)
    calls = []
    real = trainer_module.run_training

    def recorded(recipe, resume=False):
        calls.append((recipe.training.output_dir, resume, recipe.training.max_minutes))
        return real(recipe, resume=resume)

    monkeypatch.setattr(trainer_module, "run_training", recorded)
    # the study's clock: 0.1 ms is left when the first point starts (its first step takes longer),
    # none for the second
    clock = iter([0.0, 59.9999, 61.0])
    monkeypatch.setattr(study_module.time, "monotonic", lambda: next(clock))
    out = tmp_path / "study"
    _, _, runs = train_study("tiny", out, max_minutes=1)
    assert runs == [out / "first", out / "second"]
    assert calls == [(str(out / "first"), False, pytest.approx(0.0001 / 60, rel=1e-3))]
    assert not point_finished(runs[0]) and not point_finished(runs[1])
    assert point_progress(runs[1]) == "not started"
    progress = point_progress(runs[0])  # the time budget's stop saved a checkpoint of an unfinished run
    assert progress.startswith("step ") and progress.endswith(" of 3") and progress != "step 3 of 3"

    calls.clear()
    monkeypatch.setattr(study_module.time, "monotonic", lambda: 0.0)  # a budget no point runs out of
    train_study("tiny", out, max_minutes=60)
    assert [c[:2] for c in calls] == [(str(out / "first"), True), (str(out / "second"), False)]
    assert point_finished(runs[0]) and point_finished(runs[1])
    assert point_progress(runs[0]) == "step 3 of 3"
    with pytest.raises(ValueError, match="max_minutes"):
        train_study("tiny", out, overrides=["training.max_minutes=5"], max_minutes=5)
    with pytest.raises(ValueError, match="max_minutes"):
        train_study("tiny", out, max_minutes=0)


def test_study_names_and_points_are_checked():
    with pytest.raises(ValueError, match=r"no study 'nope'; studies: \['chat-data', 'sql-capacity', 'sql-data'\]"):
        study_points("nope")
    with pytest.raises(ValueError, match=r"no point\(s\) \['rank-9'\]"):
        study_points("sql-capacity", ["rank-9"])
    capacity, points = study_points("sql-capacity", ["full-rank", "data-30"])
    assert [p.name for p in points] == ["data-30", "full-rank"]  # the study's order
    data, _ = study_points("sql-data")
    shared = [p for p in data.points if p.name == "data-30"]
    assert shared == [p for p in capacity.points if p.name == "data-30"]  # one folder serves both studies
    from pathlib import Path

    from streamspec.training.recipe import load_recipe

    with pytest.raises(ValueError, match="data.train_fraction is what the study sets for point data-30"):
        point_overrides(shared[0], Path("runs/x"), ["data.train_fraction=1.0"])
    with pytest.raises(ValueError, match="an override is KEY=VALUE"):
        train_study("sql-data", Path("runs/x"), overrides=["data.activations_path"])
    chat, _ = study_points("chat-data")
    assert chat.task == "chat" and data.task == capacity.task == "sql"
    for study in (capacity, data, chat):
        for point in study.points:  # every point is a valid recipe
            recipe = load_recipe(study.recipe, point_overrides(point, Path("runs/x")))
            assert recipe.training.output_dir == f"runs/x/{point.name}" and recipe.training.init_from is None


def test_a_point_is_measured_once_on_held_out_prompts(tiny_dir, tmp_path, single_thread):
    from streamspec.evaluation.study import evaluate_chain
    from streamspec.training.recipe import load_recipe
    from streamspec.training.trainer import run_training

    run = tmp_path / "point"
    run_training(load_recipe(study_module.SQL_SCALE, [
        f"model.name_or_path={tiny_dir}", "model.dtype=float32", "training.init_from=null", "training.report_to=none",
        "training.max_steps=1", f"training.output_dir={run}", "data.cache_activations=false", "data.max_length=128",
        f"data.path=[{_rows(tmp_path / 'train.jsonl', 4)}]", f"data.validation_path={_rows(tmp_path / 'val.jsonl', 2)}"]))
    folder = evaluate_chain(run / "final", tmp_path / "eval-point", limit=1, max_new_tokens=4)
    made = (folder / "benchmark.json").stat().st_mtime_ns
    assert evaluate_chain(run / "final", folder, limit=1) == folder and (folder / "benchmark.json").stat().st_mtime_ns == made
    row = [line for line in capacity_table([run], [folder]).splitlines() if line.startswith("| streams")][-1]
    assert "–" not in row.split("|")[-4]  # the held-out CRR column is filled


def test_streams_that_read_the_next_token_train_offline_and_are_not_decoded(tiny_dir, tmp_path, single_thread):
    """The `next-token` point's streams train from the store and are measured by validation top-1:
    no held-out chain is run for them (streamspec's decoders cannot draft with them)."""
    from streamspec.evaluation.study import evaluate_chain
    from streamspec.training.recipe import load_recipe
    from streamspec.training.trainer import run_training

    run = tmp_path / "point"
    run_training(load_recipe(study_module.SQL_SCALE, [
        f"model.name_or_path={tiny_dir}", "model.dtype=float32", "training.init_from=null", "training.report_to=none",
        "training.max_steps=2", f"training.output_dir={run}", "data.max_length=128", "streams.next_token_input=true",
        f"data.activations_path={tmp_path / 'store'}",
        f"data.path=[{_rows(tmp_path / 'train.jsonl', 4)}]", f"data.validation_path={_rows(tmp_path / 'val.jsonl', 2)}"]))
    assert evaluate_chain(run / "final", tmp_path / "eval-point", limit=1) is None
    assert not (tmp_path / "eval-point").exists()
    row = [line for line in capacity_table([run], [None]).splitlines() if line.startswith("| streams")][-1]
    assert "–" in row.split("|")[-4]
