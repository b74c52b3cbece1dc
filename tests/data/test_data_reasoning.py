"""GSM8K worked solutions as SpecReason steps (data.task gsm8k_solutions): the split never
touches the evaluation rows 0..499, and completions have the step format SpecReason asks for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamspec.data.reasoning import FIRST_TRAINING_ROW, load_gsm8k_solutions, solution_steps
from streamspec.data.reasoning import solve_message
from streamspec.training.recipe import load_recipe
from streamspec.training.trainer import task_rows

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m" / "reason_lossless_adapters.yaml"


@pytest.fixture(scope="module")
def splits():
    return {split: load_gsm8k_solutions(split) for split in ("train", "validation")}


def test_split_sizes_and_no_evaluation_rows(splits):
    train, validation = splits["train"], splits["validation"]
    assert (len(train), len(validation)) == (737, 82)  # GSM8K test rows 500..1318, last tenth validation
    train_ids = {r["index"] for r in train}
    validation_ids = {r["index"] for r in validation}
    assert not train_ids & validation_ids
    assert min(train_ids | validation_ids) == FIRST_TRAINING_ROW == 500  # rows 0..499 are evaluated
    assert train_ids | validation_ids == set(range(500, 1319))
    assert min(validation_ids) > max(train_ids)


def test_rows_have_the_step_format(splits):
    for row in splits["train"] + splits["validation"]:
        assert row["prompt"] == solve_message(row["question"])
        steps = row["completion"].split("\n\n")
        assert len(steps) >= 2 and all(s.strip() == s and s and "\n" not in s for s in steps)
        assert steps[-1] == f"The answer is \\boxed{{{row['answer']}}}."
        assert "<<" not in row["completion"] and ">>" not in row["completion"] and "####" not in row["completion"]
        assert re.fullmatch(r"-?[\d.]+", row["answer"])


def test_solution_steps():
    answer = "She has 3 + 4 = <<3+4=7>>7 apples.\n\nThen  7 * 2 = <<7*2=14>>14.\n#### 1,400"
    assert solution_steps(answer) == "She has 3 + 4 = 7 apples.\n\nThen 7 * 2 = 14.\n\nThe answer is \\boxed{1400}."
    with pytest.raises(ValueError, match="####"):
        solution_steps("no final line")
    with pytest.raises(ValueError, match="split"):
        load_gsm8k_solutions("test")


def test_recipe_uses_the_task(splits):
    recipe = load_recipe(RECIPE)
    assert recipe.data.task == "gsm8k_solutions" and recipe.data.has_validation
    assert recipe.streams.mode == "lossless" and recipe.streams.stream_targets == "main"
    assert recipe.streams.stream_adapter_rank == 32 and not recipe.lora.enabled
    assert task_rows(recipe, "validation") == splits["validation"]
