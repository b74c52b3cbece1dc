"""The words SpecReason puts around a problem: the solving prompt, the judging request, the
opening of the judge's reply, and the answer-phase cue.

The solving prompt asks for steps separated by a blank line and the final answer in
``\\boxed{}`` (METHOD §2). The judge sees the problem, the reasoning so far with the candidate
step last (as the assistant's turn), then a user turn asking for a 0-9 score of the last step
only, and the opening of its own reply, so the next token it would write is the score.
"""

from __future__ import annotations

JUDGE_REQUEST = (
    "Rate only the last step of the reasoning above on a scale from 0 to 9, for factual correctness "
    "and logical validity (not style, and not whether it is the most useful next step). "
    "9 means certainly correct, 0 certainly wrong. Reply with the digit only."
)

JUDGE_REPLY_OPENING = "Judging the last step, the quality score is: "

ANSWER_CUE = "\n\nTherefore, the final answer is \\boxed{"


