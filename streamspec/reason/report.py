"""What a set of SpecReason traces says: accuracy, speed, acceptance (`summarize`), as a table
(`markdown`) and as files and plots (`save_report`); and how well the judge's score separates good
steps from bad ones (`auroc`, `calibration`).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

from streamspec.reason.trace import PHASES, ReasonTrace

_Z95 = 1.959963984540054
THRESHOLDS = tuple(range(10))


def wilson_interval(successes: int, n: int, z: float = _Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion (95% by default); None when n is 0."""
    if n == 0:
        return None
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def _threshold(trace: ReasonTrace) -> float | None:
    config = trace.config or {}
    value = config.get("threshold", (config.get("reason") or {}).get("threshold"))
    return None if value is None else float(value)


def method_key(method: str, threshold: float | None) -> str:
    """``"specreason@7"`` for a method run at a threshold, else the method's name."""
    return method if threshold is None or "@" in method else f"{method}@{threshold:g}"


def _split_method(method: str) -> tuple[str, float | None]:
    """A method name that carries its threshold (``"specreason@7"``) -> (``"specreason"``, 7.0)."""
    name, _, threshold = method.partition("@")
    try:
        return name, float(threshold) if threshold else None
    except ValueError:
        return method, None


def group_traces(traces: Iterable[ReasonTrace]) -> dict[str, list[ReasonTrace]]:
    """Traces by `method_key`, in order of first appearance.

    A method named with its threshold (``"specreason@7"``, as the evaluation names them) keeps
    its name. Otherwise: every trace records the whole configuration, threshold included, but a
    threshold only means something to a method that judges steps, so a method is keyed by the
    configured threshold when any of its traces holds a judged step (``base_only`` and
    ``drafter_only`` keep their plain names).
    """
    return {key: group for key, (_, group) in _groups(traces).items()}


def _groups(traces: Iterable[ReasonTrace]) -> dict[str, tuple[float | None, list[ReasonTrace]]]:
    traces = list(traces)
    judged = {t.method for t in traces if t.drafted_steps}
    groups: dict[str, tuple[float | None, list[ReasonTrace]]] = {}
    for t in traces:
        named = _split_method(t.method)[1]
        threshold = named if named is not None else _threshold(t) if t.method in judged else None
        groups.setdefault(method_key(t.method, threshold), (threshold, []))[1].append(t)
    return groups


def _problem_key(trace: ReasonTrace) -> str:
    return trace.problem_id if trace.problem_id is not None else trace.problem


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _seconds_by_problem(traces: list[ReasonTrace]) -> dict[str, float]:
    """Mean end-to-end seconds per problem, over traces that did not end in an error."""
    per: dict[str, list[float]] = defaultdict(list)
    for t in traces:
        if t.stop_reason != "error" and "total" in t.seconds:
            per[_problem_key(t)].append(float(t.seconds["total"]))
    return {k: sum(v) / len(v) for k, v in per.items()}


def speedup(traces: list[ReasonTrace], baseline: list[ReasonTrace]) -> dict[str, Any] | None:
    """End-to-end speedup of `traces` over `baseline` on the problems both solved without error.

    ``total``: the baseline's summed seconds over the method's (the time a user waits for the
    whole set); ``geomean``: the geometric mean of the per-problem ratios; ``paired``: how many
    problems were paired (by problem_id, else by problem text). None when none pair.
    """
    mine, theirs = _seconds_by_problem(traces), _seconds_by_problem(baseline)
    common = [k for k in mine if k in theirs]
    if not common:
        return None
    total_mine = sum(mine[k] for k in common)
    total_theirs = sum(theirs[k] for k in common)
    logs = [math.log(theirs[k] / mine[k]) for k in common if mine[k] > 0 and theirs[k] > 0]
    return {
        "paired": len(common),
        "total": total_theirs / total_mine if total_mine > 0 else None,
        "geomean": math.exp(sum(logs) / len(logs)) if logs else None,
    }


def _summarize_group(traces: list[ReasonTrace], threshold: float | None) -> dict[str, Any]:
    n = len(traces)
    graded = [t for t in traces if t.correct is not None]
    correct = sum(bool(t.correct) for t in graded)
    interval = wilson_interval(correct, len(graded))
    judged = [s for t in traces for s in t.drafted_steps]
    accepted = sum(s.author == "drafter" for s in judged)
    draft_kept = sum(t.tokens.get("draft_kept", 0) for t in traces)
    kept = draft_kept + sum(t.tokens.get("base", 0) for t in traces)
    drafted = sum(t.tokens.get("draft_kept", 0) + t.tokens.get("draft_rejected", 0) for t in traces if t.draft_passes)
    passes = sum(t.draft_passes for t in traces)
    timed = [t for t in traces if t.stop_reason != "error"]
    token_kinds = sorted({k for t in traces for k in t.tokens})
    errors = [t for t in traces if t.stop_reason == "error" or t.error]
    return {
        "method": _split_method(traces[0].method)[0],
        "threshold": threshold,
        "n": n,
        "problems": len({_problem_key(t) for t in traces}),
        "graded": len(graded),
        "correct": correct,
        "accuracy": correct / len(graded) if graded else None,
        "accuracy_ci95": list(interval) if interval else None,
        "answered": sum(t.answer is not None for t in traces) / n,
        "stop_reasons": dict(Counter(t.stop_reason for t in traces)),
        "judged_steps": len(judged),
        "accepted_steps": accepted,
        "acceptance_rate": accepted / len(judged) if judged else None,
        "drafter_token_share": draft_kept / kept if kept else None,
        "draft_tokens_per_pass": drafted / passes if passes else None,
        "seconds": {phase: _mean([float(t.seconds.get(phase, 0.0)) for t in timed]) for phase in (*PHASES, "total")},
        "tokens": {kind: _mean([float(t.tokens.get(kind, 0)) for t in traces]) for kind in token_kinds},
        "mean_tokens": _mean([float(t.tokens.get("total", 0)) for t in traces]),
        "errors": len(errors),
        "error_examples": sorted({str(t.error) for t in errors if t.error})[:3],
    }


def summarize(traces: list[ReasonTrace], baseline_method: str = "base_only") -> dict[str, Any]:
    """Per method (and threshold, see `group_traces`): accuracy and speed of a set of traces.

    Each entry: ``n``; ``accuracy`` (share of ``correct`` among graded traces) with its 95%
    Wilson interval ``accuracy_ci95``; ``answered`` (share with an extracted answer);
    ``stop_reasons`` counted; ``acceptance_rate`` (judged steps kept / judged steps, pooled over
    traces); ``drafter_token_share`` (kept reasoning tokens written by the drafter, pooled);
    ``draft_tokens_per_pass`` (drafter tokens per forward pass inside drafted steps, pooled);
    ``seconds`` (mean per phase and ``total``, over traces not ended by an error);
    ``mean_tokens`` (generated tokens) and ``tokens`` (mean per kind); ``errors``; and
    ``speedup`` over the baseline (`speedup`: summed-seconds ratio and per-problem geometric mean
    over the same problems) or None when there is no baseline or no common problem.

    The baseline is the group keyed `baseline_method`, else every trace of that method.
    """
    groups = _groups(traces)
    if baseline_method in groups:
        baseline = groups[baseline_method][1]
    else:
        baseline = [t for t in traces if t.method == baseline_method]
    methods = {}
    for key, (threshold, group) in groups.items():
        entry = _summarize_group(group, threshold)
        entry["speedup"] = speedup(group, baseline) if baseline else None
        methods[key] = entry
    return {"baseline": baseline_method if baseline else None, "methods": methods}


def _fmt(value: Any, digits: int = 2, percent: bool = False) -> str:
    if value is None:
        return "–"
    if percent:
        return f"{100 * value:.1f}%"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown: a main table, then stop reasons and mean seconds per phase (left
    out when no method ran, as with ``--calibrate-only``), then any judge calibration."""
    if not summary.get("methods"):
        return "\n".join(_calibration_lines(summary["calibration"]) if summary.get("calibration") else
                         ["No method ran."]) + "\n"
    head = ["method", "n", "accuracy (95% CI)", "answered", "speedup (total)", "speedup (geomean)",
            "mean s", "mean tokens", "acceptance", "drafter share", "draft tok/pass", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, e in summary["methods"].items():
        ci = e["accuracy_ci95"]
        accuracy = _fmt(e["accuracy"], percent=True)
        if ci:
            accuracy += f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})"
        sp = e.get("speedup") or {}
        cells = [key, str(e["n"]), accuracy, _fmt(e["answered"], percent=True),
                 _fmt(sp.get("total")) + ("×" if sp.get("total") else ""),
                 _fmt(sp.get("geomean")) + ("×" if sp.get("geomean") else ""),
                 _fmt(e["seconds"]["total"], 1), _fmt(e["mean_tokens"], 0),
                 _fmt(e["acceptance_rate"], percent=True), _fmt(e["drafter_token_share"], percent=True),
                 _fmt(e["draft_tokens_per_pass"]), str(e["errors"])]
        lines.append("| " + " | ".join(cells) + " |")
    if summary.get("baseline"):
        lines.append(f"\nSpeedups are over `{summary['baseline']}` on the same problems (errors left out).")
    lines += ["", "| method | " + " | ".join(f"{p} s" for p in PHASES) + " | stop reasons |",
              "|" + "---|" * (len(PHASES) + 2)]
    for key, e in summary["methods"].items():
        stops = ", ".join(f"{k} {v}" for k, v in sorted(e["stop_reasons"].items()))
        lines.append(f"| {key} | " + " | ".join(_fmt(e["seconds"][p], 1) for p in PHASES) + f" | {stops} |")
    if summary.get("calibration"):
        lines += ["", *_calibration_lines(summary["calibration"])]
    return "\n".join(lines) + "\n"


def _calibration_lines(result: dict[str, Any]) -> list[str]:
    """A `calibration` result, a dict of them by score type, or `streamspec.reason.evaluate.calibrate`'s
    comparison of judge requests, as Markdown."""
    if "requests" in result:
        return _request_lines(result)
    named = {"judge": result} if "thresholds" in result else {
        name: value for name, value in result.items() if isinstance(value, dict) and "thresholds" in value}
    lines = ["Judge calibration (good: steps before the first wrong step):", ""]
    for name, cal in named.items():
        lines.append(f"- `{name}`: AUROC {_fmt(cal['auroc'], 3)} over {cal['good']} good and {cal['bad']} bad steps")
    return lines + _grid_lines(named)


def _grid_lines(named: dict[str, dict]) -> list[str]:
    named = {k: v for k, v in named.items() if v.get("thresholds")}
    if not named:
        return []
    lines = ["", "| threshold | " + " | ".join(
        f"{name} good kept | {name} bad rejected" for name in named) + " |", "|" + "---|" * (1 + 2 * len(named))]
    for t in THRESHOLDS:
        cells = []
        for cal in named.values():
            row = next((r for r in cal["thresholds"] if r["threshold"] == t), {})
            cells += [_fmt(row.get("good_accepted"), percent=True), _fmt(row.get("bad_rejected"), percent=True)]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def _request_lines(result: dict[str, Any]) -> list[str]:
    """One row per judge request and reading: AUROC plain and within position, the fitted cut-off."""
    lines = [f"Judge calibration on {result.get('solutions')} annotated solutions ({result.get('steps')} steps; good: "
             "before the first wrong step). Within position: pairs of steps at the same index only.", "",
             "| request | reading | AUROC | AUROC within position | fitted threshold | good kept | bad rejected |",
             "|---|---|---|---|---|---|---|"]
    rows = [(req, how, cal) for req, readings in result["requests"].items() for how, cal in readings.items()]
    if result.get("position_only"):
        rows.append(("(the step's position alone)", "earlier = better", result["position_only"]))
    for req, how, cal in rows:
        fit = cal.get("fitted") or {}
        lines.append(f"| {req} | {how} | {_fmt(cal.get('auroc'), 3)} | {_fmt(cal.get('auroc_within_position'), 3)} | "
                     f"{_fmt(fit.get('threshold'), 3)} | {_fmt(fit.get('good_accepted'), percent=True)} | "
                     f"{_fmt(fit.get('bad_rejected'), percent=True)} |")
    best = result.get("best")
    if best:
        lines += ["", f"Best within position: `{best['request']}` read as `{best['score']}` "
                      f"(AUROC within position {_fmt(best['auroc_within_position'], 3)}, fitted threshold "
                      f"{_fmt(best['threshold'], 3)})."]
    digits = result["requests"].get("score_0_9")
    return lines + (_grid_lines(digits) if digits else [])


def save_report(summary: dict[str, Any], traces: list[ReasonTrace], out_dir: str | Path) -> dict[str, Path]:
    """summary.json, summary.md and PNG plots in `out_dir`; returns the paths by name.

    Plots: ``scores`` (the judge's scores of kept vs rewritten drafts; when anything was judged),
    ``latency`` (mean seconds per phase stacked, per method) and ``threshold`` (accuracy and
    speedup against the threshold, per method run at thresholds; when there is one).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "summary.json", "markdown": out / "summary.md"}
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["markdown"].write_text(markdown(summary))

    judged = [s for t in traces for s in t.drafted_steps]
    if judged:
        fig, ax = plt.subplots(figsize=(6, 4))
        bins = [b - 0.5 for b in range(11)]
        kept = [s.score for s in judged if s.author == "drafter"]
        rewritten = [s.score for s in judged if s.author != "drafter"]
        ax.hist([kept, rewritten], bins=bins, label=[f"accepted ({len(kept)})", f"rejected ({len(rewritten)})"],
                color=["tab:green", "tab:red"], stacked=True)
        ax.set_xticks(range(10))
        ax.set_xlabel("judge score")
        ax.set_ylabel("drafted steps")
        ax.legend()
        fig.tight_layout()
        paths["scores"] = out / "judge_scores.png"
        fig.savefig(paths["scores"], dpi=120)
        plt.close(fig)

    methods = summary["methods"]
    if methods:
        fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(methods)), 4))
        names = list(methods)
        bottom = [0.0] * len(names)
        for phase in PHASES:
            heights = [methods[k]["seconds"][phase] or 0.0 for k in names]
            ax.bar(names, heights, bottom=bottom, label=phase)
            bottom = [b + h for b, h in zip(bottom, heights)]
        # Whatever the phases do not account for (prompt building, tokenising, bookkeeping).
        other = [max(0.0, (methods[k]["seconds"]["total"] or 0.0) - b) for k, b in zip(names, bottom)]
        if any(other):
            ax.bar(names, other, bottom=bottom, label="other", color="lightgray")
        ax.set_ylabel("mean seconds per problem")
        ax.set_title("latency by phase")
        ax.tick_params(axis="x", labelrotation=30)
        ax.legend()
        fig.tight_layout()
        paths["latency"] = out / "latency.png"
        fig.savefig(paths["latency"], dpi=120)
        plt.close(fig)

    by_method: dict[str, list[dict]] = defaultdict(list)
    for e in methods.values():
        if e["threshold"] is not None:
            by_method[e["method"]].append(e)
    if by_method:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for method, entries in by_method.items():
            entries.sort(key=lambda e: e["threshold"])
            xs = [e["threshold"] for e in entries]
            acc = [e["accuracy"] if e["accuracy"] is not None else math.nan for e in entries]
            err = [[a - e["accuracy_ci95"][0] if e["accuracy_ci95"] else 0 for a, e in zip(acc, entries)],
                   [e["accuracy_ci95"][1] - a if e["accuracy_ci95"] else 0 for a, e in zip(acc, entries)]]
            axes[0].errorbar(xs, acc, yerr=err, marker="o", capsize=3, label=method)
            sp = [(e["speedup"] or {}).get("total") or math.nan for e in entries]
            axes[1].plot(xs, sp, marker="o", label=method)
        ticks = sorted({e["threshold"] for entries in by_method.values() for e in entries})
        for ax, title in zip(axes, ("accuracy (95% CI)", f"speedup over {summary.get('baseline') or '–'}")):
            ax.set_xticks(ticks)
            ax.set_xlabel("threshold")
            ax.set_title(title)
            ax.legend()
        fig.tight_layout()
        paths["threshold"] = out / "threshold.png"
        fig.savefig(paths["threshold"], dpi=120)
        plt.close(fig)
    return paths


def auroc(positive_scores: Iterable[float], negative_scores: Iterable[float]) -> float:
    """Area under the ROC curve: the chance a positive scores above a negative, ties counted half
    (the Mann–Whitney U statistic over n_pos·n_neg)."""
    pos, neg = list(positive_scores), list(negative_scores)
    if not pos or not neg:
        raise ValueError(f"auroc needs both classes, got {len(pos)} positive and {len(neg)} negative scores")
    # Mid-ranks over the pooled, sorted scores: O(n log n), ties share their average rank.
    pooled = sorted([(s, True) for s in pos] + [(s, False) for s in neg], key=lambda x: x[0])
    rank_sum, i = 0.0, 0
    while i < len(pooled):
        j = i
        while j < len(pooled) and pooled[j][0] == pooled[i][0]:
            j += 1
        mid = (i + 1 + j) / 2  # ranks i+1..j share their mean
        rank_sum += mid * sum(1 for _, is_pos in pooled[i:j] if is_pos)
        i = j
    u = rank_sum - len(pos) * (len(pos) + 1) / 2
    return u / (len(pos) * len(neg))


def auroc_within_position(scored: Iterable[tuple[float, bool, int]]) -> tuple[float | None, int]:
    """AUROC over pairs of a good and a bad step at the same position (step index) only, and the
    number of such pairs: what is left of the separation once "earlier steps are more often
    good" (which position alone scores) is taken out. (None, 0) without such pairs."""
    by_position: dict[int, tuple[list[float], list[float]]] = {}
    for score, good, position in scored:
        by_position.setdefault(int(position), ([], []))[0 if good else 1].append(float(score))
    wins, pairs = 0.0, 0
    for good, bad in by_position.values():
        if good and bad:
            wins += auroc(good, bad) * len(good) * len(bad)
            pairs += len(good) * len(bad)
    return (wins / pairs if pairs else None), pairs


def fitted_threshold(good: list[float], bad: list[float]) -> dict[str, Any] | None:
    """The cut-off (a step is kept when its score >= it) with the best balanced accuracy, the
    mean of the share of good steps kept and of bad steps rejected; ties go to the lower cut-off
    (more drafts kept). Chosen among the scores seen. None without both classes."""
    if not good or not bad:
        return None
    best = None
    for t in sorted(set(good) | set(bad)):
        kept = sum(s >= t for s in good) / len(good)
        rejected = sum(s < t for s in bad) / len(bad)
        if best is None or (kept + rejected) / 2 > best["balanced_accuracy"] + 1e-12:
            best = {"threshold": t, "good_accepted": kept, "bad_rejected": rejected,
                    "balanced_accuracy": (kept + rejected) / 2}
    return best


def calibration(scored: list[tuple], grid: Iterable[float] | None = THRESHOLDS) -> dict[str, Any]:
    """How well judge scores separate good steps (True: before the first wrong step) from bad.

    `scored` holds (score, good) or (score, good, position) tuples. Returns ``n``, ``good``,
    ``bad``, ``auroc`` (None when a class is empty), ``auroc_within_position`` and
    ``position_pairs`` (with positions; see `auroc_within_position`), ``fitted``
    (`fitted_threshold`) and ``thresholds``: for each threshold of `grid` (default 0..9, the
    0-9 score's; None: none), the share of good steps accepted (score >= threshold) and of bad
    steps rejected. Entries whose score is None are left out.
    """
    rows = [(float(r[0]), bool(r[1]), r[2] if len(r) > 2 else None) for r in scored if r[0] is not None]
    good = [s for s, g, _ in rows if g]
    bad = [s for s, g, _ in rows if not g]
    within, pairs = (None, 0)
    if rows and all(k is not None for _, _, k in rows):
        within, pairs = auroc_within_position(rows)
    return {
        "n": len(rows),
        "good": len(good),
        "bad": len(bad),
        "auroc": auroc(good, bad) if good and bad else None,
        "auroc_within_position": within,
        "position_pairs": pairs,
        "fitted": fitted_threshold(good, bad),
        "thresholds": [
            {
                "threshold": t,
                "good_accepted": sum(s >= t for s in good) / len(good) if good else None,
                "bad_rejected": sum(s < t for s in bad) / len(bad) if bad else None,
            }
            for t in (grid or ())
        ],
    }
