"""What every SpecReason backend is (`Backend`), what its calls return (`Generation`,
`Judgement`) and the chat frame a solving prompt and a judging request are built in
(`chat_frame`). `streamspec.reason.backends` describes the backends and re-exports these names.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..data.reasoning import solve_message
from .judging import DEFAULT_REQUEST, JudgeRequest, answer_token_ids, judge_request

logger = logging.getLogger(__name__)
_SENTINEL = "\u2063STREAMSPEC-STEP\u2063"


class BackendError(RuntimeError):
    """A model backend failed (a server that cannot be reached or answers with an error)."""


@dataclass
class Generation:
    """Text a backend generated and kept.

    Attributes:
        text: the kept text.
        tokens: tokens generated for it (the budget counts these).
        passes: forward passes (speculative streaming: fewer than tokens; servers: None).
        seconds: wall time.
        ended: the model ended its turn (EOS) inside this text.
    """

    text: str
    tokens: int
    passes: int | None
    seconds: float
    ended: bool = False


@dataclass
class Judgement:
    """The judge's view of a step, read from its next-token distribution after the request
    (`streamspec.reason.judging`): the probability of each of the request's answers
    (`answer_probs`), the answer its single most likely token stands for (`top_answer`, None
    when none), tokens read, time. For the paper's ``score_0_9`` request also as `digit_probs`
    (P(d) for d in 0..9) and `top_digit`."""

    digit_probs: list[float]
    top_digit: int | None
    tokens_read: int
    seconds: float
    answer_probs: dict[str, float] | None = None
    top_answer: str | None = None
    request: str = "score_0_9"  # a judgement made from digits is a 0-9 score

    def __post_init__(self) -> None:
        if self.answer_probs is None:  # made from digits (score_0_9)
            self.answer_probs = {str(d): float(p) for d, p in enumerate(self.digit_probs)}
            self.top_answer = None if self.top_digit is None else str(self.top_digit)

    @classmethod
    def of_answers(cls, request: JudgeRequest, answer_probs: dict[str, float], top_answer: str | None,
                   tokens_read: int, seconds: float) -> "Judgement":
        digits = request.name == "score_0_9"
        return cls([answer_probs.get(str(d), 0.0) for d in range(10)] if digits else [],
                   int(top_answer) if digits and top_answer is not None else None, tokens_read, seconds,
                   answer_probs=dict(answer_probs), top_answer=top_answer, request=request.name)

    def score(self, how: str) -> float:
        """The reading `how` of the answer (`JudgeRequest.score`): for ``score_0_9``
        ``"argmax"`` (the most likely token's digit; a non-digit counts as 0) or ``"expected"``
        (Σ d·p(d) over the digits, renormalised); for the yes/no requests P(the step is right)
        or the log-odds."""
        return judge_request(self.request).score(self.answer_probs, self.top_answer, how)


@dataclass
class Sampling:
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int | None = None


class Backend(ABC):
    """One role's model with the conversation of the current problem (see the module docstring)."""

    name: str = "model"

    @abstractmethod
    def start(self, problem: str) -> None:
        """Begin a new problem: the conversation is the solving prompt, no steps yet."""

    @abstractmethod
    def mark(self) -> int:
        """An opaque position in the conversation, for `rollback`."""

    @abstractmethod
    def rollback(self, mark: int) -> None:
        """Drop everything after `mark`."""

    @abstractmethod
    def append(self, text: str) -> None:
        """Add text written elsewhere (a step another model wrote)."""

    @abstractmethod
    def generate(self, max_tokens: int, sampling: Sampling, stop: "TextStop") -> Generation:
        """Generate and keep text until `stop` says it is complete or `max_tokens` are spent."""

    @abstractmethod
    def judge(self, step: str, request: str | JudgeRequest | None = None) -> Judgement:
        """Keep `step` and read the answer distribution after the judging `request` (a name of
        `streamspec.reason.judging.JUDGE_REQUESTS`; default `judging.DEFAULT_REQUEST`,
        ``error_yes_no_fewshot``; ``"score_0_9"`` for the paper's 0-9 score); the request itself
        is not kept."""

    def close(self) -> None:
        """Release what the backend holds (connections)."""


class TextStop:
    """Where a generated text is complete: after the first `delimiter` (as servers apply stop
    strings: a text that starts with it is an empty step), or, with `boxed`, when the ``\\boxed{``
    that the text continues closes."""

    def __init__(self, delimiter: str | None = None, boxed: bool = False) -> None:
        if (delimiter is None) == (not boxed):
            raise ValueError("TextStop takes a delimiter or boxed=True")
        self.delimiter, self.boxed = delimiter, boxed

    def end(self, text: str) -> int | None:
        """The length of the complete text, or None if it is not complete yet."""
        if self.delimiter is not None:
            at = text.find(self.delimiter)
            return None if at < 0 else at + len(self.delimiter)
        depth = 1
        for i, ch in enumerate(text):
            depth += (ch == "{") - (ch == "}")
            if depth == 0:
                return i + 1
        return None


# -- chat framing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatFrame:
    """The text around the steps: `prefix(problem)` opens the assistant's turn after the solving
    prompt; `judge_suffix` closes the turn, asks for the score and opens the judge's reply."""

    head: str
    tail: str
    judge_suffix: str

    def prefix(self, problem: str) -> str:
        return self.head + solve_message(problem) + self.tail


def chat_frame(tokenizer, request: str | JudgeRequest = DEFAULT_REQUEST) -> ChatFrame:
    """Render the tokenizer's chat template once around sentinels: the conversation the judge
    sees is exactly the template's rendering of [user: problem, assistant: steps, user: request]
    (`request`: a `streamspec.reason.judging.JudgeRequest` or its name)."""
    request = judge_request(request)
    if getattr(tokenizer, "chat_template", None):
        problem_mark = "\u2063STREAMSPEC-PROBLEM\u2063"
        messages = [{"role": "user", "content": problem_mark}, {"role": "assistant", "content": _SENTINEL},
                    {"role": "user", "content": request.text}]
        if request.preamble:  # before the conversation: a system message
            messages = [{"role": "system", "content": request.preamble}] + messages
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template without a system role: the preamble opens the problem's message
            if not request.preamble:
                raise
            messages = messages[1:]
            messages[0] = {"role": "user", "content": request.preamble + "\n\n" + problem_mark}
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if text.count(_SENTINEL) != 1 or text.count(problem_mark) != 1:
            raise ValueError("the chat template does not render the assistant's turn verbatim; SpecReason needs it to")
        before, after = text.split(_SENTINEL)
        head, tail = before.split(problem_mark)
        # the solving prompt's user message is what solve_message makes of the problem
        return ChatFrame(head=head, tail=tail, judge_suffix=after + request.reply_opening)
    head = request.preamble + "\n\n" if request.preamble else ""
    return ChatFrame(head=head, tail="\n\nSolution:\n", judge_suffix=f"\n\n{request.text}\n{request.reply_opening}")


def _render_problem(frame: ChatFrame, problem: str) -> str:
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("the problem is empty")
    return frame.prefix(problem)


def _digit_ids(tokenizer) -> tuple[tuple[int, ...], ...]:
    """Every vocabulary entry that renders as one digit, with or without surrounding space, per
    digit 0..9 (the ``score_0_9`` request's answers)."""
    found = answer_token_ids(tokenizer, judge_request("score_0_9"))
    return tuple(found[str(d)] for d in range(10))


# -- in process -----------------------------------------------------------------------------------
