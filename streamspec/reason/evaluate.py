"""`streamspec reason-eval`: SpecReason against its baselines on the same problems and budget, and
the judge's calibration on CHAMP's first-wrong-step annotations.

Methods (each a `ReasonTrace.method` name):

- ``base_only``: the base writes every step;
- ``drafter_only``: the drafter writes every step, unjudged;
- ``specreason@T``: SpecReason at threshold T with the drafter decoded by speculative streaming;
- ``specreason_plain@T``: the same drafter without streams (one token per pass): what the streams
  add end to end.

Results go to ``traces.jsonl`` one trace per line as each finishes, so an interrupted run resumes
where it stopped (finished (method, problem) pairs are skipped; runs that ended in a backend error
are run again); then ``summary.json``,
``summary.md`` and the plots (`streamspec.reason.report`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Iterable

from .backends import Backend
from .config import ReasonConfig
from .grading import answers_match
from .reasoner import SpecReasoner
from .tasks import Problem
from .trace import ReasonTrace

logger = logging.getLogger(__name__)
TRACES_FILE = "traces.jsonl"
CALIBRATION_FILE = "calibration.jsonl"
THRESHOLD_GRID = tuple(range(10))  # the 0-9 score's thresholds, reported one by one


def method_names(thresholds: Iterable[float], drafter: bool, base: bool, plain: bool) -> list[str]:
    """The methods a run compares, baselines first."""
    names = []
    if base:
        names.append("base_only")
    if drafter:
        names.append("drafter_only")
    if drafter and base:
        for t in thresholds:
            names.append(f"specreason@{t:g}")
            if plain:
                names.append(f"specreason_plain@{t:g}")
    return names


def read_traces(path: Path) -> list[ReasonTrace]:
    """The traces of a (possibly interrupted) run; a torn last line is skipped with a warning."""
    traces = []
    if not path.is_file():
        return traces
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            traces.append(ReasonTrace.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError) as err:
            logger.warning("%s line %d is not a whole trace (%s); it will be run again", path, number, err)
    return traces


def _key(method: str, problem_id: str | None, problem: str) -> tuple[str, str]:
    return method, problem_id if problem_id is not None else problem


def evaluate(problems: list[Problem], config: ReasonConfig, out_dir: str | Path, *, base: Backend | None,
             drafter: Backend | None, plain_drafter: Backend | None = None, thresholds: Iterable[float] | None = None,
             methods: list[str] | None = None, progress: bool = True) -> list[ReasonTrace]:
    """Run every method on every problem (problem by problem, so an interrupted run holds whole
    comparisons) and append each trace to ``out_dir/traces.jsonl``; skip pairs already there.

    Args:
        problems: what to solve (`streamspec.reason.tasks.load_problems`).
        config: the settings shared by every method; ``seed`` (if set) + the problem's index seeds
            each problem, the same for every method.
        base, drafter: backends; `plain_drafter` is the drafter without streams (optional).
        thresholds: SpecReason thresholds (default: config.threshold).
        methods: a subset of `method_names` to run (default: all that the backends allow).
    Returns every trace of the run, earlier ones included.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    thresholds = list(thresholds) if thresholds else [config.threshold]
    available = method_names(thresholds, drafter is not None, base is not None, plain_drafter is not None)
    methods = methods or available
    unknown = [m for m in methods if m not in available]
    if unknown:
        raise ValueError(f"methods {unknown} cannot run with these backends; available: {available}")
    path = out / TRACES_FILE
    found = read_traces(path)
    # runs that ended in a backend error (a server that was down) are run again
    traces = [t for t in found if t.stop_reason != "error"]
    lines = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip()) if path.is_file() else 0
    if lines != len(traces):
        # keep the whole, error-free traces only, so new lines append cleanly
        if len(found) > len(traces):
            logger.info("running again %d runs that ended in an error", len(found) - len(traces))
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in traces), encoding="utf-8")
        tmp.replace(path)
    _check_settings(traces, config, path)
    done = {_key(t.method, t.problem_id, t.problem) for t in traces}
    todo = [(i, p, m) for i, p in enumerate(problems) for m in methods if _key(m, p.id, p.question) not in done]
    if len(todo) < len(problems) * len(methods):
        logger.info("resuming: %d of %d runs already in %s", len(problems) * len(methods) - len(todo),
                    len(problems) * len(methods), path)
    bar = tqdm(todo, desc="reason-eval", unit="run", disable=not progress)
    with path.open("a", encoding="utf-8") as handle:
        for index, problem, method in bar:
            bar.set_postfix_str(f"{method} {problem.id}")
            trace = run_method(method, problem, _seeded(config, index), base, drafter, plain_drafter)
            handle.write(json.dumps(trace.to_dict()) + "\n")
            handle.flush()
            traces.append(trace)
    return traces


# settings a trace may differ in from the run's: the seed is per problem, the threshold per method name
_PER_RUN = ("seed", "threshold")
# settings only judged methods depend on (base only and drafter only runs are reused across them)
_JUDGE_SETTINGS = ("judge_request", "score", "first_base_steps")


def _check_settings(traces: list[ReasonTrace], config: ReasonConfig, path: Path) -> None:
    """Refuse to resume from traces made with other settings (another judge request, budget,
    temperature, ...): their runs would be counted as this run's. Traces that record no
    settings (older files) are taken as they are."""
    wanted = {k: v for k, v in dataclasses.asdict(config).items() if k not in _PER_RUN}
    for trace in traces:
        if not trace.config:
            continue
        unjudged = trace.method.partition("@")[0] in ("base_only", "drafter_only")  # the judge's settings do not matter
        differs = {k: (trace.config.get(k), v) for k, v in wanted.items()
                   if k in trace.config and trace.config[k] != v and not (unjudged and k in _JUDGE_SETTINGS)}
        if differs:
            detail = ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in differs.items())
            raise ValueError(f"{path} holds runs made with other settings ({detail}); resume with the same settings, "
                             "or write to another --out")


def _seeded(config: ReasonConfig, index: int) -> ReasonConfig:
    return config if config.seed is None else dataclasses.replace(config, seed=config.seed + index)


def run_method(method: str, problem: Problem, config: ReasonConfig, base: Backend | None, drafter: Backend | None,
               plain_drafter: Backend | None = None) -> ReasonTrace:
    """One method on one problem, graded against the problem's answer."""
    name, _, threshold = method.partition("@")
    if threshold:
        config = dataclasses.replace(config, threshold=float(threshold))
    if name == "base_only":
        trace = SpecReasoner(None, base, config).base_only(problem.question)
    elif name == "drafter_only":
        trace = SpecReasoner(drafter, None, config).drafter_only(problem.question)
    elif name == "specreason":
        trace = SpecReasoner(drafter, base, config).solve(problem.question)
    elif name == "specreason_plain":
        trace = SpecReasoner(plain_drafter, base, config).solve(problem.question)
    else:
        raise ValueError(f"unknown method {method!r}")
    trace.method, trace.problem_id, trace.reference = method, problem.id, problem.answer
    trace.correct = answers_match(trace.answer, problem.answer, kind=problem.kind) if trace.answer is not None else False
    return trace


def calibrate(judge: Backend, solutions, out_dir: str | Path, max_steps: int = 12, progress: bool = True,
              requests: Iterable[str] = ("score_0_9",)) -> dict:
    """Score every step of CHAMP's annotated solutions with the judge, once per judge request
    (`streamspec.reason.judging.JUDGE_REQUESTS`; each step judged after the ones before it, as
    SpecReason would), and measure how well each reading of each request separates steps before
    the first wrong step (good) from the rest (`streamspec.reason.report.calibration`): AUROC
    plain and within position (pairs of steps at the same index: the plain figure is confounded,
    since a step is good until the first wrong one and position alone separates), and a fitted
    threshold in the reading's units. The step's position alone (earlier = better) is reported
    beside them, and ``best`` names the request and reading that separate best within position.
    Scores are appended to ``calibration.jsonl`` per solution and request, so the run resumes."""
    from tqdm.auto import tqdm

    from .judging import judge_request
    from .report import calibration

    requests = [judge_request(r) for r in requests]
    if not requests:
        raise ValueError("calibrate needs at least one judge request")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CALIBRATION_FILE
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
        if path.is_file() else []
    for row in rows:
        row.setdefault("request", "score_0_9")  # rows of runs before judge requests were a setting
    done = {(row["request"], row["key"]) for row in rows}
    solutions = list(solutions)
    with path.open("a", encoding="utf-8") as handle:
        for request in requests:
            bar = tqdm(solutions, desc=f"calibration ({request.name})", unit="solution", disable=not progress)
            for number, solution in enumerate(bar):
                key = f"{solution.problem_id}/{number}"
                if (request.name, key) in done:
                    continue
                judge.start(solution.question)
                for k, step in enumerate(solution.steps[:max_steps]):
                    verdict = judge.judge(step if step.endswith("\n\n") else step.rstrip("\n") + "\n\n", request)
                    good = solution.first_wrong_step is None or k < solution.first_wrong_step
                    row = {"key": key, "step": k, "good": good, "request": request.name,
                           **{how: verdict.score(how) for how in request.scores}}
                    handle.write(json.dumps(row) + "\n")
                    rows.append(row)
                handle.flush()
    wanted = {r.name for r in requests}
    rows = [row for row in rows if row["request"] in wanted]
    result: dict = {"requests": {}}
    for request in requests:
        mine = [row for row in rows if row["request"] == request.name]
        grid = None if request.name != "score_0_9" else THRESHOLD_GRID
        result["requests"][request.name] = {
            how: calibration([(row[how], row["good"], row["step"]) for row in mine], grid=grid) for how in request.scores}
    first = [row for row in rows if row["request"] == requests[0].name]
    result["position_only"] = calibration([(-row["step"], row["good"], row["step"]) for row in first], grid=None)
    candidates = [(cal["auroc_within_position"], name, how, cal) for name, readings in result["requests"].items()
                  for how, cal in readings.items() if cal["auroc_within_position"] is not None]
    if candidates:
        within, name, how, cal = max(candidates, key=lambda c: c[0])
        result["best"] = {"request": name, "score": how, "auroc_within_position": within, "auroc": cal["auroc"],
                          "threshold": (cal["fitted"] or {}).get("threshold")}
    result["steps"] = len(first)
    result["solutions"] = len({row["key"] for row in first})
    (out / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
