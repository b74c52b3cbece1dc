"""Grading a final answer against a reference.

`extract_answer` (`streamspec.reason.extraction`, re-exported here) finds the answer a model
wrote (the last complete ``\\boxed{...}``, a GSM8K ``#### N`` line, or the last number);
`answers_match` compares it with the reference: as
numbers (GSM8K: "1,000", "$18", "18.00" are all numbers) or as mathematical answers (AIME,
CHAMP: normalised strings, then numbers, then a bounded sympy check of simple LaTeX).

Everything here is pure and never raises on model output: a malformed answer is simply wrong.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import signal
import threading
import time
from fractions import Fraction

from .extraction import ANSWER_FORMATS, _match_brace, extract_answer, extract_boxed  # noqa: F401 (re-exported)

KINDS = ("numeric", "math")

_REL_TOL = 1e-6
_ABS_TOL = 1e-9

# ---------------------------------------------------------------------------------------------
# Normalisation

_TEXT_COMMANDS = r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)"
_SPACING = re.compile(r"\\[!,;:> ]|\\q?quad|~|\\displaystyle|\\left(?![a-z])|\\right(?![a-z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree|\\circ")
_LEADING_VARIABLE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?!=)")


def _unwrap(s: str, command: str, keep: bool = True) -> str:
    r"""Replace ``\command{X}`` by X (or by nothing when not `keep`), braces matched."""
    out = []
    pos = 0
    for m in re.finditer(command + r"\s*(?=\{)", s):
        if m.start() < pos:
            continue
        end = _match_brace(s, m.end())
        if end is None:
            break
        out.append(s[pos : m.start()])
        if keep:
            out.append(s[m.end() + 1 : end - 1])
        pos = end
    out.append(s[pos:])
    return "".join(out)


_TEXT_OPEN = re.compile(_TEXT_COMMANDS + r"\s*\{")


def _strip_unit_text(s: str) -> str:
    r"""Drop a trailing ``\text{...}`` that follows something (a unit: ``5\text{ cm}``)."""
    m = _TEXT_OPEN.search(s)
    while m:
        end = _match_brace(s, m.end() - 1)
        if end is None:
            return s
        if end == len(s.rstrip()) and s[: m.start()].strip():
            return s[: m.start()]
        m = _TEXT_OPEN.search(s, end)
    return s


def normalize_math(s: str | None) -> str:
    r"""A canonical string for a mathematical answer, for exact comparison.

    Strips ``$``, ``\left``/``\right``, spacing commands (``\! \, \; \quad``), a trailing unit in
    ``\text{}``, the remaining ``\text{}``/``\mathrm{}`` wrappers (keeping their content),
    degrees, ``%``, a leading ``x =``, a trailing period and all spaces; ``\dfrac``/``\tfrac``
    become ``\frac``, ``\frac12``/``\sqrt2`` gain braces, ``.5`` becomes ``0.5``.
    """
    if s is None:
        return ""
    s = str(s).strip().replace("\u2212", "-")  # a typographic minus sign
    inner = extract_boxed(s)
    if inner is not None and s.startswith(("\\boxed", "\\fbox")):
        s = inner
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING.sub(" ", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _strip_unit_text(s)
    s = _unwrap(s, _TEXT_COMMANDS)
    s = s.strip().rstrip(".").strip()
    s = _LEADING_VARIABLE.sub("", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)
    return s


# ---------------------------------------------------------------------------------------------
# Numbers

# Names the symbolic comparison knows; never read as unit words.
_FUNCTIONS = {"sqrt", "sin", "cos", "tan", "log", "ln", "exp", "pi", "oo"}
# Unit words after a number: two letters or more, so "3x" is not read as 3 (nor "2pi" as 2).
_UNIT_WORDS = re.compile(r"[A-Za-z][A-Za-z.']+$")
# Exponents of at most three digits: Fraction("1e999999999") would build a gigantic integer.
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?")
_FRACTION = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def _number_or_none(s: str) -> Fraction | None:
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def parse_number(s: str | None) -> float | None:
    r"""The number written in `s`, or None when it is not a single number.

    Accepts thousands commas (``1,000``), ``$``/``\$``, ``%``, degrees, unit words after the
    number (``18 dollars``, ``5\text{ cm}``), a leading ``x =``, a trailing period, decimals
    (``18.00``), leading zeros (``033``) and fractions (``3/4``, ``\frac{3}{4}``, ``-\frac34``).
    Lists, expressions and words alone are not numbers.
    """
    if s is None:
        return None
    t = normalize_math(s)
    t = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", t)  # thousands separators only: "3,4" stays a list
    if not re.match(r"[+-]?[\d.\\]", t):
        return None
    unit = _UNIT_WORDS.search(t)
    if unit and unit.group(0).lower() not in _FUNCTIONS:
        t = t[: unit.start()]
    m = _FRACTION.fullmatch(t)
    if m:
        num, den = _number_or_none(m.group(2)), _number_or_none(m.group(3))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return float(-value if m.group(1) == "-" else value)
    if t.count("/") == 1:
        num, den = (_number_or_none(part) for part in t.split("/"))
        if num is None or den is None or den == 0:
            return None
        return float(num / den)
    value = _number_or_none(t)
    try:
        return None if value is None else float(value)
    except OverflowError:
        return None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


# ---------------------------------------------------------------------------------------------
# Symbolic comparison (bounded)

_MAX_SYMPY_CHARS = 120


def _latex_to_sympy(s: str) -> str | None:
    r"""A sympy-parsable string for simple LaTeX (fractions, roots, powers, \pi, \cdot), or None."""
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    s = s.replace("\\pi", " pi ").replace("\\infty", " oo ").replace("\\ln", " log ")
    s = re.sub(r"\\(sin|cos|tan|log|exp)(?![A-Za-z])", r" \1 ", s)
    for _ in range(20):  # innermost-first rewriting of \frac and \sqrt; bounded
        m = re.search(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", s)
        if m:
            s = s[: m.start()] + f"(({m.group(1)})/({m.group(2)}))" + s[m.end() :]
            continue
        m = re.search(r"\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}", s)
        if m:
            s = s[: m.start()] + f"(({m.group(2)})**(1/({m.group(1)})))" + s[m.end() :]
            continue
        m = re.search(r"\\sqrt\{([^{}]*)\}", s)
        if m:
            s = s[: m.start()] + f"sqrt({m.group(1)})" + s[m.end() :]
            continue
        break
    if "\\" in s or re.search(r"[=<>,;!_|]", s):
        return None
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    words = set(re.findall(r"[A-Za-z]{2,}", s))
    if not words <= _FUNCTIONS:
        return None  # prose or unknown functions: not an expression we trust sympy with
    # Scientific notation (1e999999999) makes sympy build the exact decimal: refused too.
    if len(s) > _MAX_SYMPY_CHARS or re.search(r"[\d.][eE][+-]?\d", s) or not _small_powers(s):
        return None
    return s


def _small_powers(s: str) -> bool:
    """Whether every power in `s` has a short, flat exponent.

    Exact integer powers are computed in C where no time limit can interrupt them: 9**99**99
    would never finish, so exponents holding a power, or a number of four digits, are refused.
    """
    for m in re.finditer(r"\*\*", s):
        rest = s[m.end() :].lstrip()
        if rest.startswith("("):
            depth = 0
            for end, ch in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    break
            operand = rest[: end + 1]
        else:
            operand = re.match(r"[\w.]*", rest).group(0)
        if "**" in operand or re.search(r"\d{4,}", operand) or rest[len(operand) :].lstrip().startswith("**"):
            return False
    return True


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise TimeoutError after `seconds` (main thread on POSIX only; elsewhere no limit)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def _expire(signum, frame):
        raise TimeoutError("sympy comparison took too long")

    previous = signal.signal(signal.SIGALRM, _expire)
    started = time.monotonic()
    # A caller's own timer (pytest-timeout, a watchdog) is put back afterwards, less the time spent.
    caller_delay, caller_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if caller_delay > 0:
            remaining = max(1e-3, caller_delay - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, remaining, caller_interval)


def _sympy_equal(a: str, b: str) -> bool:
    """Whether two simple LaTeX expressions are equal: evaluated at fixed random points.

    Numerical evaluation instead of ``simplify`` keeps the cost bounded; expressions with free
    symbols must agree at three points.
    """
    sa, sb = _latex_to_sympy(a), _latex_to_sympy(b)
    if sa is None or sb is None:
        return False
    try:
        with _time_limit(2.0):
            import sympy
            from sympy.parsing.sympy_parser import (
                convert_xor,
                implicit_multiplication_application,
                parse_expr,
                standard_transformations,
            )

            transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
            ea = parse_expr(sa, transformations=transformations, evaluate=True)
            eb = parse_expr(sb, transformations=transformations, evaluate=True)
            symbols = sorted(ea.free_symbols | eb.free_symbols, key=str)
            rng = random.Random(0)
            points = [{}] if not symbols else [
                {x: sympy.Rational(rng.randint(2, 97), rng.randint(2, 13)) for x in symbols} for _ in range(3)
            ]
            for point in points:
                va = complex(sympy.N(ea.subs(point), 30))
                vb = complex(sympy.N(eb.subs(point), 30))
                if not all(map(math.isfinite, (va.real, va.imag, vb.real, vb.imag))):
                    return False
                if abs(va - vb) > _ABS_TOL + _REL_TOL * max(abs(va), abs(vb)):
                    return False
            return True
    except Exception:  # noqa: BLE001 - any failure to parse or evaluate means "not shown equal"
        return False


# ---------------------------------------------------------------------------------------------
# Comparison


def _split_top_level(s: str) -> list[str]:
    """`s` split at commas outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _math_equal(p: str, r: str, depth: int = 0) -> bool:
    if p == r:
        return True
    if re.fullmatch(r"[A-Za-z ]+", p) and re.fullmatch(r"[A-Za-z ]+", r):
        return p.casefold() == r.casefold()  # word answers ("No", "no")
    np_, nr = parse_number(p), parse_number(r)
    if np_ is not None and nr is not None:
        return _close(np_, nr)
    if depth == 0:
        # Tuples and lists: element-wise in order; a bare list or a set \{...\} in any order.
        brackets = {"(": ")", "[": "]", "\\{": "\\}"}
        opener = next((o for o in brackets if p.startswith(o) and r.startswith(o)), None)
        if opener and p.endswith(brackets[opener]) and r.endswith(brackets[opener]):
            pi, ri = p[len(opener) : -len(brackets[opener])], r[len(opener) : -len(brackets[opener])]
        else:
            opener, pi, ri = None, p, r
        pp, rr = _split_top_level(pi), _split_top_level(ri)
        if len(pp) > 1 and len(pp) == len(rr):
            if opener in ("(", "["):
                return all(_math_equal(a, b, 1) for a, b in zip(pp, rr))
            unmatched = list(rr)
            for a in pp:
                hit = next((i for i, b in enumerate(unmatched) if _math_equal(a, b, 1)), None)
                if hit is None:
                    return False
                unmatched.pop(hit)
            return True
        if len(pp) > 1 or len(rr) > 1:
            return False
    return _sympy_equal(p, r)


def answers_match(predicted: str | None, reference: str | None, kind: str = "numeric") -> bool:
    """Whether `predicted` is the `reference` answer.

    Args:
        kind: ``"numeric"``: both are read as numbers (`parse_number`: commas, ``$``, ``%``,
            units, fractions, decimals) and compared with a relative tolerance of 1e-6; when
            either is not a single number, the ``"math"`` comparison decides.
            ``"math"``: equal after `normalize_math`; else equal as numbers; else a tuple/list
            compared element-wise (a bare list or ``\\{set\\}`` in any order); else equal as
            simple expressions (``\\sqrt{2}/2`` = ``\\frac{\\sqrt{2}}{2}``) by evaluating both
            with sympy, bounded in size and time. Anything that cannot be shown equal is wrong.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if predicted is None or reference is None:
        return False
    if kind == "numeric":
        p, r = parse_number(predicted), parse_number(reference)
        if p is not None and r is not None:
            return _close(p, r)
    p, r = normalize_math(predicted), normalize_math(reference)
    if not p or not r:
        return False
    return _math_equal(p, r)
