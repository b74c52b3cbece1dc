"""The GPU check (`eval/gpu_check.py`) degrades row by row and imports only torch, transformers
and peft; its small CPU version runs here (`--device cpu --quick`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamspec.evaluation.gpu_check import FORBIDDEN_IMPORTS, Row, RowRunner, run_check

ROOT = Path(__file__).resolve().parents[2]


def test_a_failing_row_is_recorded_and_the_others_still_run(tmp_path):
    out = tmp_path / "check.json"
    printed = []
    runner = RowRunner(out, header={"device": "cpu"}, echo=printed.append)

    def broken():
        raise RuntimeError("no kernel image for this device")

    runner.run_part("x", [Row("x", "first", lambda: {"ms": 1.5}), Row("x", "broken", broken),
                          Row("x", "last", lambda: {"ms": 2.0})], budget=60)
    statuses = {r["row"]: r["status"] for r in runner.results}
    assert statuses["first"] == "ok" and statuses["last"] == "ok"
    assert statuses["broken"] == "failed: RuntimeError: no kernel image for this device"
    assert len(printed) == 3 and "broken: failed" in printed[1]
    written = json.loads(out.read_text())
    assert [r["row"] for r in written["rows"]] == ["first", "broken", "last"] and written["device"] == "cpu"
    table = runner.table()
    assert "| x | broken | failed: RuntimeError" in table and "ms=2.0" in table


def test_a_failed_set_up_fails_one_row_and_the_next_part_runs(tmp_path):
    runner = RowRunner(tmp_path / "c.json", echo=lambda line: None)

    def set_up():
        raise ImportError("no module named flash_attn")

    runner.run_part("c", set_up, budget=60)
    runner.run_part("d", [Row("d", "step", lambda: {"s": 0.1})], budget=60)
    assert [(r["part"], r["status"].split(":")[0]) for r in runner.results] == [("c", "failed"), ("d", "ok")]


def test_rows_past_the_budget_time_out_or_are_skipped(tmp_path):
    runner = RowRunner(tmp_path / "t.json", echo=lambda line: None)

    def slow():
        time.sleep(5)
        return {}

    start = time.perf_counter()
    runner.run_part("b", [Row("b", "slow", slow), Row("b", "after", lambda: {})], budget=0.5)
    assert time.perf_counter() - start < 3
    assert runner.results[0]["status"].startswith("timed out")
    assert runner.results[1]["status"].startswith("skipped")


def test_unknown_parts_are_refused():
    with pytest.raises(ValueError, match="parts must be among"):
        run_check("cpu", ("a", "z"), quick=True, out=None)


@pytest.mark.slow
def test_the_quick_check_on_a_cpu_imports_only_torch_transformers_and_peft(tmp_path):
    """The small version of the exactness part, in a fresh process: every row ok, the JSON
    written, and none of deepspeed, wandb, datasets, llama.cpp (or vllm) imported."""
    out = tmp_path / "gpu_check.json"
    probe = ("import runpy, sys; sys.argv = ['gpu_check.py', '--device', 'cpu', '--quick', '--parts', 'a', "
             f"'--out', {str(out)!r}]; code = 0\n"
             "try:\n    runpy.run_path('eval/gpu_check.py', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             f"print('IMPORTED', sorted({{m.split('.')[0] for m in sys.modules}} & set({list(FORBIDDEN_IMPORTS)!r})))\n"
             "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "IMPORTED []" in done.stdout
    written = json.loads(out.read_text())
    assert written["forbidden_imports"] == []
    assert written["rows"] and all(r["status"] == "ok" for r in written["rows"]), written["rows"]
    assert "| a | llama lossless + adapters compiled | ok |" in done.stdout
