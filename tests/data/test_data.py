"""Data: loading, tokenisation and collation, Spider and ACLSum.

Everything here runs offline on a CPU in a few seconds: the real SmolLM2 tokenizer (cached
conversion), the Spider / ACLSum data shipped in packages, and tiny random models from conftest.
"""

from __future__ import annotations

import copy
import csv
import json
import sqlite3
from pathlib import Path

import pytest
import torch

from streamspec import load_default_tokenizer
from streamspec.data.aclsum import ASPECTS, detokenize, load_aclsum
from streamspec.data.build import PadCollator, format_prompt, load_rows, tokenize_rows
from streamspec.data.spider import SPLITS, TEST_DATABASES, VALIDATION_DATABASES, load_spider
from streamspec.training.recipe import load_recipe
from streamspec.training.trainer import task_rows

SMOLLM2 = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m"
SQL = SMOLLM2 / "sql.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


# ---------------------------------------------------------------------------------------------
# 3. Data: tokenisation, collation, files, Spider and ACLSum
# ---------------------------------------------------------------------------------------------

ROWS = [
    {"prompt": "How many singers are there?", "completion": "SELECT count(*) FROM singer"},
    {"prompt": "List the names of all pets.", "completion": "SELECT name FROM pets ORDER BY name"},
]


def _prompt_ids(tokenizer, row):
    return tokenizer(format_prompt(tokenizer, row), add_special_tokens=False).input_ids


def test_tokenize_masks_exactly_the_prompt(tokenizer):
    examples, stats = tokenize_rows(ROWS, tokenizer, max_length=512)
    assert stats.kept == 2 and stats.truncated == stats.dropped_too_long == stats.dropped_no_completion == 0
    for row, ex in zip(ROWS, examples):
        ids, labels = ex["input_ids"], ex["labels"]
        assert len(ids) == len(labels)
        n = len(_prompt_ids(tokenizer, row))
        assert 0 < n < len(ids)
        assert labels[:n] == [-100] * n
        assert labels[n:] == ids[n:]
        assert -100 not in labels[n:]
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[n:]) == row["completion"] + tokenizer.eos_token


def test_tokenize_uses_the_chat_template(tokenizer):
    assert tokenizer.chat_template
    examples, _ = tokenize_rows(ROWS[:1], tokenizer, max_length=512)
    ids, labels = examples[0]["input_ids"], examples[0]["labels"]
    n = labels.index(next(label for label in labels if label != -100))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": ROWS[0]["prompt"]}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.decode(ids[:n])
    assert prompt == expected
    assert prompt.endswith("<|im_start|>assistant\n")
    assert ROWS[0]["prompt"] in prompt


def test_tokenize_without_a_chat_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    examples, _ = tokenize_rows(ROWS[:1], plain, max_length=512)
    ids, labels = examples[0]["input_ids"], examples[0]["labels"]
    n = sum(1 for label in labels if label == -100)
    assert plain.decode(ids[:n]) == ROWS[0]["prompt"] + "\n"
    assert "<|im_start|>" not in plain.decode(ids[:n])
    assert labels[n:] == ids[n:] and ids[-1] == plain.eos_token_id


def test_tokenize_messages_rows(tokenizer):
    messages = [
        {"role": "system", "content": "You write SQL."},
        {"role": "user", "content": "Count the singers."},
    ]
    row = {"messages": messages, "completion": "SELECT count(*) FROM singer"}
    examples, stats = tokenize_rows([row], tokenizer, max_length=512)
    assert stats.kept == 1
    ids, labels = examples[0]["input_ids"], examples[0]["labels"]
    n = sum(1 for label in labels if label == -100)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids[:n]) == expected
    assert "You write SQL." in expected and "helpful AI assistant" not in expected  # own system prompt kept
    assert labels[n:] == ids[n:]


def test_overflow_drop_counts_long_rows(tokenizer):
    full, _ = tokenize_rows(ROWS, tokenizer, max_length=4096)
    lengths = [len(e["input_ids"]) for e in full]
    limit = min(lengths)  # the shorter row fits exactly, the longer one does not
    assert max(lengths) > limit
    examples, stats = tokenize_rows(ROWS, tokenizer, max_length=limit, overflow="drop")
    assert stats.kept == 1 and stats.dropped_too_long == 1 and stats.truncated == 0
    assert examples == [full[lengths.index(limit)]]


def test_overflow_truncate_cuts_to_max_length(tokenizer):
    full, _ = tokenize_rows(ROWS[:1], tokenizer, max_length=4096)
    n_prompt = len(_prompt_ids(tokenizer, ROWS[0]))
    limit = n_prompt + 3  # three completion tokens survive
    assert len(full[0]["input_ids"]) > limit
    examples, stats = tokenize_rows(ROWS[:1], tokenizer, max_length=limit, overflow="truncate")
    assert stats.kept == 1 and stats.truncated == 1 and stats.dropped_too_long == 0
    ex = examples[0]
    assert len(ex["input_ids"]) == len(ex["labels"]) == limit
    assert ex["input_ids"] == full[0]["input_ids"][:limit]
    assert ex["labels"] == full[0]["labels"][:limit]
    assert sum(label != -100 for label in ex["labels"]) == 3
    # One completion token left is still a training example.
    examples, stats = tokenize_rows(ROWS[:1], tokenizer, max_length=n_prompt + 1, overflow="truncate")
    assert stats.kept == 1 and stats.truncated == 1
    assert examples[0]["labels"][-1] == examples[0]["input_ids"][-1] != -100


@pytest.mark.parametrize("cut", [0, 5])
def test_truncation_that_leaves_no_completion_drops_the_row(tokenizer, cut):
    n_prompt = len(_prompt_ids(tokenizer, ROWS[0]))
    examples, stats = tokenize_rows(ROWS, tokenizer, max_length=n_prompt - cut, overflow="truncate")
    # ROWS[0]'s prompt fills (or overflows) max_length: nothing to learn, dropped and counted.
    assert stats.dropped_no_completion >= 1
    assert stats.kept + stats.dropped_no_completion == len(ROWS)
    assert stats.dropped_too_long == 0
    for ex in examples:
        assert any(label != -100 for label in ex["labels"][1:])


def test_tokenize_rejects_bad_settings(tokenizer):
    with pytest.raises(ValueError, match="overflow"):
        tokenize_rows(ROWS, tokenizer, max_length=64, overflow="cut")
    with pytest.raises(ValueError, match="max_length"):
        tokenize_rows(ROWS, tokenizer, max_length=1)


def test_pad_collator_right_pads():
    batch = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [9, 10], "labels": [-100, 10]},
    ]
    out = PadCollator(pad_id=3)(batch)
    assert set(out) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long for t in out.values())
    assert out["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 3, 3]]
    assert out["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_load_rows_jsonl_json_csv_with_custom_fields(tmp_path):
    records = [{"q": "one?", "a": "1", "other": "x"}, {"q": "two, \"quoted\"?", "a": "2\nlines", "other": "y"}]
    expected = [{"prompt": r["q"], "completion": r["a"]} for r in records]

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")  # a blank line is skipped
    assert load_rows(path=str(jsonl), prompt_field="q", completion_field="a") == expected

    js = tmp_path / "rows.json"
    js.write_text(json.dumps(records), encoding="utf-8")
    assert load_rows(path=str(js), prompt_field="q", completion_field="a") == expected

    cs = tmp_path / "rows.CSV"  # suffixes are case-insensitive
    with cs.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["q", "a", "other"])
        writer.writeheader()
        writer.writerows(records)
    assert load_rows(path=str(cs), prompt_field="q", completion_field="a") == expected


def test_load_rows_reads_a_list_of_paths_in_order(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.json"
    first.write_text(json.dumps({"prompt": "one?", "completion": "1"}) + "\n", encoding="utf-8")
    second.write_text(json.dumps([{"prompt": "two?", "completion": "2"}, {"prompt": "three?", "completion": "3"}]),
                      encoding="utf-8")
    rows = load_rows(path=[str(second), str(first)])
    assert [r["completion"] for r in rows] == ["2", "3", "1"]
    assert load_rows(path=[str(first)]) == load_rows(path=str(first))
    with pytest.raises(ValueError, match="empty list"):
        load_rows(path=[])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(path=[str(first), str(tmp_path / "missing.jsonl")])


def test_load_rows_messages(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"conversation": chat}) + "\n", encoding="utf-8")
    rows = load_rows(path=str(path), messages_field="conversation")
    assert rows == [{"messages": chat[:-1], "completion": "Hello."}]

    path.write_text(json.dumps({"conversation": chat[:-1]}) + "\n", encoding="utf-8")  # ends with the user
    with pytest.raises(ValueError, match="row 0"):
        load_rows(path=str(path), messages_field="conversation")
    path.write_text(json.dumps({"conversation": chat}) + "\n" + json.dumps({"other": 1}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="row 1"):
        load_rows(path=str(path), messages_field="conversation")


def test_load_rows_missing_field_names_the_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}, {"prompt": "e"}]
    path.write_text("\n".join(json.dumps(r) for r in lines), encoding="utf-8")
    with pytest.raises(ValueError) as err:
        load_rows(path=str(path))
    assert "row 2" in str(err.value) and "completion" in str(err.value)
    # A non-text value counts as missing.
    path.write_text(json.dumps({"prompt": "a", "completion": 5}), encoding="utf-8")
    with pytest.raises(ValueError, match="row 0"):
        load_rows(path=str(path))


def test_load_rows_file_errors(tmp_path):
    txt = tmp_path / "rows.txt"
    txt.write_text("prompt,completion\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\.jsonl"):
        load_rows(path=str(txt))
    with pytest.raises(FileNotFoundError):
        load_rows(path=str(tmp_path / "absent.jsonl"))
    not_a_list = tmp_path / "rows.json"
    not_a_list.write_text(json.dumps({"prompt": "a", "completion": "b"}), encoding="utf-8")
    with pytest.raises(ValueError, match="list"):
        load_rows(path=str(not_a_list))
    with pytest.raises(ValueError):
        load_rows()
    with pytest.raises(ValueError):
        load_rows(path=str(txt), dataset="some/dataset")


def test_task_rows_for_a_custom_file(tmp_path):
    train = tmp_path / "train.jsonl"
    valid = tmp_path / "valid.jsonl"
    train.write_text(json.dumps({"in": "p", "out": "c"}) + "\n", encoding="utf-8")
    valid.write_text(json.dumps({"in": "vp", "out": "vc"}) + "\n", encoding="utf-8")
    common = ["data.task=custom", "data.prompt_field=in", "data.completion_field=out", f"data.path={train}"]
    recipe = load_recipe(SQL, common + [f"data.validation_path={valid}"])
    assert task_rows(recipe, "train") == [{"prompt": "p", "completion": "c"}]
    assert task_rows(recipe, "validation") == [{"prompt": "vp", "completion": "vc"}]
    no_validation = load_recipe(SQL, common)
    assert task_rows(no_validation, "validation") == []


def test_task_rows_for_builtin_tasks():
    sql = load_recipe(SQL)
    assert len(task_rows(sql, "train")) == 716 and len(task_rows(sql, "validation")) == 53
    summarize = load_recipe(SMOLLM2 / "summarize.yaml")
    assert len(task_rows(summarize, "train")) == 300 and len(task_rows(summarize, "validation")) == 150


def test_spider_splits_are_disjoint_by_database():
    splits = {s: load_spider(s) for s in SPLITS}
    assert {s: len(rows) for s, rows in splits.items()} == {"train": 716, "validation": 53, "test": 265}
    dbs = {s: {r["db_id"] for r in rows} for s, rows in splits.items()}
    assert dbs["test"] == set(TEST_DATABASES)
    assert dbs["validation"] == set(VALIDATION_DATABASES)
    assert not dbs["train"] & dbs["validation"]
    assert not dbs["train"] & dbs["test"]
    assert not dbs["validation"] & dbs["test"]
    assert len(load_spider()) == 716 + 53 + 265
    with pytest.raises(ValueError, match="split"):
        load_spider("dev")


def test_spider_gold_queries_execute_on_their_schema():
    for row in load_spider():
        assert row["completion"] == row["query"]
        assert row["schema"] in row["prompt"] and row["question"] in row["prompt"]
        con = sqlite3.connect(":memory:")
        try:
            con.executescript(row["schema"])
            tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            assert tables, row["db_id"]
            con.execute(row["query"]).fetchall()  # raises on an unknown table or column
        except sqlite3.Error as err:  # pragma: no cover - the failure message
            pytest.fail(f"{row['db_id']}: {row['query']!r}: {err}")
        finally:
            con.close()


def test_aclsum_rows():
    splits = {s: load_aclsum(s) for s in ("train", "validation", "test")}
    assert {s: len(rows) for s, rows in splits.items()} == {"train": 300, "validation": 150, "test": 300}
    papers = {}
    for split, rows in splits.items():
        by_paper: dict[str, list[str]] = {}
        for row in rows:
            by_paper.setdefault(row["id"], []).append(row["aspect"])
            assert f"Aspect: {row['aspect']}." in row["prompt"]
            assert row["abstract"] in row["prompt"]
            assert row["completion"] == row["summary"] and row["summary"].strip()
        assert all(sorted(a) == sorted(ASPECTS) for a in by_paper.values())
        assert len(by_paper) == len(rows) // 3
        papers[split] = set(by_paper)
    assert not papers["train"] & papers["validation"]
    assert not papers["train"] & papers["test"]
    with pytest.raises(ValueError, match="split"):
        load_aclsum("dev")
    assert detokenize("results ( MRR ) , and [ 3 ] .") == "results (MRR), and [3]."
