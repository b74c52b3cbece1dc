"""What the judge is asked and how its answer becomes a score: `JudgeRequest` and `JUDGE_REQUESTS`.

A judgement is one forward pass: the judge sees the problem, the reasoning so far with the
candidate step last (as the assistant's turn), then a user turn with the request and the opening
of its own reply; the score is read from its next-token distribution over the request's answer
tokens (every vocabulary entry that renders as the answer, with or without spaces). Each request
has its readings (`scores`), each with its own units, and the threshold is in those units:

- ``score_0_9`` (the paper's): "rate the last step 0..9". Readings ``argmax`` (the most likely
  token's digit, a non-digit counting as 0) and ``expected`` (Σ d·p(d) renormalised over the
  digits); thresholds in [0, 9].
- ``error_yes_no``: "does the last step contain an error? Yes or No". Readings ``p_no_error``
  (P(No) / (P(Yes) + P(No)), in [0, 1]) and ``log_odds`` (log P(No) − log P(Yes)).
- ``correct_yes_no``: "is the last step correct? Yes or No". Readings ``p_correct`` and
  ``log_odds`` (log P(Yes) − log P(No)).
- ``error_yes_no_fewshot``: ``error_yes_no`` with three worked judgements before the question
  (a wrong calculation, a right step, an invalid deduction); the same readings. The examples
  follow the reasoning, so a server's prompt cache cannot keep them: each judgement prefills
  them again (~170 tokens).
- ``error_yes_no_fewshot_first``: the same examples and question, the examples before the
  conversation (`JudgeRequest.preamble`), so that a server slot of the judge's own keeps them
  cached with the problem and the steps so far: each judgement prefills the new step and the
  short question only. Measured on CHAMP with Qwen2.5-Coder-1.5B it does not separate (AUROC
  0.41 within position against the examples-after request's 0.76; docs/reasoning.md): kept as
  the measured alternative, not the default.
- ``correct_or_error``: "is the last step Correct, or does it contain an Error?", one word of
  two that are not yes and no (a judge's bias towards "Yes" cannot carry it). Readings
  ``p_correct`` (P(Correct) / (P(Correct) + P(Error))) and ``log_odds``.

More requests are entries of `JUDGE_REQUESTS`: a two-answer request names its `good` and `bad`
answers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache

from .prompts import JUDGE_REPLY_OPENING, JUDGE_REQUEST


@dataclass(frozen=True)
class JudgeRequest:
    """One way of asking the judge (see the module docstring).

    Attributes:
        name: its key in `JUDGE_REQUESTS` (the ``judge.request`` setting).
        text: the user turn that asks.
        reply_opening: the start of the judge's reply, so that its next token is the answer.
        answers: the answer words whose probabilities are read (digits, or Yes/No).
        scores: the readings of the answer probabilities, the first the default.
        default_threshold: a kept step scores >= this (in the default reading's units).
        bounds: the range a threshold may take per reading (None: unbounded).
        good, bad: for a two-answer request, the answer that keeps the step and the one that
            rejects it (readings: the good answer's share of the two, and the log-odds).
        preamble: text the judge sees before the conversation (a system message where the chat
            template has one): worked judgements placed there stay one cached prefix on a server
            with a slot of the judge's own, so a judgement prefills only the new step and the
            short question (`LlamaCppBackend`'s judge slot).
    """

    name: str
    text: str
    reply_opening: str
    answers: tuple[str, ...]
    scores: tuple[str, ...]
    default_threshold: float
    bounds: dict = field(hash=False, compare=False)
    good: str | None = None
    bad: str | None = None
    preamble: str = ""

    def __post_init__(self) -> None:
        if self.name != "score_0_9" and {self.good, self.bad} != set(self.answers):
            raise ValueError(f"judge request {self.name!r}: good={self.good!r} and bad={self.bad!r} must be its "
                             f"two answers {list(self.answers)}")

    def score(self, probs: dict[str, float], top: str | None, how: str) -> float:
        """The reading `how` of the answer probabilities `probs` (and `top`, the answer of the
        judge's single most likely token, None when it is none of them)."""
        if how not in self.scores:
            raise ValueError(f"judge request {self.name!r} reads {list(self.scores)}, not {how!r}")
        if self.name == "score_0_9":
            if how == "argmax":
                return float(int(top)) if top is not None else 0.0
            mass = sum(probs.values())
            return 0.0 if mass <= 0 else sum(int(d) * p for d, p in probs.items()) / mass
        p_good, p_bad = probs.get(self.good, 0.0), probs.get(self.bad, 0.0)
        if how == "log_odds":
            return math.log(max(p_good, 1e-12)) - math.log(max(p_bad, 1e-12))
        return p_good / (p_good + p_bad) if p_good + p_bad > 0 else 0.5

    def check_threshold(self, threshold: float, how: str) -> None:
        low, high = self.bounds.get(how, (None, None))
        if (low is not None and threshold < low) or (high is not None and threshold > high):
            hint = ("; a threshold on the paper's 0-9 score goes with judge request 'score_0_9'"
                    if self.name != "score_0_9" and 1 < threshold <= 9 else "")
            raise ValueError(f"a threshold for judge request {self.name!r} read as {how!r} must be in "
                             f"[{low}, {high}], got {threshold!r}{hint}")


_YES_NO = ("Yes", "No")
JUDGE_REQUESTS: dict[str, JudgeRequest] = {
    "score_0_9": JudgeRequest(
        name="score_0_9", text=JUDGE_REQUEST, reply_opening=JUDGE_REPLY_OPENING,
        answers=tuple(str(d) for d in range(10)), scores=("argmax", "expected"), default_threshold=7.0,
        bounds={"argmax": (0, 9), "expected": (0, 9)},
    ),
    "error_yes_no": JudgeRequest(
        name="error_yes_no",
        text=("Does the last step of the reasoning above contain an error: a wrong fact, a wrong calculation or "
              "an invalid deduction? Judge only the last step. Answer Yes or No."),
        reply_opening="", answers=_YES_NO, scores=("p_no_error", "log_odds"), default_threshold=0.5,
        bounds={"p_no_error": (0, 1), "log_odds": (None, None)}, good="No", bad="Yes",
    ),
    "correct_yes_no": JudgeRequest(
        name="correct_yes_no",
        text=("Is the last step of the reasoning above correct: true facts, right calculations and a valid "
              "deduction? Judge only the last step. Answer Yes or No."),
        reply_opening="", answers=_YES_NO, scores=("p_correct", "log_odds"), default_threshold=0.5,
        bounds={"p_correct": (0, 1), "log_odds": (None, None)}, good="Yes", bad="No",
    ),
    "error_yes_no_fewshot": JudgeRequest(
        name="error_yes_no_fewshot",
        text=("You check one step of a solution at a time. Three examples of last steps and the verdicts:\n"
              "Last step: \"Each box holds 12 pens, so 7 boxes hold 12 * 7 = 74 pens.\" Error: Yes "
              "(12 * 7 is 84).\n"
              "Last step: \"She paid $20 and the book cost $13.50, so her change is 20 - 13.50 = $6.50.\" "
              "Error: No.\n"
              "Last step: \"x^2 = 9, so x = 3 is the only solution.\" Error: Yes (x = -3 also solves it).\n"
              "Now the reasoning above. Does its last step contain an error: a wrong fact, a wrong calculation "
              "or an invalid deduction? Judge only the last step. Answer Yes or No."),
        reply_opening="", answers=_YES_NO, scores=("p_no_error", "log_odds"), default_threshold=0.4,
        bounds={"p_no_error": (0, 1), "log_odds": (None, None)}, good="No", bad="Yes",
    ),
    "error_yes_no_fewshot_first": JudgeRequest(
        name="error_yes_no_fewshot_first",
        preamble=("You check one step of a solution at a time. Three examples of last steps and the verdicts:\n"
                  "Last step: \"Each box holds 12 pens, so 7 boxes hold 12 * 7 = 74 pens.\" Error: Yes "
                  "(12 * 7 is 84).\n"
                  "Last step: \"She paid $20 and the book cost $13.50, so her change is 20 - 13.50 = $6.50.\" "
                  "Error: No.\n"
                  "Last step: \"x^2 = 9, so x = 3 is the only solution.\" Error: Yes (x = -3 also solves it)."),
        text=("Does the last step of the reasoning above contain an error: a wrong fact, a wrong calculation "
              "or an invalid deduction? Judge only the last step. Answer Yes or No."),
        reply_opening="", answers=_YES_NO, scores=("p_no_error", "log_odds"), default_threshold=0.4,
        bounds={"p_no_error": (0, 1), "log_odds": (None, None)}, good="No", bad="Yes",
    ),
    "correct_or_error": JudgeRequest(
        name="correct_or_error",
        text=("Is the last step of the reasoning above Correct (true facts, right calculations, a valid "
              "deduction), or does it contain an Error? Judge only the last step. Answer with one word: "
              "Correct or Error."),
        reply_opening="", answers=("Correct", "Error"), scores=("p_correct", "log_odds"), default_threshold=0.5,
        bounds={"p_correct": (0, 1), "log_odds": (None, None)}, good="Correct", bad="Error",
    ),
}
# The request that separated right from wrong steps best within position on CHAMP (AUROC 0.756 with
# Qwen2.5-Coder-1.5B on llama.cpp; docs/reasoning.md), chosen there, never on evaluation problems.
DEFAULT_REQUEST = "error_yes_no_fewshot"


def in_process_refusal(name: str) -> ValueError:
    """The error for a request with a preamble asked of an in-process judge (which judges on the
    text's own cache, so it cannot put anything before the conversation)."""
    return ValueError(f"judge request {name!r} puts its examples before the conversation, which an in-process "
                      "judge cannot do; use a server or llama.cpp judge, or a request without a preamble "
                      "(e.g. 'error_yes_no_fewshot')")


def judge_request(name: str | JudgeRequest) -> JudgeRequest:
    """The request named `name` (a key of `JUDGE_REQUESTS`), or `name` itself if a request."""
    if isinstance(name, JudgeRequest):
        return name
    if name not in JUDGE_REQUESTS:
        raise ValueError(f"unknown judge request {name!r}; choose from {list(JUDGE_REQUESTS)}")
    return JUDGE_REQUESTS[name]


def answer_of(text: str, request: JudgeRequest) -> str | None:
    """The request's answer a token's text stands for (spaces and case ignored), or None."""
    text = text.strip()
    for answer in request.answers:
        if text == answer or (len(answer) > 1 and text.lower() == answer.lower()):
            return answer
    return None


@lru_cache(maxsize=16)
def answer_token_ids(tokenizer, request: JudgeRequest) -> dict[str, tuple[int, ...]]:
    """Every vocabulary entry that renders as one of the request's answers, per answer; refused
    when an answer has none (that tokenizer cannot give this request's score in one token)."""
    found: dict[str, list[int]] = {a: [] for a in request.answers}
    longest = max(len(a) for a in request.answers) + 3
    wanted = re.compile("|".join(re.escape(a[:1]) for a in request.answers), re.IGNORECASE)
    for token, index in tokenizer.get_vocab().items():
        if len(token) > longest + 2 or not wanted.search(token):
            continue
        answer = answer_of(tokenizer.convert_tokens_to_string([token]), request)
        if answer is not None:
            found[answer].append(index)
    missing = [a for a, ids in found.items() if not ids]
    if missing:
        raise ValueError(f"the judge's tokenizer has no single token for {missing}; it cannot answer the "
                         f"{request.name!r} request in one token")
    return {a: tuple(ids) for a, ids in found.items()}
