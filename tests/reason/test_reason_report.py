"""Summaries of hand-built traces: accuracy and its interval, acceptance, speedup, plots, AUROC."""

from __future__ import annotations

import json
import math
import random

import pytest

from streamspec.reason.report import (
    auroc,
    calibration,
    group_traces,
    markdown,
    save_report,
    speedup,
    summarize,
    wilson_interval,
)
from streamspec.reason.trace import ReasonTrace, Step


def _trace(method, pid, total, correct=True, threshold=7.0, steps=(), tokens=None, passes=0, stop="answered",
           answer="1", phases=None):
    seconds = {"draft": 0.0, "judge": 0.0, "base": 0.0, "answer": 0.0, **(phases or {}), "total": total}
    return ReasonTrace(problem=f"problem {pid}", method=method, steps=list(steps), answer=answer, stop_reason=stop,
                       error="boom" if stop == "error" else None, tokens=tokens or {}, seconds=seconds,
                       draft_passes=passes, problem_id=pid, reference="1", correct=correct,
                       config={"threshold": threshold, "token_budget": 8192})


def _steps(scores_and_authors):
    return [Step(index=i, text=f"s{i}\n\n", author=a, score=s) for i, (s, a) in enumerate(scores_and_authors)]


@pytest.fixture
def traces():
    base = [_trace("base_only", f"p{i}", total=t, correct=c)
            for i, (t, c) in enumerate([(10.0, True), (20.0, True), (30.0, False), (40.0, True)])]
    spec7 = [
        _trace("specreason", "p0", 5.0, True, steps=_steps([(9, "drafter"), (2, "base")]),
               tokens={"draft_kept": 30, "draft_rejected": 10, "base": 10, "total": 60}, passes=20,
               phases={"draft": 2.0, "judge": 1.0, "base": 2.0}),
        _trace("specreason", "p1", 10.0, False, steps=_steps([(8, "drafter"), (7, "drafter"), (None, "base")]),
               tokens={"draft_kept": 50, "draft_rejected": 0, "base": 50, "total": 100}, passes=20),
        _trace("specreason", "p2", 15.0, True, steps=_steps([(1, "base")]),
               tokens={"draft_kept": 0, "draft_rejected": 20, "base": 20, "total": 40}, passes=10),
        # An error: counted, but left out of timings and speedups.
        _trace("specreason", "p3", 1.0, False, stop="error", answer=None),
    ]
    spec9 = [_trace("specreason", f"p{i}", 20.0, True, threshold=9.0, steps=_steps([(9, "drafter")]),
                    tokens={"draft_kept": 10, "base": 0, "total": 10}, passes=5) for i in range(2)]
    return base + spec7 + spec9


def test_groups_key_thresholds_only_for_judging_methods(traces):
    groups = group_traces(traces)
    assert list(groups) == ["base_only", "specreason@7", "specreason@9"]
    assert [len(g) for g in groups.values()] == [4, 4, 2]


def test_summary_numbers(traces):
    summary = summarize(traces)
    assert summary["baseline"] == "base_only"
    base, s7, s9 = (summary["methods"][k] for k in ("base_only", "specreason@7", "specreason@9"))
    assert base["threshold"] is None and s7["threshold"] == 7.0 and s9["threshold"] == 9.0

    assert base["n"] == 4 and base["accuracy"] == pytest.approx(0.75)
    assert s7["accuracy"] == pytest.approx(0.5)
    assert s7["answered"] == pytest.approx(0.75)
    assert s7["stop_reasons"] == {"answered": 3, "error": 1}
    assert s7["errors"] == 1 and s7["error_examples"] == ["boom"]
    # Judged steps: 9 kept, 2 rewritten, 8 kept, 7 kept, 1 rewritten (the unjudged step is not counted).
    assert s7["judged_steps"] == 5 and s7["accepted_steps"] == 3
    assert s7["acceptance_rate"] == pytest.approx(3 / 5)
    assert s7["drafter_token_share"] == pytest.approx(80 / 160)
    assert s7["draft_tokens_per_pass"] == pytest.approx((40 + 50 + 20) / 50)
    assert base["acceptance_rate"] is None and base["draft_tokens_per_pass"] is None
    # Timings over the three non-error traces.
    assert s7["seconds"]["total"] == pytest.approx(10.0)
    assert s7["seconds"]["draft"] == pytest.approx(2.0 / 3)
    assert s7["mean_tokens"] == pytest.approx((60 + 100 + 40 + 0) / 4)

    # Speedup on the problems both solved without error: p0, p1, p2.
    assert s7["speedup"]["paired"] == 3
    assert s7["speedup"]["total"] == pytest.approx((10 + 20 + 30) / (5 + 10 + 15))
    assert s7["speedup"]["geomean"] == pytest.approx(2.0)
    assert s9["speedup"]["paired"] == 2
    assert s9["speedup"]["total"] == pytest.approx(30 / 40)
    assert s9["speedup"]["geomean"] == pytest.approx(math.sqrt(0.5 * 1.0))
    assert base["speedup"]["total"] == pytest.approx(1.0)


def test_accuracy_interval_is_wilson(traces):
    s7 = summarize(traces)["methods"]["specreason@7"]
    lo, hi = s7["accuracy_ci95"]
    # Wilson interval for 2/4 at 95%: 0.5 -/+ 0.3496.
    assert lo == pytest.approx(0.1500, abs=1e-4) and hi == pytest.approx(0.8500, abs=1e-4)
    assert wilson_interval(0, 0) is None
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(81, 100)
    assert lo == pytest.approx(0.7222, abs=1e-4) and hi == pytest.approx(0.8749, abs=1e-4)


def test_speedup_pairs_the_same_problems():
    base = [_trace("base_only", "a", 10.0), _trace("base_only", "b", 100.0)]
    fast = [_trace("specreason", "a", 5.0), _trace("specreason", "c", 1.0)]
    assert speedup(fast, base) == {"paired": 1, "total": 2.0, "geomean": pytest.approx(2.0)}
    # Repeated runs of one problem are averaged first.
    fast.append(_trace("specreason", "a", 15.0))
    assert speedup(fast, base)["total"] == pytest.approx(1.0)
    # Without problem ids, the problem text pairs them.
    no_id = [ReasonTrace(problem="same text", method="m", seconds={"total": 4.0})]
    base_no_id = [ReasonTrace(problem="same text", method="base_only", seconds={"total": 8.0})]
    assert speedup(no_id, base_no_id)["total"] == pytest.approx(2.0)
    assert speedup(fast, [_trace("base_only", "zzz", 1.0)]) is None


def test_no_baseline():
    summary = summarize([_trace("drafter_only", "a", 1.0)])
    assert summary["baseline"] is None
    assert summary["methods"]["drafter_only"]["speedup"] is None
    assert "drafter_only" in markdown(summary)


def test_markdown_and_saved_files(traces, tmp_path):
    summary = summarize(traces)
    table = markdown(summary)
    assert "| specreason@7 | 4 | 50.0% (15.0–85.0)" in table
    assert "2.00×" in table and "60.0%" in table
    paths = save_report(summary, traces, tmp_path / "report")
    assert set(paths) == {"json", "markdown", "scores", "latency", "threshold"}
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(summary))
    assert paths["markdown"].read_text() == table
    for name in ("scores", "latency", "threshold"):
        data = paths[name].read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, name


def test_plots_without_judged_steps(tmp_path):
    traces = [_trace("base_only", "a", 1.0), _trace("drafter_only", "a", 0.5)]
    paths = save_report(summarize(traces), traces, tmp_path)
    assert set(paths) == {"json", "markdown", "latency"}


def _brute_force_auroc(pos, neg):
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auroc_against_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        pos = [rng.choice(range(10)) + rng.choice([0, 0.5]) for _ in range(rng.randint(1, 30))]
        neg = [rng.choice(range(8)) for _ in range(rng.randint(1, 30))]
        assert auroc(pos, neg) == pytest.approx(_brute_force_auroc(pos, neg))
    assert auroc([2, 3], [0, 1]) == 1.0
    assert auroc([0, 1], [2, 3]) == 0.0
    assert auroc([5, 5], [5]) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        auroc([], [1])


def test_calibration():
    scored = [(9, True), (8, True), (7, True), (3, True), (7, False), (2, False), (0, False), (None, True)]
    result = calibration(scored)
    assert (result["n"], result["good"], result["bad"]) == (7, 4, 3)
    assert result["auroc"] == pytest.approx(_brute_force_auroc([9, 8, 7, 3], [7, 2, 0]))
    by_t = {row["threshold"]: row for row in result["thresholds"]}
    assert list(by_t) == list(range(10))
    assert by_t[0] == {"threshold": 0, "good_accepted": 1.0, "bad_rejected": 0.0}
    assert by_t[7]["good_accepted"] == pytest.approx(3 / 4) and by_t[7]["bad_rejected"] == pytest.approx(2 / 3)
    assert by_t[9]["good_accepted"] == pytest.approx(1 / 4) and by_t[9]["bad_rejected"] == 1.0
    assert calibration([(5, True)])["auroc"] is None


def test_methods_named_with_their_threshold():
    """The evaluation names runs "specreason@7": kept as is, threshold read from the name."""
    base = [_trace("base_only", "a", 10.0, threshold=9.0)]
    runs = [_trace("specreason@7", "a", 5.0, threshold=7.0, steps=_steps([(8, "drafter")])),
            _trace("specreason@9", "a", 20.0, threshold=9.0, steps=_steps([(8, "base")])),
            _trace("specreason_plain@7", "a", 8.0, threshold=7.0, steps=_steps([(8, "drafter")]))]
    summary = summarize(base + runs)
    assert list(summary["methods"]) == ["base_only", "specreason@7", "specreason@9", "specreason_plain@7"]
    s7, s9 = summary["methods"]["specreason@7"], summary["methods"]["specreason@9"]
    assert (s7["method"], s7["threshold"]) == ("specreason", 7.0)
    assert (s9["method"], s9["threshold"]) == ("specreason", 9.0)
    assert summary["methods"]["specreason_plain@7"]["method"] == "specreason_plain"
    assert summary["methods"]["base_only"]["threshold"] is None
    assert s7["speedup"]["total"] == pytest.approx(2.0) and s9["speedup"]["total"] == pytest.approx(0.5)


def test_markdown_shows_calibration():
    cal = calibration([(9, True), (8, True), (3, False), (8, False)])
    summary = summarize([_trace("base_only", "a", 1.0)])
    summary["calibration"] = {"argmax": cal, "expected": cal, "steps": 4}
    table = markdown(summary)
    assert f"`argmax`: AUROC {cal['auroc']:.3f} over 2 good and 2 bad steps" in table
    assert "| 9 | 50.0% | 100.0% | 50.0% | 100.0% |" in table
    summary["calibration"] = cal
    assert "`judge`: AUROC" in markdown(summary)
