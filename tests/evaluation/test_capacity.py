"""The capacity study's table (`streamspec.evaluation.capacity`, `eval/capacity_table.py`) on real
runs: a tiny Llama trained with the study's stream recipe and a Medusa peer, each benchmarked on a
held-out Spider question; the table names what each trained and carries its own figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from streamspec.evaluation.benchmark import run_benchmark
from streamspec.evaluation.capacity import capacity_table, describe
from streamspec.training.recipe import load_recipe
from streamspec.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "smollm2-135m"


def _train(tiny_dir, recipe, out, **extra):
    values = {
        "model.name_or_path": str(tiny_dir), "model.dtype": "float32", "training.output_dir": str(out),
        "training.max_steps": 2, "training.save_steps": 2, "training.logging_steps": 1, "training.eval_steps": 2,
        "training.batch_size": 2, "training.report_to": "none", "data.max_train_examples": 4,
        "data.max_validation_examples": 2, "data.max_length": 512, "data.distill.enabled": "false",
        "data.cache_activations": "false", **extra,
    }
    return run_training(load_recipe(RECIPES / recipe, [f"{k}={v}" for k, v in values.items()]))


def test_table_of_a_stream_run_and_its_medusa_peer(tiny_dir, tmp_path):
    streams = _train(tiny_dir, "sql_study.yaml", tmp_path / "ns2", **{"streams.stream_layers": 2,
                                                                     "streams.stream_targets": "labels"})
    medusa = _train(tiny_dir, "sql_study_medusa.yaml", tmp_path / "medusa")
    run_benchmark(streams["export"], task="sql", limit=1, tree_top_k=1, thresholds=(), lookup=None, tree_budget=None,
                  max_new_tokens=6, out_dir=str(tmp_path / "eval-ns2"), medusa=medusa["export"])
    table = capacity_table([tmp_path / "ns2", tmp_path / "medusa"], [tmp_path / "eval-ns2", tmp_path / "eval-ns2"])
    lines = table.splitlines()
    assert lines[0].startswith("| configuration |") and len(lines) == 4
    methods = json.loads((tmp_path / "eval-ns2" / "benchmark.json").read_text())["methods"]
    chain, heads = lines[2].split(" | "), lines[3].split(" | ")
    assert "streams Ns=2, γ=3, rank=32, init=identity, lr=0.001/0.01" in chain[0]
    assert heads[0] == "| Medusa, 3 heads"
    assert chain[5] == f"{methods['chain']['crr']:.2f}" and heads[5] == f"{methods['medusa']['crr']:.2f}"
    assert int(chain[1].replace(",", "")) > 0 and chain[1] != heads[1]  # each run's own draft weights counted
    assert len(chain[3].split(" / ")) == 3  # the validation top-1 of each of the γ drafts
    # the command prints the same table; a run without its eval folder has no held-out figures
    shown = subprocess.run([sys.executable, str(ROOT / "eval" / "capacity_table.py"), str(tmp_path / "ns2"),
                            str(tmp_path / "medusa"), "--evals", str(tmp_path / "eval-ns2"), "-"],
                           capture_output=True, text=True, check=True).stdout
    assert shown.splitlines()[2] == lines[2] and shown.splitlines()[3].endswith("| – | – | – |")
    failed = subprocess.run([sys.executable, str(ROOT / "eval" / "capacity_table.py"), str(tmp_path / "ns2"),
                             "--evals", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert failed.returncode != 0 and "no benchmark.json in" in failed.stderr and "Traceback" not in failed.stderr


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="2 eval folders for 1 runs"):
        capacity_table([tmp_path], [tmp_path, tmp_path])
    with pytest.raises(FileNotFoundError, match="no recipe.yaml"):
        capacity_table([tmp_path])
    with pytest.raises(ValueError, match="neither streams nor Medusa"):
        describe({"streams": None, "training": {"learning_rate": 1e-3}})
    assert describe({"streams": {"stream_layers": 8, "stream_init": "lowrank", "init_rank": 16},
                      "training": {"learning_rate": 1e-3}}) == \
        "streams Ns=8, γ=3, rank=-, init=lowrank (rank 16), lr=0.001/0.001"
