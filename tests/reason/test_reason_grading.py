"""Answer extraction and grading: real answer shapes from GSM8K, AIME and MATH-style solutions."""

from __future__ import annotations

import time

import pytest

from streamspec.data.reasoning import gsm8k_reference
from streamspec.reason.grading import (
    answers_match,
    extract_answer,
    extract_boxed,
    normalize_math,
    parse_number,
)

# ---------------------------------------------------------------------------------------------
# extract_boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{18}.", "18"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{3} then corrected: \\boxed{4}", "4"),
        ("\\boxed{\\left(\\frac{3}{4}, \\sqrt{2}\\right)}", "\\left(\\frac{3}{4}, \\sqrt{2}\\right)"),
        ("the set is \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\boxed{ 42 }", "42"),
        ("$\\boxed 7$", "7"),
        ("\\fbox{12}", "12"),
        # The last COMPLETE box: an unclosed one at the end is not an answer.
        ("\\boxed{5} and then \\boxed{6", "5"),
        # A box nested in a box is part of the outer answer.
        ("\\boxed{a + \\boxed{b}}", "a + \\boxed{b}"),
    ],
)
def test_extract_boxed_finds_last_complete_box(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        None,
        "I will put the final answer in boxed form.",  # mentions "boxed": not an answer
        "Then the answer goes into \\boxed{",  # the answer cue, still open
        "\\boxed{\\frac{1}{2}",  # unclosed nested
        "\\boxedfoo{3}",  # another command
    ],
)
def test_extract_boxed_none(text):
    assert extract_boxed(text) is None


def test_extract_answer_formats():
    solution = "She sells 9 eggs for $2 each, 9 * 2 = 18.\n#### 18"
    assert extract_answer(solution) is None  # boxed by default: no box here
    assert extract_answer(solution, "gsm8k") == "18"
    assert extract_answer(solution + "\nso \\boxed{19}", "gsm8k") == "19"  # boxed wins
    assert extract_answer("a\n#### 5\nb\n#### 1,000\n", "gsm8k") == "1,000"
    assert extract_answer("no final line", "gsm8k") is None
    assert extract_answer("It costs 5-3 = 2 dollars, total 1,250 apples.", "number") == "1250"
    assert extract_answer("the temperature is -4 degrees", "number") == "-4"
    assert extract_answer("x is 3.75.", "number") == "3.75"
    assert extract_answer("no digits at all", "number") is None
    assert extract_answer("\\boxed{\\frac{1}{2}}", "boxed") == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="answer format"):
        extract_answer("x", "latex")


def test_gsm8k_reference():
    assert gsm8k_reference("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18") == "18"
    assert gsm8k_reference("... \n#### 1,000") == "1000"
    assert gsm8k_reference("#### -3") == "-3"
    with pytest.raises(ValueError, match="####"):
        gsm8k_reference("The answer is 5")
    with pytest.raises(ValueError, match="nothing after"):
        gsm8k_reference("answer ####   ")


# ---------------------------------------------------------------------------------------------
# numbers and normalisation


@pytest.mark.parametrize(
    "text, value",
    [
        ("1,000", 1000.0),
        ("$18", 18.0),
        ("\\$18.00", 18.0),
        ("18.", 18.0),
        ("033", 33.0),
        ("-7", -7.0),
        ("50\\%", 50.0),
        ("18 dollars", 18.0),
        ("5\\text{ cm}", 5.0),
        ("\\text{5}", 5.0),
        ("90^\\circ", 90.0),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac34", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("x = 12", 12.0),
        (".5", 0.5),
        ("1\\,000", 1000.0),
        ("\u22125", -5.0),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["3x", "2\\pi", "1, 2", "3,4", "abc", "", "\\sqrt{2}", "1/0", "x+1", None])
def test_parse_number_refuses_non_numbers(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "raw, normal",
    [
        ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("10\\text{ inches}", "10"),
        ("\\text{(B)}", "(B)"),
        ("x = \\frac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("45^{\\circ}", "45"),
        ("\\boxed{7}", "7"),
        ("0.5.", "0.5"),
        ("1\\!000", "1000"),
    ],
)
def test_normalize_math(raw, normal):
    assert normalize_math(raw) == normal


# ---------------------------------------------------------------------------------------------
# answers_match

MATCHING = [
    # GSM8K style
    ("1,000", "1000", "numeric"),
    ("$18", "18", "numeric"),
    ("18.00", "18", "numeric"),
    ("18 dollars", "18", "numeric"),
    ("\\$1,250.", "1250", "numeric"),
    ("50\\%", "50", "numeric"),
    ("0.1", "0.10000001", "numeric"),  # within 1e-6 relative
    ("3/4", "0.75", "numeric"),
    # AIME integers
    ("033", "33", "math"),
    ("33", "033", "numeric"),
    ("\\boxed{588}", "588", "math"),
    # MATH style
    ("\\frac{1}{2}", "0.5", "math"),
    ("\\dfrac{1}{2}", "\\frac12", "math"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", "math"),
    ("2\\sqrt{2}", "\\sqrt{8}", "math"),
    ("\\frac{\\pi}{4}", "\\pi/4", "math"),
    ("x^2+2x+1", "(x+1)^2", "math"),
    ("\\left(1, \\frac{1}{2}\\right)", "(1,0.5)", "math"),
    ("1, 2, 3", "3, 2, 1", "math"),  # a bare list of solutions: any order
    ("\\{1,2\\}", "\\{2,1\\}", "math"),
    ("90^\\circ", "90", "math"),
    ("x = 5", "5", "math"),
    ("No", "no", "math"),
    ("5\\text{ cm}", "5", "math"),
    ("1/2", "\\frac{1}{2}", "numeric"),
]

NOT_MATCHING = [
    ("17", "71", "numeric"),
    ("18", "1.8", "numeric"),
    ("1,000", "100", "numeric"),
    ("0.333", "\\frac{1}{3}", "math"),  # beyond the tolerance
    ("34", "33", "math"),
    ("3x", "3", "math"),
    ("2\\pi", "2", "math"),
    ("\\sqrt{2}", "2", "math"),
    ("(1,2)", "(2,1)", "math"),  # a tuple is ordered
    ("1, 2", "1, 2, 3", "math"),
    ("x^2+1", "(x+1)^2", "math"),
    ("yes", "no", "math"),
    ("", "0", "math"),
    (None, "5", "numeric"),
    ("\\boxed{", "5", "math"),
    ("The answer is unknown", "5", "numeric"),
]


@pytest.mark.parametrize("predicted, reference, kind", MATCHING)
def test_answers_match(predicted, reference, kind):
    assert answers_match(predicted, reference, kind)


@pytest.mark.parametrize("predicted, reference, kind", NOT_MATCHING)
def test_wrong_answers_do_not_match(predicted, reference, kind):
    assert not answers_match(predicted, reference, kind)


def test_kind_is_checked():
    with pytest.raises(ValueError, match="kind"):
        answers_match("1", "1", kind="latex")


@pytest.mark.parametrize(
    "predicted",
    [
        "9^{99^{99}}",  # an exact power that would never finish
        "2^{123456}",
        "1e999999999",  # scientific notation sympy would expand
        "(" * 40 + "2" + ")" * 40,  # deep, but simply 2
        "x^{x^{x^{x}}} + \\frac{\\sqrt{x}}{\\sqrt[3]{x+1}} - \\sin(x)\\cos(x)\\tan(x)",
        "a" * 5000 + "1",
        "\\frac{1}{" * 300,
    ],
)
def test_grading_never_hangs_or_raises(predicted):
    start = time.perf_counter()
    assert answers_match(predicted, "1", "math") is False
    assert answers_match(predicted, "1", "numeric") is False
    assert time.perf_counter() - start < 15  # the grader gives up after its own timeout; a hang never returns


def test_symbolic_check_keeps_a_callers_timer():
    import signal

    if not hasattr(signal, "setitimer"):
        pytest.skip("no interval timers here")
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert answers_match("x^2+2x+1", "(x+1)^2", "math")  # goes through the bounded sympy check
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20.0 < remaining <= 30.0 and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
