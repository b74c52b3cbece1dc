"""SQL questions the model writes itself for Spider's schemas (self-instruct), for self-distilled
SQL sets larger and more varied than Spider's labelled questions and the templates.

Two distillation runs make such a set:

1. ``--task sql --sources schema_questions``: for each table of the schemas no split uses (the
   ``unused_databases``), a request that the model write `QUESTIONS_PER_TABLE` questions a user
   could ask about that table's data, one a line. Its replies are a distilled set like any other.
2. ``--task sql --sources self_instruct --questions-from FOLDER`` (or ``self_instruct@STYLE``, the
   schema in a style of `streamspec.data.schema_styles`): each question `parse_questions` reads
   out of those replies becomes a SQL prompt over its schema, and the model's own SQL is distilled.

The questions are the model's, not a labelled set's: what the streams learn from the second run is
the model's SQL for the kinds of question it expects about a schema. Spider's held-out databases
are never asked about (only ``unused_databases`` schemas are).
"""

from __future__ import annotations

import re

QUESTIONS_PER_TABLE = 5
QUESTION_REQUEST = ("Here is the schema of a SQLite database:\n\n{schema}\n\nWrite {count} different questions that a "
                    "user could ask about the data in the table {table}, each one answerable with a single SQL query "
                    "over this database. Write one question per line, without numbers.")
_NUMBERING = re.compile(r"^\s*(?:[-*•]+|\(?\d{1,2}[.):]|q\d{1,2}[.):]|question\s*\d*\s*[.):])\s*", re.IGNORECASE)


def unused_schemas() -> dict[str, dict]:
    """Spider's schemas (`tables.json` entries by database) that no split of its questions uses."""
    import json

    from .spider import _schemas, spider_dir

    used = {r["db_id"] for r in json.loads((spider_dir() / "dev.json").read_text())}
    return {db_id: schema for db_id, schema in sorted(_schemas().items()) if db_id not in used}


def question_request_rows(count: int = QUESTIONS_PER_TABLE) -> list[dict]:
    """One request a table of every unused schema: ``{"db_id", "table", "prompt"}``."""
    from .spider import create_table_statements

    if count < 1:
        raise ValueError(f"questions per table must be >= 1, got {count!r}")
    rows = []
    for db_id, schema in unused_schemas().items():
        statements = create_table_statements(schema)
        for table in schema["table_names_original"]:
            if table.lower().startswith("sqlite_"):
                continue
            rows.append({"db_id": db_id, "table": table,
                         "prompt": QUESTION_REQUEST.format(schema=statements, count=count, table=table)})
    return rows


def parse_questions(text: str, limit: int = QUESTIONS_PER_TABLE) -> list[str]:
    """The questions in a reply to `QUESTION_REQUEST`: one a line, numbering and bullets removed,
    kept when they read as a question or a request of 4 to 40 words, each once (case aside), at
    most `limit`."""
    found: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        question = _NUMBERING.sub("", line).strip().strip('"').strip()
        words = question.split()
        if not 4 <= len(words) <= 40 or question.endswith(":"):
            continue
        if not (question.endswith("?") or words[0].lower() in _REQUESTS):
            continue
        key = " ".join(w.lower() for w in words)
        if key not in seen:
            seen.add(key)
            found.append(question)
        if len(found) == limit:
            break
    return found


# first words of a request that is not a question ("List the ...", "Show the ..."); not "select": a
# line of SQL is not a question
_REQUESTS = {"list", "show", "find", "give", "return", "count", "display", "get", "name", "compute", "calculate",
             "retrieve", "report", "identify", "determine"}


def self_instruct_rows(replies: list[dict], style: str = "spider", seed: int = 0,
                       limit: int = QUESTIONS_PER_TABLE, origin: str = "the set") -> list[dict]:
    """SQL prompts over the model's own questions: every question `parse_questions` finds in the
    replies of a ``schema_questions`` set (its rows, `origin` naming it in errors), over its
    schema in `style`; ``{"db_id", "question", "prompt"}``, in the set's order."""
    from .schema_styles import render_schema
    from .spider import sql_prompt

    schemas = unused_schemas()
    rows, seen = [], set()
    for reply in replies:
        if reply.get("source") != "schema_questions":
            raise ValueError(f"{origin} holds {reply.get('source')!r} rows: --questions-from takes a set of "
                             "--sources schema_questions")
        schema = schemas[reply["db_id"]]
        text = render_schema(schema, style, seed)
        for question in parse_questions(reply["completion"], limit):
            if (reply["db_id"], question.lower()) in seen:
                continue
            seen.add((reply["db_id"], question.lower()))
            rows.append({"db_id": reply["db_id"], "question": question, "prompt": sql_prompt(text, question)})
    return rows
