"""What a SpecReason run records: `ReasonTrace` (one problem, one method) and its `Step`s.

Plain dataclasses that round-trip through JSON (`to_dict` / `from_dict`), so an evaluation writes
one trace per line and resumes from the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

STOP_REASONS = ("answered", "budget", "repetition", "error")
AUTHORS = ("drafter", "base")
PHASES = ("draft", "judge", "base", "answer")


@dataclass
class Step:
    """One reasoning step as decided.

    Attributes:
        index: 0-based position in the reasoning.
        text: the kept text (delimiter included when the step ended on it).
        author: ``"drafter"`` (drafted and kept) or ``"base"`` (written by the base: a rewrite
            after a low score, or one of the ``first_base_steps``).
        score: the judge's score of the drafted step (None when nothing was judged).
        digit_probs: the judge's probability of each digit 0..9 (as read, not renormalised;
            the score_0_9 request only).
        answer_probs: the judge's probability of each answer of its request (digits, Yes/No).
        drafted_text: the drafter's candidate when it was rejected (None otherwise).
        draft_tokens: tokens the drafter generated for this step (kept or rejected).
        base_tokens: tokens the base generated for this step (a rewrite).
        judge_tokens: tokens the judge pass read (the step and the judging request).
        draft_passes: drafter forward passes for this step (speculative streaming: < tokens).
        seconds: wall seconds of this step per phase (``draft``, ``judge``, ``base``).
    """

    index: int
    text: str
    author: str
    score: float | None = None
    digit_probs: list[float] | None = None
    answer_probs: dict[str, float] | None = None
    drafted_text: str | None = None
    draft_tokens: int = 0
    base_tokens: int = 0
    judge_tokens: int = 0
    draft_passes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def accepted(self) -> bool | None:
        """Whether a judged draft was kept (None for an unjudged step)."""
        return None if self.score is None else self.author == "drafter"


@dataclass
class ReasonTrace:
    """One problem solved by one method.

    Attributes:
        problem: the problem text.
        method: ``"specreason"``, ``"base_only"``, ``"drafter_only"`` (or a name given by the
            evaluation, e.g. ``"specreason_plain_drafter"``).
        steps: the kept steps in order.
        answer_text: the text of the explicit answer phase ("" when the reasoning answered).
        answer: the extracted final answer (None when none was found).
        stop_reason: one of `STOP_REASONS`.
        error: the backend error's text when stop_reason is ``"error"``.
        tokens: generated tokens: ``draft_kept``, ``draft_rejected``, ``base``, ``answer``,
            ``total`` (every generated token; the budget counts these), and ``judge`` (tokens
            read by judge passes, not generated).
        seconds: wall seconds per phase (``draft``, ``judge``, ``base``, ``answer``) and ``total``.
        draft_passes: drafter forward passes inside drafted steps (kept or rejected).
        problem_id: the data set's id for the problem, when known.
        reference: the reference answer, when known (filled by the evaluation).
        correct: graded against the reference (filled by the evaluation).
        config: the settings the run used (threshold, budget, ...).
    """

    problem: str
    method: str
    steps: list[Step] = field(default_factory=list)
    answer_text: str = ""
    answer: str | None = None
    stop_reason: str = "answered"
    error: str | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    draft_passes: int = 0
    problem_id: str | None = None
    reference: str | None = None
    correct: bool | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The whole solution: the kept steps, then the answer phase."""
        return "".join(step.text for step in self.steps) + self.answer_text

    @property
    def drafted_steps(self) -> list[Step]:
        """Steps whose draft was judged (kept or rewritten)."""
        return [s for s in self.steps if s.score is not None]

    @property
    def acceptance_rate(self) -> float | None:
        judged = self.drafted_steps
        return None if not judged else sum(s.author == "drafter" for s in judged) / len(judged)

    @property
    def drafter_token_share(self) -> float | None:
        """Share of the kept reasoning tokens that the drafter wrote."""
        kept = self.tokens.get("draft_kept", 0) + self.tokens.get("base", 0)
        return None if kept == 0 else self.tokens.get("draft_kept", 0) / kept

    @property
    def draft_tokens_per_pass(self) -> float | None:
        drafted = self.tokens.get("draft_kept", 0) + self.tokens.get("draft_rejected", 0)
        return None if self.draft_passes == 0 else drafted / self.draft_passes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReasonTrace":
        data = dict(data)
        data["steps"] = [Step(**s) for s in data.get("steps", [])]
        return cls(**data)
