"""Reading a final answer out of a solution: `extract_answer` finds the answer a model wrote (the
last complete ``\\boxed{...}``, a GSM8K ``#### N`` line, or the last number); `extract_boxed` the
last complete box. Pure, and never raises on model output. `streamspec.reason.grading` grades what
these return and re-exports them.
"""

from __future__ import annotations

import re

ANSWER_FORMATS = ("boxed", "gsm8k", "number")



def _match_brace(text: str, open_at: int) -> int | None:
    """Index just past the ``}`` closing the ``{`` at `open_at`, or None when it never closes.

    A brace preceded by a backslash (``\\{`` / ``\\}``, a literal brace in LaTeX) does not count.
    """
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_boxed(text: str | None) -> str | None:
    """The content of the last complete ``\\boxed{...}`` in `text` (None when there is none).

    Braces are matched, so nested braces (``\\boxed{\\frac{1}{2}}``) are kept whole; an unclosed
    ``\\boxed{`` is not an answer, and neither is the bare word "boxed". ``\\boxed 5`` (no braces)
    counts, up to the next space or ``$``. ``\\fbox`` is read like ``\\boxed``.
    """
    if not text:
        return None
    found = None
    pos = 0
    while True:
        m = _BOXED.search(text, pos)
        if m is None:
            return found
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            end = _match_brace(text, i)
            if end is None:
                pos = i + 1  # unclosed: not an answer, but a later box may still be complete
                continue
            found = text[i + 1 : end - 1].strip()
            pos = end  # a box nested inside this one is part of this answer, not a new one
        elif i > m.end():
            bare = re.match(r"[^\s$]+", text[i:])
            if bare:
                found = bare.group(0).rstrip(".,;")
            pos = i
        else:
            pos = m.end()


_GSM8K_FINAL = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"(?<![\w)\]])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])\.\d+")


def extract_answer(text: str | None, fmt: str = "boxed") -> str | None:
    """The final answer written in `text`, or None.

    Args:
        fmt: ``"boxed"``: the last complete ``\\boxed{...}`` (`extract_boxed`);
            ``"gsm8k"``: the boxed answer if any, else what follows the last ``#### `` marker
            (GSM8K's own solution format), stripped;
            ``"number"``: the last number in the text, commas between thousands removed
            (``"... so 1,250 apples."`` -> ``"1250"``); a minus sign counts only when it does
            not follow a word, digit or bracket (``5-3`` gives ``3``).
    """
    if fmt not in ANSWER_FORMATS:
        raise ValueError(f"answer format must be one of {ANSWER_FORMATS}, got {fmt!r}")
    if not text:
        return None
    if fmt in ("boxed", "gsm8k"):
        boxed = extract_boxed(text)
        if boxed is not None or fmt == "boxed":
            return boxed
        finals = _GSM8K_FINAL.findall(text)
        answer = finals[-1].strip() if finals else ""
        return answer or None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None
