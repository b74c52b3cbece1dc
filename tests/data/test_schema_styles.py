"""Spider schemas in other styles (`streamspec.data.schema_styles`): invariants over every Spider
schema, checked independently of the renderer (SQLite parses the statements), the styled rows,
and `held_out_rows` refusing styles where they do not apply."""

from __future__ import annotations

import re
import sqlite3

import pytest

from streamspec.data.schema_styles import SCHEMA_STYLES, render_schema, styled_spider_rows
from streamspec.data.spider import SPLITS, _schemas, create_table_statements, load_spider, sql_prompt
from streamspec.evaluation.benchmark import held_out_rows
from streamspec.evaluation.metrics import sql_is_valid

SCHEMAS = _schemas()
STATEMENT = re.compile(r"CREATE TABLE .*?\n\);", re.S)
STATEMENTS = {db: STATEMENT.findall(create_table_statements(schema)) for db, schema in SCHEMAS.items()}


def _own_tables(schema: dict) -> list[tuple[str, list[str]]]:
    """(table, [columns]) of a tables.json entry, SQLite's bookkeeping tables left out."""
    columns = schema["column_names_original"]
    return [(t, [c for owner, c in columns if owner == i]) for i, t in enumerate(schema["table_names_original"])
            if not t.lower().startswith("sqlite_")]


def _parsed(script: str) -> dict[str, list[tuple]]:
    """What SQLite makes of a script: per table, PRAGMA table_info rows (cid, name, type, notnull,
    default, pk) and its foreign keys."""
    connection = sqlite3.connect(":memory:")
    try:
        connection.executescript(script)
        names = [r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY rowid")]
        return {n: (connection.execute(f'PRAGMA table_info("{n}")').fetchall(),
                    connection.execute(f'PRAGMA foreign_key_list("{n}")').fetchall()) for n in names}
    finally:
        connection.close()


def test_the_styles_are_the_five_documented():
    assert SCHEMA_STYLES == ("spider", "untyped", "compact", "renamed", "long")


def test_spider_style_is_the_create_table_statements():
    for schema in SCHEMAS.values():
        assert render_schema(schema, "spider") == create_table_statements(schema)


def test_untyped_keeps_every_column_and_drops_types_and_keys():
    for db, schema in SCHEMAS.items():
        text = render_schema(schema, "untyped")
        bare = re.sub(r'"(?:[^"]|"")*"', '""', text)  # identifiers out: only the SQL around them is left
        assert not re.search(r"\b(INTEGER|TEXT|BOOLEAN|PRIMARY|FOREIGN|KEY|REFERENCES)\b", bare, re.I), db
        assert "sqlite_" not in text.lower(), db
        parsed = _parsed(text)
        expected = _own_tables(schema)
        assert list(parsed) == [t for t, _ in expected], db
        for table, columns in expected:
            info, foreign = parsed[table]
            assert [row[1] for row in info] == columns, (db, table)
            assert all(row[2] == "" and row[5] == 0 for row in info), (db, table)  # no type, no primary key
            assert foreign == [], (db, table)


def test_compact_is_one_line_per_table():
    for db, schema in SCHEMAS.items():
        lines = render_schema(schema, "compact").split("\n")
        expected = _own_tables(schema)
        assert len(lines) == len(expected), db
        for line, (table, columns) in zip(lines, expected):
            assert line == f"{table}({', '.join(columns)})", db
        assert not any(line.lower().startswith("sqlite_") for line in lines), db
        assert "CREATE" not in "\n".join(lines)


def _in_the_other_convention(old: str, new: str) -> bool:
    """snake_case (or spaced) names become camelCase; camelCase / PascalCase / single words
    become lower snake_case; the letters stay the same."""
    if "_" in old or " " in old:
        return "_" not in new and " " not in new and new[:1] == new[:1].lower() and \
            new.lower() == re.sub(r"[_ ]+", "", old).lower()
    if re.search(r"[a-z0-9][A-Z]", old):
        return "_" in new and new == new.lower() and new.replace("_", "") == old.lower()
    return new == old.lower()


def test_renamed_swaps_the_naming_convention_and_keeps_the_shape():
    changed = 0
    for db, schema in SCHEMAS.items():
        text = render_schema(schema, "renamed")
        original, renamed = _parsed(create_table_statements(schema)), _parsed(text)
        assert len(renamed) == len(original), db  # no two names merged into one
        for (old, (old_info, old_fk)), (new, (new_info, new_fk)) in zip(original.items(), renamed.items()):
            assert _in_the_other_convention(old, new), (db, old, new)
            assert len(new_info) == len(old_info), (db, old)
            for old_col, new_col in zip(old_info, new_info):
                assert _in_the_other_convention(old_col[1], new_col[1]), (db, old_col[1], new_col[1])
                assert (old_col[2], old_col[5]) == (new_col[2], new_col[5])  # same types and keys
            assert len(new_fk) == len(old_fk), (db, old)
        changed += text != create_table_statements(schema)
    assert changed > len(SCHEMAS) // 2


def _databases_in(text: str, own: str) -> list[str]:
    """The other databases whose statements, whole and in order, make up `text`."""
    statements = STATEMENT.findall(text)
    found, i = [], 0
    while i < len(statements):
        for db, own_statements in STATEMENTS.items():
            if db != own and own_statements and statements[i:i + len(own_statements)] == own_statements:
                found.append(db)
                i += len(own_statements)
                break
        else:
            raise AssertionError(f"statement {i} of the long schema for {own} belongs to no other database")
    return found


def test_long_adds_three_other_databases_deterministically():
    chosen_per_seed = {}
    for db, schema in SCHEMAS.items():
        own = create_table_statements(schema)
        for seed in (0, 1):
            text = render_schema(schema, "long", seed)
            assert text == render_schema(schema, "long", seed)
            assert text.startswith(own + "\n"), db
            others = _databases_in(text[len(own) + 1:], db)
            assert len(others) == 3 and len(set(others)) == 3 and db not in others, (db, seed, others)
            chosen_per_seed.setdefault(seed, []).append(others)
    assert chosen_per_seed[0] != chosen_per_seed[1]  # the seed matters


@pytest.mark.parametrize("style", ["spider", "untyped", "renamed", "long"])
def test_every_style_parses_as_sqlite(style):
    """The statements a prompt shows are one valid script: no table twice (the long style mixes
    databases that share table names, e.g. two with a "singer" table), no column twice."""
    for db, schema in SCHEMAS.items():
        for seed in (0, 1, 2):
            try:
                _parsed(render_schema(schema, style, seed))
            except sqlite3.Error as error:
                pytest.fail(f"{style} schema of {db} (seed {seed}): {error}")


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("style", SCHEMA_STYLES)
def test_styled_rows_change_only_the_prompt(style, split):
    plain = load_spider(split)
    styled = styled_spider_rows(style, split)
    assert len(styled) == len(plain) > 0
    for row, original in zip(styled, plain):
        for key in ("db_id", "question", "query", "completion"):
            assert row[key] == original[key], key
        assert row["schema_style"] == style
        text = render_schema(SCHEMAS[row["db_id"]], style)
        assert row["prompt"] == sql_prompt(text, row["question"])
        assert (row["prompt"] == original["prompt"]) == (style == "spider")
        assert row["schema"] == (text if style in ("renamed", "long") else original["schema"])


@pytest.mark.parametrize("split", ["validation", "test"])
@pytest.mark.parametrize("style", ["spider", "untyped", "compact", "long"])
def test_gold_sql_is_valid_against_the_rows_schema(style, split):
    """Validity is measured against the row's schema: the gold query must pass it (else every
    method's `valid` figure is wrong)."""
    bad = [(r["db_id"], r["query"]) for r in styled_spider_rows(style, split) if not sql_is_valid(r["query"], r["schema"])]
    assert not bad, f"{len(bad)} gold queries invalid, e.g. {bad[:2]}"


def test_renamed_rows_schema_is_the_renamed_statements():
    rows = styled_spider_rows("renamed", "test")
    row = next(r for r in rows if r["db_id"] == "concert_singer")
    assert row["schema"] == render_schema(SCHEMAS["concert_singer"], "renamed")
    assert '"stadiumId"' in row["schema"] and '"Stadium_ID"' not in row["schema"]
    assert '"stadiumId"' in row["prompt"]
    # the renamed names are what validity checks: a query on them runs, the originals' does not
    assert sql_is_valid('SELECT "stadiumId" FROM "stadium"', row["schema"])
    assert not sql_is_valid("SELECT Stadium_ID FROM stadium", row["schema"])


def test_bad_style_or_split_is_refused_naming_the_choices():
    with pytest.raises(ValueError) as style_error:
        styled_spider_rows("fancy", "test")
    assert all(s in str(style_error.value) for s in SCHEMA_STYLES) and "fancy" in str(style_error.value)
    with pytest.raises(ValueError) as render_error:
        render_schema(SCHEMAS["concert_singer"], "fancy")
    assert all(s in str(render_error.value) for s in SCHEMA_STYLES)
    with pytest.raises(ValueError) as split_error:
        styled_spider_rows("compact", "dev")
    assert all(s in str(split_error.value) for s in SPLITS) and "dev" in str(split_error.value)


def test_held_out_rows_applies_the_style_to_sql_only(tmp_path):
    assert held_out_rows("sql", schema_style="compact") == styled_spider_rows("compact", "test")
    assert held_out_rows("sql", split="validation", schema_style="untyped") == styled_spider_rows("untyped", "validation")
    assert held_out_rows("sql", split="validation") == load_spider("validation")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "How many singers?", "completion": "SELECT count(*) FROM singer"}\n')
    assert len(held_out_rows("sql", data=str(data))) == 1  # the default style with a data file is fine
    with pytest.raises(ValueError, match="schema_style"):
        held_out_rows("summarize", schema_style="untyped")
    with pytest.raises(ValueError, match="schema_style"):
        held_out_rows("sql", data=str(data), schema_style="long")
    with pytest.raises(ValueError, match="compact"):
        held_out_rows("sql", schema_style="bogus")
