"""Spider prompts with the schema written the way users' own schemas often come, to check that a
speedup is not tied to Spider's prompt style (typed CREATE TABLE statements with keys):

- ``untyped``: CREATE TABLE statements with column names only, no types or keys;
- ``compact``: one line per table, ``table(column, column, ...)``;
- ``renamed``: the typed statements with every table and column name in another convention
  (snake_case names to camelCase and the other way round; the question keeps its words);
- ``long``: the typed statements of the question's database followed by those of three other
  databases whose table names clash with none of them (a longer table list, as in a warehouse
  with many tables).

`styled_spider_rows` renders a split's questions in a style; with the test split the databases
are ones no training set uses (neither the labelled pairs nor the self-distilled set). The gold
SQL is kept as written for the original schema (the check is about speed; exact match is not
comparable across styles).
"""

from __future__ import annotations

import random
import re

from .spider import SPLITS, _quote, _schemas, create_table_statements, load_spider, sql_prompt

SCHEMA_STYLES = ("spider", "untyped", "compact", "renamed", "long")


def _tables(schema: dict) -> list[tuple[str, list[str]]]:
    columns = schema["column_names_original"]
    return [(table, [name for owner, name in columns if owner == t])
            for t, table in enumerate(schema["table_names_original"]) if not table.lower().startswith("sqlite_")]


def _other_convention(name: str) -> str:
    """snake_case (or spaced) -> camelCase; camelCase or PascalCase -> snake_case."""
    if "_" in name or " " in name:
        parts = [p for p in re.split(r"[_ ]+", name) if p]
        return parts[0].lower() + "".join(p[:1].upper() + p[1:].lower() for p in parts[1:]) if parts else name
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    return snake


def render_schema(schema: dict, style: str, seed: int = 0) -> str:
    """One Spider schema (a tables.json entry) as text in `style` (see the module docstring)."""
    if style not in SCHEMA_STYLES:
        raise ValueError(f"schema style must be one of {list(SCHEMA_STYLES)}, got {style!r}")
    if style == "spider":
        return create_table_statements(schema)
    if style == "untyped":
        return "\n".join(f"CREATE TABLE {_quote(t)} (\n" + ",\n".join(f"  {_quote(c)}" for c in cols) + "\n);"
                         for t, cols in _tables(schema))
    if style == "compact":
        return "\n".join(f"{t}({', '.join(cols)})" for t, cols in _tables(schema))
    if style == "renamed":
        renamed = dict(schema)
        # SQLite's bookkeeping tables keep their names, so that they stay out of the statements
        renamed["table_names_original"] = [t if t.lower().startswith("sqlite_") else _other_convention(t)
                                           for t in schema["table_names_original"]]
        renamed["column_names_original"] = [[owner, _other_convention(c) if owner >= 0 else c]
                                            for owner, c in schema["column_names_original"]]
        return create_table_statements(renamed)
    # long: this database, then three others (fixed for a database and seed) whose table names
    # clash with none already shown (SQLite names are case-insensitive): one valid script
    others = sorted(k for k in _schemas() if k != schema["db_id"])
    rng = random.Random(f"{schema['db_id']}:{seed}")
    taken = {t.lower() for t, _ in _tables(schema)}
    extra = []
    for k in rng.sample(others, len(others)):
        names = {t.lower() for t, _ in _tables(_schemas()[k])}
        if names and not names & taken:
            extra.append(create_table_statements(_schemas()[k]))
            taken |= names
            if len(extra) == 3:
                break
    return "\n".join([create_table_statements(schema), *extra])


def styled_spider_rows(style: str, split: str = "test", seed: int = 0) -> list[dict]:
    """`load_spider(split)` with each prompt's schema rendered in `style` (rows also carry
    ``schema_style``; ``schema``, for checking SQL validity, is the typed statements under the
    names the prompt uses)."""
    if split not in SPLITS:
        raise ValueError(f"Spider split must be one of {list(SPLITS)}, got {split!r}")
    schemas = _schemas()
    rows = []
    for row in load_spider(split):
        text = render_schema(schemas[row["db_id"]], style, seed)
        typed = text if style in ("renamed", "long") else row["schema"]
        rows.append({**row, "prompt": sql_prompt(text, row["question"]), "schema": typed, "schema_style": style})
    return rows
