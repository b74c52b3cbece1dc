"""Distillation into resumable shards (`streamspec.training.distill_engine`), driven by a stand-in
generator whose reply depends on the prompt's ids only, as greedy text does: each turn continues
the chat with the model's own earlier replies, shards are whole files written in order, a run
resumes at the first missing shard and rewrites it identically, other settings are refused,
--max-tokens-total stops at a shard boundary, and the trainer reads the folder (the generated ids
as they are). vLLM itself runs in tests/vllm/test_vllm_distill.py."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from streamspec.assets import load_default_tokenizer
from streamspec.cli import main
from streamspec.data.build import format_prompt, load_rows, tokenize_rows
from streamspec.data.distill import read_distilled, row_key
from streamspec.data.distill_shards import MANIFEST, ShardedDistillArgs, read_shard, shard_path
from streamspec.training import distill_engine
from streamspec.training.distill_engine import ShardedRun, load_conversations, resolve_sources

WORDS = ["apples", "rivers", "engines", "violins", "summer", "granite", "lanterns"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


class StandIn:
    """A greedy generator's stand-in: the reply is a function of the prompt ids; one prompt in
    three runs to the token limit without the end-of-turn token."""

    def __init__(self, tokenizer, fail_after: int | None = None):
        self.tokenizer, self.fail_after, self.prompts = tokenizer, fail_after, []

    def __call__(self, prompts, max_tokens, stop_ids):
        if self.fail_after is not None and len(self.prompts) >= self.fail_after:
            raise RuntimeError("the engine stopped")
        outputs = []
        for ids in prompts:
            self.prompts.append(list(ids))
            digest = int(hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:8], 16)
            text = f"Reply {digest % 1000} about {WORDS[digest % len(WORDS)]} and {WORDS[(digest // 7) % len(WORDS)]}"
            reply = self.tokenizer(text, add_special_tokens=False).input_ids
            outputs.append(reply[:max_tokens] if digest % 3 == 0 else reply[:max_tokens - 1] + [stop_ids[0]])
        return outputs


def chats(count: int, turns: int = 3) -> list[dict]:
    return [{"source": "chat", "id": f"c{i}", "turns": [f"Question {i}.{k}: tell me about {WORDS[(i + k) % 7]}?"
                                                        for k in range(turns - i % 2)]} for i in range(count)]


def run(out, tokenizer, conversations, generator=None, model="some/model", **settings):
    args = ShardedDistillArgs(sources=["chat"], **{"shard_size": 3, "max_new_tokens": 12, **settings})
    runner = ShardedRun(out, model, args, conversations, tokenizer, [tokenizer.eos_token_id], command="distill test")
    generator = generator or StandIn(tokenizer)
    return runner.run(generator, progress=False), generator


def test_each_turn_continues_the_chat_with_the_models_own_replies(tmp_path, tokenizer):
    conversations = chats(2)
    summary, generator = run(tmp_path / "set", tokenizer, conversations)
    rows = read_distilled(tmp_path / "set")
    assert [(r["conversation"], r["turn"]) for r in rows] == [("c0", 0), ("c0", 1), ("c0", 2), ("c1", 0), ("c1", 1)]
    assert summary["rows"] == 5 and summary["conversations"] == 2 and summary["shards"] == 1
    eos = tokenizer.eos_token_id
    for row in rows:
        turns = conversations[int(row["conversation"][1:])]["turns"]
        earlier = [r for r in rows if r["conversation"] == row["conversation"] and r["turn"] < row["turn"]]
        expected = []
        for k, before in enumerate(earlier):
            expected += [{"role": "user", "content": turns[k]}, {"role": "assistant", "content": before["completion"]}]
        assert row["messages"] == expected + [{"role": "user", "content": turns[row["turn"]]}]
        # the prompt the generator got is the chat template of those messages, as the trainer formats it
        prompt = tokenizer(format_prompt(tokenizer, row), add_special_tokens=False).input_ids
        assert prompt in generator.prompts and row["prompt_tokens"] == len(prompt)
        ids = row["completion_ids"]
        assert row["ended"] == (ids[-1] == eos)
        assert row["completion"] == tokenizer.decode(ids[:-1] if row["ended"] else ids, skip_special_tokens=True).strip()
        assert row["source"] == "chat" and row["sample"] == 0 and len(row["key"]) == 16
    assert any(not r["ended"] for r in rows) and any(r["ended"] for r in rows)  # both kinds of reply are kept
    assert len({r["key"] for r in rows}) == len(rows)


def test_shards_are_whole_files_and_a_run_resumes_at_the_first_missing(tmp_path, tokenizer):
    out, conversations = tmp_path / "set", chats(7)
    summary, first = run(out, tokenizer, conversations)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "shard-00000.jsonl.gz", "shard-00001.jsonl.gz",
                                                    "shard-00002.jsonl.gz"]
    assert [len({r["conversation"] for r in read_distilled(out) if r["conversation"] in {f"c{i}" for i in ids}})
            for ids in ((0, 1, 2), (3, 4, 5), (6,))] == [3, 3, 1]
    texts = {i: shard_path(out, i).read_bytes() for i in range(3)}
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["counts"]["shards"] == 3 and manifest["counts"]["conversations"] == 7
    assert manifest["counts"]["completion_tokens"] == summary["completion_tokens"] == summary["set_tokens"]
    assert manifest["command"] == "distill test" and manifest["settings"]["shard_size"] == 3

    # nothing missing: nothing decoded
    again, idle = run(out, tokenizer, conversations)
    assert idle.prompts == [] and again["shards"] == 3
    # shard 1 lost, a half-written temporary file beside it: only its conversations are decoded again
    shard_path(out, 1).unlink()
    (out / ".shard-00001.jsonl.gz.123.tmp").write_text('{"half')
    stamps = {i: shard_path(out, i).stat().st_mtime_ns for i in (0, 2)}
    _, second = run(out, tokenizer, conversations)
    assert {i: shard_path(out, i).read_bytes() for i in range(3)} == texts
    assert {i: shard_path(out, i).stat().st_mtime_ns for i in (0, 2)} == stamps  # untouched
    assert len(second.prompts) == sum(len(conversations[i]["turns"]) for i in (3, 4, 5))
    assert len(json.loads((out / MANIFEST).read_text())["runs"]) == 3


def test_uncompressed_shards_read_the_same_and_are_not_decoded_again(tmp_path, tokenizer):
    """Shards as plain JSONL (what earlier versions wrote) are the same set: read alike, counted as
    present by a resume, and a shard held both ways is read once."""
    out, conversations = tmp_path / "set", chats(7)
    run(out, tokenizer, conversations)
    rows = read_distilled(out)
    plain = out / "shard-00001.jsonl"
    plain.write_bytes(gzip.decompress(shard_path(out, 1).read_bytes()))
    assert read_distilled(out) == rows  # both files of shard 1: read once
    shard_path(out, 1).unlink()
    assert read_distilled(out) == rows
    _, idle = run(out, tokenizer, conversations)
    assert idle.prompts == [] and not shard_path(out, 1).exists()
    assert [r["conversation"] for r in read_shard(plain)] == [r["conversation"] for r in rows if r["conversation"] in
                                                              {"c3", "c4", "c5"}]


def test_a_run_that_fails_leaves_whole_shards_and_resumes_to_the_same_set(tmp_path, tokenizer):
    conversations = chats(7)
    run(tmp_path / "whole", tokenizer, conversations)
    with pytest.raises(RuntimeError, match="engine stopped"):  # (4 conversations in flight: shard 0 ends first)
        run(tmp_path / "broken", tokenizer, conversations, generator=StandIn(tokenizer, fail_after=14), max_num_seqs=1)
    written = sorted(p.name for p in (tmp_path / "broken").glob("shard-*"))
    assert written and len(written) < 3 and not list((tmp_path / "broken").glob(".*tmp"))
    run(tmp_path / "broken", tokenizer, conversations)
    for i in range(3):
        assert shard_path(tmp_path / "broken", i).read_bytes() == shard_path(tmp_path / "whole", i).read_bytes()


@pytest.mark.parametrize("change", [dict(max_new_tokens=13), dict(shard_size=4), dict(seed=1), dict(max_turns=2),
                                    dict(model="other/model")])
def test_another_setting_into_the_same_folder_is_refused(tmp_path, tokenizer, change):
    out, conversations = tmp_path / "set", chats(4)
    run(out, tokenizer, conversations)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="other settings") as err:
        run(out, tokenizer, conversations, **change)
    assert next(iter(change)) in str(err.value) and "--out" in str(err.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # shards without a manifest are not taken for a set
    (out / MANIFEST).unlink()
    with pytest.raises(ValueError, match="no manifest.json"):
        run(out, tokenizer, conversations)


def test_max_tokens_total_stops_at_a_shard_boundary_and_a_larger_total_goes_on(tmp_path, tokenizer):
    """The shards begun when the total is reached are finished (4 conversations in flight, 3 a shard:
    the first round begins shards 0 and 1), none other is begun."""
    out, conversations = tmp_path / "set", chats(12)
    summary, _ = run(out, tokenizer, conversations, max_tokens_total=5, max_num_seqs=1)
    assert summary["shards"] == 2 and summary["conversations"] == 6 and summary["set_tokens"] >= 5
    assert [p.name for p in sorted(out.glob("shard-*"))] == ["shard-00000.jsonl.gz", "shard-00001.jsonl.gz"]
    assert summary["conversations_left"] == 6 and summary["seconds_left"] > 0
    assert "the other 6 conversations" in distill_engine.summary_line(summary)
    same, idle = run(out, tokenizer, conversations, max_tokens_total=5, max_num_seqs=1)  # the same command: done
    assert idle.prompts == [] and same["shards"] == 2
    more, _ = run(out, tokenizer, conversations, max_tokens_total=summary["set_tokens"] + 1, max_num_seqs=1)
    assert more["shards"] == 4 and more["set_conversations"] == 12  # begun: shards 2 and 3, the rest of the set


def test_a_turn_longer_than_max_prompt_tokens_ends_its_conversation(tmp_path, tokenizer):
    conversations = chats(2, turns=4)
    first = tokenizer(format_prompt(tokenizer, {"messages": [{"role": "user", "content": conversations[0]["turns"][0]}]}),
                      add_special_tokens=False).input_ids
    args = ShardedDistillArgs(sources=["chat"], shard_size=3, max_new_tokens=12)
    runner = ShardedRun(tmp_path / "set", "m", args, conversations, tokenizer, [tokenizer.eos_token_id],
                        max_prompt_tokens=len(first) + 20)
    summary = runner.run(StandIn(tokenizer), progress=False)
    rows = read_distilled(tmp_path / "set")
    assert {r["turn"] for r in rows} == {0} and summary["skipped_turns"] == 3 + 2
    assert all(r["prompt_tokens"] <= len(first) + 20 for r in rows)


def test_task_prompts_keep_their_rows_and_keys(tmp_path, tokenizer):
    args = ShardedDistillArgs(task="sql", sources=["validation"], limit=3, shard_size=2, max_new_tokens=8)
    conversations = load_conversations(args)
    assert len(conversations) == 3 and all("row" in c for c in conversations)
    ShardedRun(tmp_path / "sql", "m", args, conversations, tokenizer, [tokenizer.eos_token_id]).run(StandIn(tokenizer),
                                                                                                   progress=False)
    rows = read_distilled(tmp_path / "sql")
    assert len(rows) == 3 and all(r["turn"] == 0 and r["source"] == "validation" and "schema" not in r for r in rows)
    assert all(r["key"] == row_key(r, 0) == r["conversation"] and "prompt" in r and "db_id" in r for r in rows)


def test_registry_conversations_are_shuffled_by_the_seed(monkeypatch):
    from streamspec.data import sources

    records = [{"source": "chitchat", "id": i, "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(20)]
    seen = {}

    def fake_load(names, split, validation_fraction, seed):
        seen.update(names=names, split=split, seed=seed)
        return sources.PromptSet(split, records, {}, validation_fraction, seed)

    monkeypatch.setattr(sources, "load_prompts", fake_load)
    orders = [[c["id"] for c in load_conversations(ShardedDistillArgs(sources=["chitchat"], seed=s, split="validation"))]
              for s in (0, 0, 1)]
    assert orders[0] == orders[1] != orders[2] and sorted(orders[0]) == sorted(str(i) for i in range(20))
    assert seen == {"names": ["chitchat"], "split": "validation", "seed": 1}
    assert len(load_conversations(ShardedDistillArgs(sources=["chitchat"], limit=5))) == 5


def test_the_trainer_reads_a_shard_folder_with_the_generated_ids(tmp_path, tokenizer):
    run(tmp_path / "set", tokenizer, chats(4))
    rows = load_rows(path=str(tmp_path / "set"))
    distilled = read_distilled(tmp_path / "set")
    assert len(rows) == len(distilled) and all(set(r) == {"messages", "completion", "completion_ids"} for r in rows)
    examples, stats = tokenize_rows(rows, tokenizer, max_length=4096)
    assert stats.kept == len(rows)
    for example, row in zip(examples, distilled):
        prompt_length = row["prompt_tokens"]
        assert example["input_ids"][prompt_length:] == row["completion_ids"]  # not re-tokenised from the text
        assert example["labels"] == [-100] * prompt_length + row["completion_ids"]
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        read_distilled(tmp_path)


def test_sources_name_a_task_or_the_registry():
    assert resolve_sources(None, None) == ("sql", ["train"])
    assert resolve_sources("summarize", ["validation"], "streamspec") == ("summarize", ["validation"])
    assert resolve_sources(None, ["chitchat", "evals"]) == (None, ["chitchat", "evals"])
    for task, names, engine, words in ((None, ["chitchat", "train"], "vllm", "not prompt sources"),
                                       ("sql", ["chitchat"], "vllm", "one or the other"),
                                       (None, ["chitchat"], "streamspec", "--engine vllm")):
        with pytest.raises(ValueError, match=words):
            resolve_sources(task, names, engine)


@pytest.mark.parametrize("argv, words", [
    (["--engine", "vllm", "--out", "x", "--temperature", "0.5"], "--temperature"),
    (["--engine", "vllm", "--out", "x", "--server", "http://h"], "--server"),
    (["--engine", "vllm"], "--out"),
    (["--threads", "2"], "--threads"),
    (["--shard-size", "5"], "--shard-size"),
])
def test_distill_flags_of_the_other_engine_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        main(["distill", *argv])
    assert words in capsys.readouterr().err


def test_the_command_runs_the_engine_path_end_to_end(tiny_dir, tmp_path, tokenizer, monkeypatch, capsys):
    """`streamspec distill --engine vllm` with the engine replaced by the stand-in: the model's folder,
    its stop tokens and context reach the run, the summary is printed, a second run resumes."""
    from streamspec.data import sources

    started = []

    class FakeEngine(StandIn):
        start_seconds = 0.1

        def __init__(self, model, log, **settings):
            super().__init__(tokenizer)
            started.append((model, settings))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr("streamspec.vllm.client.VLLMGenerator", FakeEngine)
    records = [{"source": "chitchat", "id": i, "messages": [{"role": "user", "content": f"Hello {i}!"},
                                                            {"role": "user", "content": "And then?"}]} for i in range(5)]
    monkeypatch.setattr(sources, "load_prompts", lambda names, split, validation_fraction, seed:
                        sources.PromptSet(split, records, {}, validation_fraction, seed))
    out = tmp_path / "chat"
    argv = ["distill", "--engine", "vllm", "--model", str(tiny_dir), "--sources", "chitchat", "--shard-size", "2",
            "--max-new-tokens", "6", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    assert started == [(str(tiny_dir), dict(dtype="float32", max_num_seqs=32, threads=1, seed=0))]
    assert "distilled 5 conversations (10 turns)" in capsys.readouterr().err
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["model"] == str(Path(tiny_dir).resolve()) and manifest["settings"]["sources"] == ["chitchat"]
    assert manifest["command"].startswith("streamspec") and manifest["counts"]["rows"] == 10
    assert len(read_distilled(out)) == 10
    shard_path(out, 2).unlink()
    assert main(argv) == 0 and len(started) == 2 and len(read_distilled(out)) == 10
    assert main(argv) == 0 and len(started) == 2  # complete: the engine is not started
    assert main(argv[:-2] + ["--max-new-tokens", "7", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err


def test_a_data_card_of_distilled_sets_counts_every_row_by_source(tmp_path, tokenizer, capsys):
    from streamspec.cli import main
    from streamspec.data.distill_card import distilled_card, source_origin

    run(tmp_path / "one", tokenizer, chats(4))
    run(tmp_path / "two", tokenizer, chats(2, turns=2), max_turns=1)
    card = distilled_card([tmp_path / "one", tmp_path / "two"])
    rows = read_distilled(tmp_path / "one") + read_distilled(tmp_path / "two")
    assert card["totals"] == {"rows": len(rows), "conversations": 6,
                              "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                              "completion_tokens": sum(len(r["completion_ids"]) for r in rows)}
    assert [(s["folder"], s["shards"], [x["source"] for x in s["sources"]]) for s in card["sets"]] == [
        ("one", 2, ["chat"]), ("two", 1, ["chat"])]
    assert source_origin("unused_databases@compact").endswith("written in the 'compact' style")
    assert "CC BY-SA 4.0" in source_origin("train") and "MIT" in source_origin("chitchat")
    assert main(["data", "card", "--distilled", str(tmp_path / "one"), "--out", str(tmp_path / "card.md")]) in (0, None)
    assert "| one | 2 of 2 | float32 | chat | 4 |" in (tmp_path / "card.md").read_text()
    with pytest.raises(FileNotFoundError, match="not a distilled set"):
        distilled_card([tmp_path])
    assert main(["data", "card", "--distilled", str(tmp_path / "one"), "--sources", "chitchat", "--out", "x.md"]) == 2
    assert "not both" in capsys.readouterr().err
