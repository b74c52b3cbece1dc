"""Self-distilled sets: the prompts (built-in splits and template questions over the Spider schemas
no split uses), the settings and their recipe key, the cache path, and the builder, whose
completions are the model's own greedy text, resume, and refuse a file made otherwise.

The builder runs on the tiny random Llama saved with the SmolLM2 tokenizer (`tiny_dir`); one slow
test decodes with the real default model."""

from __future__ import annotations

import json
import re
import os
from pathlib import Path

import pytest
import torch

from streamspec.cli import main
from streamspec.data.build import prompt_ids
from streamspec.data.distill import (
    SOURCES,
    _words,
    DistillArgs,
    distill_prompt_rows,
    distilled_set_path,
    labelled_rows,
    read_distilled,
    template_questions,
    unused_spider_rows,
)
from streamspec.data.spider import _schemas, load_spider, spider_dir
from streamspec.training.distill import build_distilled_set, distilled_rows
from streamspec.training.recipe import load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "recipes" / "smollm2-135m"

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def schemas():
    return _schemas()


@pytest.fixture(scope="module")
def dev_databases():
    return {r["db_id"] for r in json.loads((spider_dir() / "dev.json").read_text())}


# ---------------------------------------------------------------------------------------------
# template questions and prompts
# ---------------------------------------------------------------------------------------------


def test_template_questions_are_distinct_deterministic_and_about_the_schema(schemas):
    for db_id, schema in schemas.items():
        everything = template_questions(schema, 10_000)
        assert everything and len(set(everything)) == len(everything), db_id
        tables = [t.lower() for t in schema["table_names"]] + [_words(t) for t in schema["table_names_original"]]
        assert not any("sqlite" in q.lower() for q in everything), db_id  # not in the prompt's schema
        for count in (1, 5):
            questions = template_questions(schema, count, seed=3)
            assert questions == template_questions(schema, count, seed=3), db_id  # deterministic
            assert len(questions) == min(count, len(everything)) and len(set(questions)) == len(questions)
            assert set(questions) <= set(template_questions(schema, 10_000, seed=3))
            for question in questions:
                assert any(t in question.lower() for t in tables), (db_id, question)


def test_questions_pair_each_column_with_its_own_table(schemas):
    """tables.json lists the natural-language table names of store_1, scholar and formula_1 in
    another order than the original ones: a question must still name the table a column is in."""
    for db_id in ("store_1", "scholar", "formula_1"):
        schema = schemas[db_id]
        owner = {}
        for t, name in schema["column_names_original"]:
            if t >= 0:
                owner.setdefault(_words(name), set()).add(_words(schema["table_names_original"][t]))
        for question in template_questions(schema, 10_000):
            match = re.fullmatch(r"List the (.+) of all (.+)\.", question)
            if match:
                assert match.group(2) in owner[match.group(1)], (db_id, question)


def test_template_questions_stop_when_the_schema_has_no_more(schemas):
    smallest = min(schemas.values(), key=lambda s: len(template_questions(s, 10_000)))
    available = len(template_questions(smallest, 10_000))
    assert len(template_questions(smallest, available + 50)) == available


def test_other_seeds_change_the_questions_of_a_big_schema(schemas):
    big = max(schemas.values(), key=lambda s: len(template_questions(s, 10_000)))
    sets = {tuple(template_questions(big, 8, seed=seed)) for seed in range(4)}
    assert len(sets) == 4


def test_unused_rows_cover_every_schema_no_split_uses(schemas, dev_databases):
    rows = unused_spider_rows(questions_per_database=2, seed=0)
    used = {r["db_id"] for r in rows}
    assert not used & dev_databases
    assert used == set(schemas) - dev_databases and len(used) == 146
    for db_id in used:
        mine = [r for r in rows if r["db_id"] == db_id]
        assert len(mine) == 2 and len({r["question"] for r in mine}) == 2
    for row in rows[:20]:
        assert row["prompt"].endswith(f"Question: {row['question']}") and "CREATE TABLE" in row["prompt"]
    assert unused_spider_rows(2, seed=0) == rows  # deterministic
    assert unused_spider_rows(2, seed=1) != rows


def test_distill_prompts_are_the_labelled_prompts_without_completions():
    rows = distill_prompt_rows("sql", ["train"])
    labelled = load_spider("train")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in labelled]
    assert all("completion" not in r and r["source"] == "train" for r in rows)
    both = distill_prompt_rows("sql", ["validation", "train"])
    assert [r["source"] for r in both] == ["validation"] * len(load_spider("validation")) + ["train"] * len(labelled)


def test_sql_sources_in_another_schema_style_keep_their_questions_and_databases():
    from streamspec.data.schema_styles import render_schema
    from streamspec.data.spider import _schemas

    plain = distill_prompt_rows("sql", ["train", "unused_databases"], questions_per_database=1)
    for style in ("untyped", "compact", "renamed", "long"):
        styled = distill_prompt_rows("sql", [f"train@{style}", f"unused_databases@{style}"], questions_per_database=1)
        assert [(r["db_id"], r["question"]) for r in styled] == [(r["db_id"], r["question"]) for r in plain]
        assert {r["source"] for r in styled} == {f"train@{style}", f"unused_databases@{style}"}
        for row in styled[::97]:
            assert render_schema(_schemas()[row["db_id"]], style) in row["prompt"]
            assert row["prompt"] != next(p["prompt"] for p in plain if p["question"] == row["question"]
                                         and p["db_id"] == row["db_id"])
    assert [r["prompt"] for r in distill_prompt_rows("sql", ["train@spider"])] == [r["prompt"] for r in plain
                                                                                  if r["source"] == "train"]
    for bad in ("train@yaml", "test@untyped"):
        with pytest.raises(ValueError, match="SOURCE@STYLE"):
            distill_prompt_rows("sql", [bad])
    with pytest.raises(ValueError, match="train@untyped"):  # styles are SQL's
        distill_prompt_rows("summarize", ["train@untyped"])


@pytest.mark.parametrize("task", ["summarize", "gsm8k_solutions"])
def test_distill_prompts_of_the_other_tasks(task):
    rows = distill_prompt_rows(task, ["validation"])
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in labelled_rows(task, "validation")]
    assert rows and all("completion" not in r for r in rows)


def test_unknown_task_or_source_is_refused_naming_what_is_allowed():
    with pytest.raises(ValueError) as err:
        distill_prompt_rows("custom", ["train"])
    assert all(task in str(err.value) for task in SOURCES)
    with pytest.raises(ValueError) as err:
        distill_prompt_rows("sql", ["train", "test"])
    assert "'test'" in str(err.value) and "unused_databases" in str(err.value)
    with pytest.raises(ValueError, match="unused_databases"):  # only SQL has unused schemas
        distill_prompt_rows("summarize", ["unused_databases"])
    with pytest.raises(ValueError, match="custom"):
        labelled_rows("custom", "train")


# ---------------------------------------------------------------------------------------------
# settings, recipes and the cache path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    (dict(samples=2), "temperature"),
    (dict(samples=2, temperature=0.0), "temperature"),
    (dict(samples=0), "samples"),
    (dict(temperature=-0.5), "temperature"),
    (dict(sources=[]), "sources"),
    (dict(questions_per_database=0), "questions_per_database"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(batch_size=0), "batch_size"),
    (dict(max_prompt_tokens=0), "max_prompt_tokens"),
    (dict(with_greedy=True), "with_greedy"),
])
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DistillArgs(**kwargs)


def test_good_settings_are_accepted():
    args = DistillArgs(enabled=True, samples=3, temperature=0.7, max_prompt_tokens=1, sources=["unused_databases"])
    args.check_task("sql")
    assert args.samples == 3


def _recipe(**sections):
    raw = {"streams": {"mode": "lossless", "stream_layers": 2}, "lora": {"enabled": False}}
    raw.update(sections)
    return recipe_from_dict(raw)


def test_recipe_parses_a_distill_mapping_and_round_trips():
    recipe = _recipe(data={"task": "sql", "distill": {"enabled": True, "sources": ["train", "unused_databases"],
                                                      "questions_per_database": 3, "max_new_tokens": 12}})
    distill = recipe.data.distill
    assert isinstance(distill, DistillArgs) and distill.enabled
    assert distill.sources == ["train", "unused_databases"] and distill.questions_per_database == 3
    assert distill.max_new_tokens == 12 and distill.batch_size == DistillArgs().batch_size
    assert recipe_from_dict(recipe.to_dict()) == recipe  # what run_training writes as recipe.yaml
    assert _recipe().data.distill == DistillArgs() and not _recipe().data.distill.enabled


def test_nested_overrides_reach_the_distill_section():
    recipe = load_recipe(SMOLLM2 / "sql_lossless.yaml", [
        "data.distill.enabled=true", "data.distill.sources=[validation, unused_databases]",
        "data.distill.temperature=0.5", "data.distill.samples=2", "data.distill.path=/x/set.jsonl",
    ])
    distill = recipe.data.distill
    assert distill.enabled and distill.sources == ["validation", "unused_databases"]
    assert distill.samples == 2 and distill.temperature == 0.5 and distill.path == "/x/set.jsonl"
    off = load_recipe(SMOLLM2 / "sql_streams_distilled.yaml", ["data.distill.enabled=false"])
    assert not off.data.distill.enabled and off.data.distill.max_new_tokens == 96  # the rest of the file kept


@pytest.mark.parametrize("overrides, words", [
    (["data.distill.foo=1"], "data.distill.foo"),
    (["data.distill.max_new_tokens=many"], "data.distill.max_new_tokens"),
    (["data.distill=true"], "data.distill"),
    (["data.distill.samples=2"], "temperature"),
    (["data.distill.enabled=true", "data.distill.sources=[test]"], "test"),
    (["data.distill.enabled=true", "data.task=summarize", "data.distill.sources=[unused_databases]"], "unused_databases"),
])
def test_bad_distill_overrides_are_refused_with_their_name(overrides, words):
    with pytest.raises(ValueError) as err:
        load_recipe(SMOLLM2 / "sql_lossless.yaml", overrides)
    assert words in str(err.value)


@pytest.mark.parametrize("recipe", ["sql.yaml", "sql_next_token.yaml"])
def test_a_distill_recipe_without_lossless_streams_is_refused(recipe):
    with pytest.raises(ValueError, match="lossless"):
        load_recipe(SMOLLM2 / recipe, ["data.distill.enabled=true"])
    load_recipe(SMOLLM2 / recipe)  # the recipe itself is fine


def test_a_custom_task_cannot_be_distilled(tmp_path):
    with pytest.raises(ValueError, match="data.distill"):
        _recipe(data={"task": "custom", "path": str(tmp_path / "rows.jsonl"), "distill": {"enabled": True}})


def test_distilled_set_path_follows_the_settings(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMSPEC_CACHE", str(tmp_path / "cache"))
    base = DistillArgs(enabled=True)
    path = distilled_set_path("some/model", "sql", base)
    assert path.parent == tmp_path / "cache" / "distilled" and path.suffix == ".jsonl" and path.name.startswith("sql-")
    assert distilled_set_path("some/model", "sql", DistillArgs(enabled=True)) == path  # stable
    # what does not change the content does not change the path
    for same in (dict(batch_size=1), dict(enabled=False), dict(decoder="some/checkpoint")):
        assert distilled_set_path("some/model", "sql", DistillArgs(**same)) == path, same
    changed = [dict(sources=["train", "validation"]), dict(questions_per_database=5), dict(samples=2, temperature=1.0),
               dict(temperature=0.5), dict(max_new_tokens=10), dict(max_prompt_tokens=100), dict(seed=1),
               dict(samples=2, temperature=1.0, with_greedy=True)]
    paths = {distilled_set_path("some/model", "sql", DistillArgs(**c)) for c in changed}
    assert len(paths) == len(changed) and path not in paths
    assert distilled_set_path("other/model", "sql", base) != path
    assert distilled_set_path("some/model", "summarize", base) not in (path, *paths)
    # a local model is the same model however its path is written
    monkeypatch.chdir(tiny_dir.parent)
    assert distilled_set_path(tiny_dir.name, "sql", base) == distilled_set_path(str(tiny_dir), "sql", base)
    # an explicit path wins
    assert distilled_set_path("some/model", "sql", DistillArgs(path=str(tmp_path / "mine.jsonl"))) == tmp_path / "mine.jsonl"


# ---------------------------------------------------------------------------------------------
# the builder, on the tiny model
# ---------------------------------------------------------------------------------------------


def _greedy_text(model, tokenizer, row, max_new_tokens):
    """Plain transformers greedy decoding of one prompt, as the builder's text."""
    ids = prompt_ids(tokenizer, row)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def _check_greedy_set(model_name, rows, max_new_tokens):
    from streamspec.assets import load_base_model, load_tokenizer

    model, tokenizer = load_base_model(model_name), load_tokenizer(model_name)
    for row in rows:
        assert row["completion"] == _greedy_text(model, tokenizer, row, max_new_tokens), row["prompt"][-80:]


def test_build_writes_greedy_completions_and_resumes(tiny_dir, tmp_path):
    out = tmp_path / "set.jsonl"
    args = DistillArgs(enabled=True, sources=["validation"], max_new_tokens=5, batch_size=2)
    assert build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=3, progress=False, device="cpu") == out
    rows = read_distilled(out)
    prompts = distill_prompt_rows("sql", ["validation"])[:3]
    assert sorted(r["prompt"] for r in rows) == sorted(r["prompt"] for r in prompts)
    assert all(r["source"] == "validation" and r["sample"] == 0 and "schema" not in r for r in rows)
    assert len({r["key"] for r in rows}) == 3
    _check_greedy_set(str(tiny_dir), rows, 5)
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["task"] == "sql" and meta["settings"] == args.settings() and meta["model"] == str(tiny_dir.resolve())

    # resume: nothing to add; a lost row is decoded again, the others are kept
    build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=3, progress=False, device="cpu")
    assert read_distilled(out) == rows
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]))
    build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=3, progress=False, device="cpu")
    again = read_distilled(out)
    assert again[:2] == rows[:2] and sorted(map(json.dumps, again)) == sorted(map(json.dumps, rows))
    # a build killed while writing leaves half a line: it is cut, that row decoded again
    out.write_text("".join(lines)[:-40])
    build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=3, progress=False, device="cpu")
    assert sorted(map(json.dumps, read_distilled(out))) == sorted(map(json.dumps, rows))
    again = read_distilled(out)
    # more prompts: only the new ones are decoded
    build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=5, progress=False, device="cpu")
    five = read_distilled(out)
    assert five[:3] == again and len(five) == 5 and len({r["key"] for r in five}) == 5

    # other settings on the same file are refused, and the file is left as it was
    for other in (DistillArgs(enabled=True, sources=["validation"], max_new_tokens=6, batch_size=2),
                  DistillArgs(enabled=True, sources=["validation"], max_new_tokens=5, seed=1)):
        with pytest.raises(ValueError, match="other settings"):
            build_distilled_set(str(tiny_dir), "sql", other, out=out, limit=3, progress=False, device="cpu")
    with pytest.raises(ValueError, match="other settings"):
        build_distilled_set(str(tiny_dir), "summarize", DistillArgs(sources=["validation"], max_new_tokens=5), out=out,
                            limit=3, progress=False, device="cpu")
    assert read_distilled(out) == five


def test_batch_size_does_not_change_greedy_completions(tiny_dir, tmp_path):
    texts = []
    for batch_size in (1, 3):
        out = tmp_path / f"b{batch_size}.jsonl"
        args = DistillArgs(enabled=True, sources=["unused_databases"], questions_per_database=1, max_new_tokens=4,
                           batch_size=batch_size)
        build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=4, progress=False, device="cpu")
        texts.append({r["key"]: r["completion"] for r in read_distilled(out)})
    assert len(texts[0]) == 4 and texts[0] == texts[1]


def test_sampled_sets_are_seeded_and_hold_every_sample(tiny_dir, tmp_path):
    args = DistillArgs(enabled=True, sources=["train"], samples=3, temperature=1.0, max_new_tokens=6, batch_size=4)
    sets = []
    for name in ("a", "b"):
        build_distilled_set(str(tiny_dir), "sql", args, out=tmp_path / f"{name}.jsonl", limit=2, progress=False,
                            device="cpu")
        sets.append({r["key"]: r for r in read_distilled(tmp_path / f"{name}.jsonl")})
    assert len(sets[0]) == 6
    assert {r["completion"] for r in sets[0].values()} == {r["completion"] for r in sets[1].values()}  # same seed
    for prompt in {r["prompt"] for r in sets[0].values()}:
        mine = [r for r in sets[0].values() if r["prompt"] == prompt]
        assert sorted(r["sample"] for r in mine) == [0, 1, 2]
        assert len({r["completion"] for r in mine}) > 1, "samples of a prompt must differ (temperature 1, 49k tokens)"
    other = DistillArgs(enabled=True, sources=["train"], samples=3, temperature=1.0, max_new_tokens=6, seed=5)
    build_distilled_set(str(tiny_dir), "sql", other, out=tmp_path / "c.jsonl", limit=2, progress=False, device="cpu")
    assert {r["completion"] for r in read_distilled(tmp_path / "c.jsonl")} != {r["completion"] for r in sets[0].values()}


def test_greedy_beside_sampled_completions(tiny_dir, tmp_path):
    """with_greedy: each prompt's greedy completion (sample 0: plain transformers greedy text)
    and its sampled ones after it (samples 1..n: the same draws as a sampled-only set's 0..n-1
    are not promised, but they are seeded), in one set, decoded by the model here (on a server:
    tests/foundation/test_llama_cpp.py)."""
    args = DistillArgs(enabled=True, sources=["validation"], samples=2, temperature=1.0, with_greedy=True,
                       max_new_tokens=5, batch_size=4)
    assert args.plan() == [(0, 0.0, 1.0), (1, 1.0, 1.0), (2, 1.0, 1.0)]
    out = tmp_path / "mixed.jsonl"
    build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=2, progress=False, device="cpu")
    rows = read_distilled(out)
    assert sorted(r["sample"] for r in rows) == [0, 0, 1, 1, 2, 2]
    _check_greedy_set(str(tiny_dir), [r for r in rows if r["sample"] == 0], 5)
    for prompt in {r["prompt"] for r in rows}:
        sampled = [r["completion"] for r in rows if r["prompt"] == prompt and r["sample"] > 0]
        assert len(set(sampled)) == 2, "two draws at temperature 1 over 49k tokens must differ"
    again = tmp_path / "again.jsonl"
    build_distilled_set(str(tiny_dir), "sql", args, out=again, limit=2, progress=False, device="cpu")
    assert {r["key"]: r["completion"] for r in read_distilled(again)} == {r["key"]: r["completion"] for r in rows}


def test_long_prompts_are_skipped(tiny_dir, tmp_path):
    from streamspec.assets import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_dir))
    prompts = distill_prompt_rows("sql", ["train"])[:8]
    lengths = sorted(prompt_ids(tokenizer, r).shape[1] for r in prompts)
    cut = lengths[3]  # some prompts are longer, some are not
    assert lengths[0] <= cut < lengths[-1]
    args = DistillArgs(enabled=True, sources=["train"], max_new_tokens=2, max_prompt_tokens=cut, batch_size=8)
    out = build_distilled_set(str(tiny_dir), "sql", args, out=tmp_path / "s.jsonl", limit=8, progress=False,
                              device="cpu")
    rows = read_distilled(out)
    assert len(rows) == sum(n <= cut for n in lengths)
    assert all(prompt_ids(tokenizer, r).shape[1] <= cut for r in rows)


def test_distilled_rows_split_train_and_validation(tiny_dir, tmp_path, monkeypatch):
    import streamspec.training.distill as builder

    monkeypatch.setenv("STREAMSPEC_CACHE", str(tmp_path / "cache"))
    every = builder.distill_prompt_rows
    monkeypatch.setattr(builder, "distill_prompt_rows",  # two prompts of each source: a quick build
                        lambda task, sources, *a: [r for s in sources for r in every(task, [s], *a)[:2]])
    path = tmp_path / "rows.jsonl"
    args = DistillArgs(enabled=True, sources=["train", "validation", "unused_databases"], questions_per_database=1,
                       max_new_tokens=3, path=str(path))
    train = distilled_rows(str(tiny_dir), "sql", args, "train")
    validation = distilled_rows(str(tiny_dir), "sql", args, "validation")
    assert sorted(r["source"] for r in train) == ["train", "train", "unused_databases", "unused_databases"]
    assert [r["source"] for r in validation] == ["validation", "validation"]
    assert all("completion" in r for r in train + validation) and path.is_file()
    assert not (tmp_path / "cache").exists()  # the set lives where data.distill.path says
    # without a distilled validation source, validation is the task's labelled rows
    labelled = distilled_rows(str(tiny_dir), "sql", DistillArgs(enabled=True, path=str(path)), "validation")
    assert labelled == load_spider("validation")


def test_read_distilled_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="streamspec distill"):
        read_distilled(tmp_path / "none.jsonl")


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def test_distill_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["distill", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--task", "--sources", "--questions-per-database", "--samples", "--temperature", "--with-greedy",
                 "--max-new-tokens", "--max-prompt-tokens", "--batch-size", "--seed", "--limit", "--decoder", "--out",
                 "--device", "--dtype"):
        assert flag in text, flag


def test_distill_command_refuses_a_bad_task(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["distill", "--task", "poetry"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--task" in err and "invalid choice" in err and "poetry" in err


def test_distill_command_refuses_bad_settings_in_one_line(capsys, tmp_path):
    assert main(["distill", "--samples", "2", "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamspec: error: ") and err.count("\n") == 1 and "temperature" in err
    assert not (tmp_path / "x.jsonl").exists()


def test_distill_command_builds_a_set(tiny_dir, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    assert main(["distill", "--model", str(tiny_dir), "--sources", "validation", "--max-new-tokens", "3", "--limit", "2",
                 "--out", str(out), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip().endswith(str(out))
    rows = read_distilled(out)
    assert len(rows) == 2 and {r["source"] for r in rows} == {"validation"}
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["settings"]["max_new_tokens"] == 3 and meta["settings"]["sources"] == ["validation"]


# ---------------------------------------------------------------------------------------------
# the real model (slow)
# ---------------------------------------------------------------------------------------------


def test_real_model_distilled_set_is_its_greedy_text(tmp_path):
    from streamspec.assets import DEFAULT_MODEL_ID

    out = tmp_path / "d.jsonl"
    args = DistillArgs(enabled=True, sources=["train"], max_new_tokens=8, batch_size=2)
    build_distilled_set(DEFAULT_MODEL_ID, "sql", args, out=out, limit=3, progress=False)
    rows = read_distilled(out)
    assert len(rows) == 3
    assert sorted(r["prompt"] for r in rows) == sorted(r["prompt"] for r in load_spider("train")[:3])
    _check_greedy_set(DEFAULT_MODEL_ID, rows, 8)
    assert all(r["completion"] for r in rows)

    size = out.stat().st_size
    build_distilled_set(DEFAULT_MODEL_ID, "sql", args, out=out, limit=3, progress=False)  # resume: nothing to add
    assert out.stat().st_size == size and read_distilled(out) == rows
    with pytest.raises(ValueError, match="other settings"):
        build_distilled_set(DEFAULT_MODEL_ID, "sql", DistillArgs(enabled=True, sources=["train"], max_new_tokens=9),
                            out=out, limit=3, progress=False)
    assert os.path.getsize(out) == size


def test_two_builds_of_one_set_take_turns(tiny_dir, tmp_path):
    """A streams run and a Medusa run started together on the same cached set: the second waits
    for the first and finds every row done (no row twice, no line broken by two writers)."""
    import threading

    out = tmp_path / "shared.jsonl"
    args = DistillArgs(enabled=True, sources=["validation"], max_new_tokens=5, batch_size=2)
    errors = []

    def build():
        try:
            build_distilled_set(str(tiny_dir), "sql", args, out=out, limit=4, progress=False, device="cpu")
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rows = read_distilled(out)
    assert len(rows) == 4 and len({r["key"] for r in rows}) == 4
