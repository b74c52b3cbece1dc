"""SpecReason: a fast drafter writes each reasoning step, the base only judges it (one pass) and
rewrites it when the score is low (METHOD §2), with the public code's defects mended:

- the budget counts every generated token (kept drafts, rejected drafts, rewrites, the answer)
  and caps each call by what is left, so it is never overshot;
- the answer is the last complete ``\\boxed{}`` (or the task's format), never a substring test;
  when the reasoning stops without one, an explicit answer phase asks for it;
- two identical steps in a row stop with ``repetition``, not ``answered``;
- every backend keeps its conversation between calls (local ones their KV cache: a kept step
  keeps the entries its judgement wrote) and tokenises only new text;
- a backend error ends the problem with stop reason ``error`` in the trace instead of the run.

`SpecReasoner.solve` runs SpecReason; `base_only` and `drafter_only` run the baselines with the
same prompts, budget, step loop and answer extraction.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Callable

from .backends import Backend, LocalBackend, Sampling, TextStop
from .config import ReasonConfig
from .grading import extract_answer, extract_boxed
from .judging import in_process_refusal, judge_request
from .prompts import ANSWER_CUE
from .trace import ReasonTrace, Step

METHODS = ("specreason", "base_only", "drafter_only")


class SpecReasoner:
    """Speculative reasoning with a drafter, a base and a judge (default: the base).

    Args:
        drafter: the backend that drafts steps (a streamed model for token-level speculation
            inside each step); may be None for `base_only` runs.
        base: the backend that judges (unless `judge` is given) and rewrites rejected steps, and
            writes the answer phase.
        config: the algorithm's settings (`ReasonConfig`).
        judge: a separate judging backend (default: the base, which then keeps the KV cache of
            the judged step when it is accepted).
        on_step: called with each step as it is decided (the command line prints it).
    """

    def __init__(self, drafter: Backend | None, base: Backend | None, config: ReasonConfig | None = None,
                 judge: Backend | None = None, on_step: Callable[[Step], None] | None = None) -> None:
        if drafter is None and base is None:
            raise ValueError("SpecReasoner needs a drafter, a base, or both")
        self.drafter, self.base = drafter, base
        self.judge = judge if judge is not None else base
        self.on_step = on_step
        self.config = config or ReasonConfig()
        if not isinstance(self.config, ReasonConfig):
            raise TypeError(f"config must be a ReasonConfig, got {type(self.config).__name__}")
        if isinstance(self.judge, LocalBackend) and judge_request(self.config.judge_request).preamble:
            raise in_process_refusal(self.config.judge_request)

    # -- public runners -------------------------------------------------------------------------
    def solve(self, problem: str) -> ReasonTrace:
        """SpecReason on one problem."""
        if self.drafter is None or self.base is None:
            raise ValueError("SpecReason needs both a drafter and a base")
        return self._run(problem, "specreason")

    def base_only(self, problem: str) -> ReasonTrace:
        """The base writes every step (the baseline SpecReason must beat on speed)."""
        if self.base is None:
            raise ValueError("base_only needs a base")
        return self._run(problem, "base_only")

    def drafter_only(self, problem: str) -> ReasonTrace:
        """The drafter writes every step, unjudged (the accuracy floor)."""
        if self.drafter is None:
            raise ValueError("drafter_only needs a drafter")
        return self._run(problem, "drafter_only")

    def run(self, problem: str, method: str) -> ReasonTrace:
        """One of `METHODS` by name."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
        return {"specreason": self.solve, "base_only": self.base_only, "drafter_only": self.drafter_only}[method](problem)

    # -- the loop -------------------------------------------------------------------------------
    def _judge(self, step: str):
        """The judge's verdict on `step` for the configured request. A backend written for the
        paper's 0-9 score alone (``judge(step)``, no request) keeps working with that request and
        is refused, by name, with any other."""
        request = self.config.judge_request
        takes = _takes_request(self.judge.judge)
        if takes == "keyword":
            return self.judge.judge(step, request=request)
        if takes == "positional":
            return self.judge.judge(step, request)
        if request != "score_0_9":
            raise TypeError(f"{type(self.judge).__name__}.judge(step) takes no judge request, so it can only give "
                            f"the 0-9 score (judge_request='score_0_9'), not {request!r}; add a `request` argument")
        return self.judge.judge(step)

    def _roles(self, method: str) -> list[Backend]:
        if method == "base_only":
            return [self.base]
        if method == "drafter_only":
            return [self.drafter]
        return list(dict.fromkeys([self.drafter, self.base, self.judge]))  # distinct, in order

    def _run(self, problem: str, method: str) -> ReasonTrace:
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError("the problem is empty")
        cfg = self.config
        trace = ReasonTrace(problem=problem, method=method, config=dataclasses.asdict(cfg))
        trace.tokens = {"draft_kept": 0, "draft_rejected": 0, "base": 0, "answer": 0, "total": 0, "judge": 0}
        trace.seconds = {"draft": 0.0, "judge": 0.0, "base": 0.0, "answer": 0.0, "total": 0.0}
        started = time.perf_counter()
        writer = self.drafter if method == "drafter_only" else self.base
        try:
            roles = self._roles(method)
            for role in roles:
                role.start(problem)
            trace.stop_reason = self._reason(trace, method, roles)
            if self._answer(trace.text) is None:
                self._answer_phase(trace, writer)
            trace.answer = self._answer(trace.text)
        except ValueError:
            raise
        except Exception as err:  # a backend failed: record it, the evaluation goes on
            trace.stop_reason = "error"
            trace.error = f"{type(err).__name__}: {err}"
        trace.tokens["total"] = sum(trace.tokens[k] for k in ("draft_kept", "draft_rejected", "base", "answer"))
        trace.seconds["total"] = time.perf_counter() - started
        return trace

    def _answer(self, text: str) -> str | None:
        return extract_answer(text, self.config.answer_format)

    def _step_answers(self, text: str) -> bool:
        """A kept step holds the answer: a complete boxed one (or the task's own marker)."""
        if self.config.answer_format == "number":
            return extract_boxed(text) is not None
        return extract_answer(text, self.config.answer_format) is not None

    def _reason(self, trace: ReasonTrace, method: str, roles: list[Backend]) -> str:
        """The step loop; returns the stop reason."""
        cfg = self.config
        sampling = Sampling(cfg.temperature, cfg.top_p, cfg.seed)
        stop = TextStop(delimiter=cfg.step_delimiter)
        while True:
            left = cfg.reasoning_budget - _spent(trace)
            if left <= 0:
                return "budget"
            cap = min(cfg.step_max_tokens, left)
            index = len(trace.steps)
            if method == "drafter_only":
                step, ended = self._write(trace, self.drafter, "drafter", roles, cap, sampling, stop)
            elif method == "base_only" or index < cfg.first_base_steps:
                step, ended = self._write(trace, self.base, "base", roles, cap, sampling, stop)
            else:
                step, ended = self._speculate(trace, roles, cap, sampling, stop)
                if step is None:
                    return "budget"
            trace.steps.append(step)
            if self.on_step is not None:
                self.on_step(step)
            if self._step_answers(step.text):
                return "answered"
            if len(trace.steps) >= 2 and step.text.strip() == trace.steps[-2].text.strip():
                return "repetition"
            if ended:
                return "answered"  # the writer ended its turn; the answer phase reads the answer if unboxed

    def _write(self, trace, backend, author, roles, cap, sampling, stop) -> tuple[Step, bool]:
        """`backend` writes the next step unjudged; the other roles read it."""
        gen = backend.generate(cap, sampling, stop)
        for role in roles:
            if role is not backend:
                role.append(gen.text)
        key = "draft_kept" if author == "drafter" else "base"
        phase = "draft" if author == "drafter" else "base"
        trace.tokens[key] += gen.tokens
        trace.seconds[phase] += gen.seconds
        passes = gen.passes or 0
        if author == "drafter":
            trace.draft_passes += passes
        step = Step(index=len(trace.steps), text=gen.text, author=author, seconds={phase: gen.seconds},
                    draft_tokens=gen.tokens if author == "drafter" else 0, base_tokens=gen.tokens if author == "base" else 0,
                    draft_passes=passes if author == "drafter" else 0)
        return step, gen.ended

    def _speculate(self, trace, roles, cap, sampling, stop) -> tuple[Step | None, bool]:
        """Draft a step, judge it, keep it or have the base rewrite it."""
        cfg = self.config
        marks = {id(role): role.mark() for role in roles}
        draft = self.drafter.generate(cap, sampling, stop)
        trace.seconds["draft"] += draft.seconds
        trace.draft_passes += draft.passes or 0
        verdict = self._judge(draft.text)
        trace.seconds["judge"] += verdict.seconds
        trace.tokens["judge"] += verdict.tokens_read
        score = verdict.score(cfg.score)
        step = Step(index=len(trace.steps), text=draft.text, author="drafter", score=score,
                    digit_probs=verdict.digit_probs or None, answer_probs=verdict.answer_probs, draft_tokens=draft.tokens, judge_tokens=verdict.tokens_read,
                    draft_passes=draft.passes or 0, seconds={"draft": draft.seconds, "judge": verdict.seconds})
        if score >= cfg.threshold:
            trace.tokens["draft_kept"] += draft.tokens
            for role in roles:
                if role is not self.drafter and role is not self.judge:
                    role.append(draft.text)
            return step, draft.ended
        trace.tokens["draft_rejected"] += draft.tokens
        for role in roles:  # the draft (and the judge's copy of it) leave every conversation
            role.rollback(marks[id(role)])
        left = min(cfg.step_max_tokens, cfg.reasoning_budget - _spent(trace))
        if left <= 0:
            return None, False  # the rejected draft spent what the budget had left
        rewrite = self.base.generate(left, sampling, stop)
        for role in roles:
            if role is not self.base:
                role.append(rewrite.text)
        trace.tokens["base"] += rewrite.tokens
        trace.seconds["base"] += rewrite.seconds
        step.author, step.drafted_text, step.text = "base", draft.text, rewrite.text
        step.base_tokens = rewrite.tokens
        step.seconds["base"] = rewrite.seconds
        return step, rewrite.ended

    def _answer_phase(self, trace: ReasonTrace, writer: Backend) -> None:
        """Ask for the boxed answer after the reasoning, within the tokens kept back for it."""
        cue = ANSWER_CUE if not trace.text.endswith("\n") else ANSWER_CUE.lstrip("\n")
        writer.append(cue)
        gen = writer.generate(self.config.answer_max_tokens, Sampling(0.0, 1.0, None), TextStop(boxed=True))
        trace.answer_text = cue + gen.text
        trace.tokens["answer"] += gen.tokens
        trace.seconds["answer"] += gen.seconds


def _spent(trace: ReasonTrace) -> int:
    """Tokens the reasoning has generated so far (kept and rejected drafts, the base's steps)."""
    return trace.tokens["draft_kept"] + trace.tokens["draft_rejected"] + trace.tokens["base"]


def _takes_request(judge) -> str | None:
    """How a backend's ``judge`` takes the request: ``"keyword"`` (a parameter named ``request``,
    as `Backend.judge` has, or ``**kwargs``), ``"positional"`` (``*args``), or None (no such
    parameter: ``judge(step)`` gives the 0-9 score; another parameter is not taken for it)."""
    try:
        params = list(inspect.signature(judge).parameters.values())
    except (TypeError, ValueError):
        return "positional"
    if any(p.name == "request" and p.kind is not p.VAR_POSITIONAL for p in params) or any(
            p.kind is p.VAR_KEYWORD for p in params):
        return "keyword"
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return "positional"
    return None
