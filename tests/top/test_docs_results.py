"""docs/benchmarks.md's tables are the result files in docs/results: each marked table equals its
file's rendering, every file is shown, and the report command rewrites a page and draws its plots
(and names the file and the field when a result file is malformed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streamspec.evaluation.results import (
    MARKER,
    ResultError,
    check_tables,
    from_eval_summary,
    load_result,
    load_results,
    regenerate,
    render_table,
    rewrite_tables,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"


def test_every_table_of_the_benchmarks_page_matches_its_result_file():
    results = load_results(ROOT / "docs" / "results")
    text = PAGE.read_text()
    assert check_tables(text, results, "docs/benchmarks.md") == [], "run `python eval/report.py`"
    assert rewrite_tables(text, results) == text
    shown = {m.group("name") for m in MARKER.finditer(text)}
    assert shown == set(results), f"result files without a table: {set(results) - shown}"


def test_the_page_is_short_and_its_figures_exist():
    text = PAGE.read_text()
    assert len(text.splitlines()) <= 500
    for image in __import__("re").findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", text):
        assert (PAGE.parent / image).exists(), image


def test_a_changed_figure_makes_its_table_stale():
    results = load_results(ROOT / "docs" / "results")
    text = PAGE.read_text()
    changed = json.loads(json.dumps(results))
    changed["cpu_spider"]["rows"][2]["tokens_per_second"] = 99.99
    assert check_tables(text, changed) == ["cpu_spider"]
    assert "99.99" in rewrite_tables(text, changed)


def test_the_report_command_rewrites_the_tables_and_draws_the_plots(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    for path in (ROOT / "docs" / "results").glob("*.json"):
        shutil.copy(path, tmp_path / "docs" / "results")
    emptied = MARKER.sub(lambda m: m.group(1) + m.group(4), PAGE.read_text())
    (tmp_path / "docs" / "benchmarks.md").write_text(emptied)
    check = subprocess.run([sys.executable, str(ROOT / "eval" / "report.py"), "--root", str(tmp_path), "--check"],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 1 and "cpu_spider" in check.stdout
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "report.py"), "--root", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "docs" / "benchmarks.md").read_text() == PAGE.read_text()
    figures = {p.name for p in (tmp_path / "docs" / "figures").glob("*.png")}
    for task in ("spider_cpu", "aclsum_cpu", "spider_gpu"):
        assert {f"{task}_tokens_per_second.png", f"{task}_crr_vs_pass_cost.png"} <= figures


def test_a_malformed_result_file_is_named_with_its_missing_field(tmp_path):
    good = json.loads((ROOT / "docs" / "results" / "gpu_h200_first.json").read_text())
    del good["machine"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(good))
    with pytest.raises(ResultError, match=r"broken\.json: missing field 'machine'"):
        load_result(path)
    path.write_text("{not json")
    with pytest.raises(ResultError, match=r"broken\.json: not JSON"):
        load_result(path)
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "cpu_spider.json").write_text(json.dumps({"title": "x"}))
    (tmp_path / "docs" / "benchmarks.md").write_text("<!-- table: cpu_spider -->\n<!-- /table -->\n")
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "report.py"), "--root", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "cpu_spider.json: missing field 'command'" in run.stderr


def test_a_table_without_a_result_file_is_an_error():
    with pytest.raises(ResultError, match="no result file nowhere.json"):
        rewrite_tables("<!-- table: nowhere -->\n<!-- /table -->\n", {})


def test_rows_from_what_streamspec_eval_writes():
    benchmark = {"methods": {"baseline": {"tokens_per_second": 20.0, "speedup": 1.0, "crr": 1.0},
                             "chain": {"tokens_per_second": 30.0, "speedup": 1.5, "crr": 1.9, "ms_per_pass": 40.0,
                                       "identical_to_autoregressive": True}}}
    rows = from_eval_summary(benchmark, labels={"baseline": "transformers generate"})
    assert rows[0]["method"] == "transformers generate" and rows[1]["identical"] is True
    result = dict(load_result(ROOT / "docs" / "results" / "cpu_spider.json"), rows=rows)
    assert "| chain | 30.00 | 1.50× | 1.90 | 40.0 | yes |" in render_table(result)
    with pytest.raises(ResultError, match="'chain' is missing field 'tokens_per_second'"):
        from_eval_summary({"chain": {"crr": 2.0}})


def test_regenerate_in_check_mode_writes_nothing(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "results" / "demo.json", tmp_path / "docs" / "results")
    page = tmp_path / "docs" / "benchmarks.md"
    page.write_text("<!-- table: demo -->\nold\n<!-- /table -->\n")
    assert regenerate(tmp_path, check=True) == ["demo"]
    assert "old" in page.read_text()
