"""The model's own SQL questions (`streamspec.data.self_instruct`): a request for every table of
the schemas no split uses, the questions read out of its replies, and SQL prompts over them in
every schema style, through `distill_prompt_rows` as the distillation reads them."""

from __future__ import annotations

import json

import pytest

from streamspec.data.distill import distill_prompt_rows
from streamspec.data.schema_styles import render_schema
from streamspec.data.self_instruct import (QUESTIONS_PER_TABLE, parse_questions, question_request_rows,
                                           self_instruct_rows, unused_schemas)
from streamspec.data.spider import load_spider

REPLY = """Here are some questions:
1. How many singers are there?
2) What is the average age of all singers?
- List the names of singers older than 30.
* Show the country of each singer
How many singers are there?
3. Singers
Question 4: Which singer has the most concerts?
Q5. count
"""


def test_questions_are_read_out_of_a_reply_without_numbering_or_repeats():
    assert parse_questions(REPLY, limit=10) == [
        "How many singers are there?", "What is the average age of all singers?",
        "List the names of singers older than 30.", "Show the country of each singer",
        "Which singer has the most concerts?"]
    assert parse_questions(REPLY, limit=2) == ["How many singers are there?", "What is the average age of all singers?"]
    assert parse_questions("") == [] and parse_questions("SELECT * FROM singer;") == []


def test_one_request_per_table_of_every_schema_no_split_uses():
    rows = question_request_rows()
    schemas = unused_schemas()
    held_out = {r["db_id"] for split in ("train", "validation", "test") for r in load_spider(split)}
    assert not set(schemas) & held_out and len(schemas) == 146
    assert len(rows) == sum(sum(not t.lower().startswith("sqlite_") for t in s["table_names_original"])
                            for s in schemas.values())
    for row in rows[::50]:
        assert f"the table {row['table']}," in row["prompt"] and f"Write {QUESTIONS_PER_TABLE} different" in row["prompt"]
        assert render_schema(schemas[row["db_id"]], "spider") in row["prompt"]
    with pytest.raises(ValueError, match="questions per table"):
        question_request_rows(0)


@pytest.fixture
def questions_set(tmp_path):
    """A schema_questions set as distillation writes it (a JSONL of replies)."""
    requests = question_request_rows()[:3]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({**r, "source": "schema_questions", "completion": REPLY}) + "\n"
                            for r in requests))
    return path, requests


def test_sql_prompts_over_the_models_questions_in_every_style(questions_set):
    path, requests = questions_set
    databases = [r["db_id"] for r in requests]
    rows = distill_prompt_rows("sql", ["self_instruct"], questions_from=path)
    # each database's questions once, however many of its tables' replies repeat them
    expected = [(db, q) for db in dict.fromkeys(databases) for q in parse_questions(REPLY)]
    assert [(r["db_id"], r["question"]) for r in rows] == expected
    assert all(r["source"] == "self_instruct" and r["prompt"].endswith(f"Question: {r['question']}") for r in rows)
    styled = distill_prompt_rows("sql", ["self_instruct@compact"], questions_from=path)
    assert [(r["db_id"], r["question"]) for r in styled] == expected
    assert render_schema(unused_schemas()[rows[0]["db_id"]], "compact") in styled[0]["prompt"]
    replies = [json.loads(line) for line in path.read_text().splitlines()]
    assert self_instruct_rows(replies) == [{k: v for k, v in r.items() if k != "source"} for r in rows]


def test_what_self_instruct_cannot_read_is_refused(questions_set, tmp_path):
    path, _ = questions_set
    with pytest.raises(ValueError, match="--questions-from"):
        distill_prompt_rows("sql", ["self_instruct"])
    with pytest.raises(FileNotFoundError, match="schema_questions"):
        distill_prompt_rows("sql", ["self_instruct"], questions_from=tmp_path / "missing")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"source": "train", "db_id": "x", "completion": REPLY}) + "\n")
    with pytest.raises(ValueError, match="other.jsonl holds 'train' rows: --questions-from takes a set of --sources "
                                         "schema_questions"):
        distill_prompt_rows("sql", ["self_instruct"], questions_from=other)
    with pytest.raises(ValueError, match="SOURCE@STYLE"):  # the requests are not SQL prompts
        distill_prompt_rows("sql", ["schema_questions@untyped"])
