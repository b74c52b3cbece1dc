"""Distillation at engine speed: many conversations through a greedy generator (vLLM's offline
engine, `streamspec.vllm.client.VLLMGenerator`) into a folder of resumable JSONL shards
(`streamspec.data.distill_shards`: the folder, the rows, the manifest).

`ShardedRun` keeps up to ``IN_FLIGHT_PER_SEQ * max_num_seqs`` conversations in flight: each round
hands the generator the current turn of every one of them (one ``LLM.generate``; vLLM decodes
``max_num_seqs`` at a time and refills its slots from the rest), then continues each conversation
with the model's own reply, and writes a shard as soon as all its conversations are done. The
generator is any ``generate(prompts, max_tokens, stop_token_ids) -> outputs`` over token ids, so
the tests drive the same loop with a stand-in.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable

from ..data.distill_shards import (FORMAT, ShardedDistillArgs, check_manifest, read_shard, shard_count, shard_files,
                                   shard_index, shard_stats, turn_key, turn_messages, write_manifest, write_shard)

logger = logging.getLogger(__name__)

Generator = Callable[[list[list[int]], int, list[int]], list[list[int]]]
# conversations in flight per engine slot: one generate call refills vLLM's slots from the queued
# prompts, so only its tail (the longest replies) runs below max_num_seqs
IN_FLIGHT_PER_SEQ = 4


def load_conversations(args: ShardedDistillArgs) -> list[dict]:
    """The set's conversations in its order: ``{"source", "id", "turns": [user texts]}`` for
    registry sources, ``{"source", "id", "row": task row}`` for a task. Registry records are
    shuffled with the seed (a partial run covers every source); a task keeps its rows' order."""
    if args.task is not None:
        from ..data.distill import distill_prompt_rows, row_key

        rows = distill_prompt_rows(args.task, args.sources, args.questions_per_database, args.seed,
                                   questions_from=args.questions_from)
        conversations = [{"source": r["source"], "id": row_key(r, 0), "row": {k: v for k, v in r.items() if k != "schema"}}
                         for r in rows]
    else:
        from ..data.sources import load_prompts

        records = load_prompts(list(args.sources), split=args.split, validation_fraction=args.validation_fraction,
                               seed=args.seed).rows
        conversations = [{"source": r["source"], "id": str(r["id"]), "turns": [m["content"] for m in r["messages"]]}
                         for r in records]
        random.Random(args.seed).shuffle(conversations)
    return conversations[:args.limit]


def resolve_sources(task: str | None, sources: list[str] | None, engine: str = "vllm") -> tuple[str | None, list[str]]:
    """(task, sources) from `streamspec distill`'s --task and --sources: a task's sources (train,
    validation, unused_databases; the task defaults to sql), or prompt sources of the registry
    (task None; those need the vLLM engine). Mixing the two, or an unknown name, is refused."""
    from ..data.distill import SOURCES as TASK_SOURCES
    from ..data.sources import SOURCES as REGISTRY

    if sources is None:
        return task or "sql", ["train"]
    registry = [s for s in sources if s in REGISTRY]
    if not registry:
        return task or "sql", list(sources)
    unknown = [s for s in sources if s not in REGISTRY]
    if unknown:
        task_names = sorted({s for names in TASK_SOURCES.values() for s in names})
        raise ValueError(f"--sources {unknown} are not prompt sources of the registry ({sorted(REGISTRY)}); a task's "
                         f"sources ({task_names}) are distilled on their own, with --task")
    if task is not None:
        raise ValueError(f"--task {task} distils the task's own prompts; --sources {registry} are prompt sources of "
                         "the registry: give one or the other")
    if engine != "vllm":
        raise ValueError(f"--sources {registry} (prompt sources of the registry) are distilled with --engine vllm")
    return None, list(sources)


def sharded_args(cli) -> ShardedDistillArgs:
    """`ShardedDistillArgs` from `streamspec distill --engine vllm`'s parsed arguments."""
    task, sources = resolve_sources(cli.task, cli.sources, "vllm")
    dtype = "float32" if cli.dtype == "auto" else cli.dtype  # float32: the model's own greedy text, as transformers'
    return ShardedDistillArgs(sources=sources, task=task, split=cli.split, validation_fraction=cli.validation_fraction,
                              questions_per_database=cli.questions_per_database, seed=cli.seed,
                              max_new_tokens=cli.max_new_tokens, max_turns=cli.max_turns,
                              max_prompt_tokens=cli.max_prompt_tokens, shard_size=cli.shard_size, dtype=dtype,
                              limit=cli.limit, max_tokens_total=cli.max_tokens_total, max_num_seqs=cli.max_num_seqs,
                              threads=cli.threads, questions_from=getattr(cli, "questions_from", None))


def stop_token_ids(tokenizer, model_folder: str | Path | None = None) -> list[int]:
    """The tokens that end a reply: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if model_folder is not None:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_folder).eos_token_id
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:  # no generation_config.json
            pass
    return sorted(ids)


class _Chat:
    """One conversation being distilled: its turns so far, the rows they made, the next prompt."""

    def __init__(self, index: int, conversation: dict, tokenizer, max_turns: int | None, max_prompt_tokens: int | None):
        self.index, self.conversation, self.tokenizer = index, conversation, tokenizer
        turns = len(conversation["turns"]) if "turns" in conversation else 1
        self.turns = min(turns, max_turns) if max_turns else turns
        self.max_prompt_tokens = max_prompt_tokens
        self.replies: list[str] = []
        self.rows: list[dict] = []
        self.skipped = 0  # turns left out: their prompt would be longer than max_prompt_tokens
        self._prepare()

    def _prepare(self) -> None:
        """The next turn's prompt (row fields and ids), or done."""
        from ..data.build import format_prompt

        self.prompt: list[int] | None = None
        turn = len(self.replies)
        if turn >= self.turns:
            return
        if "row" in self.conversation:
            self.fields = dict(self.conversation["row"])
        else:
            self.fields = {"messages": turn_messages(self.conversation["turns"], self.replies)}
        ids = self.tokenizer(format_prompt(self.tokenizer, self.fields), add_special_tokens=False).input_ids
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            self.skipped = self.turns - turn  # later turns are longer still
            return
        self.prompt = list(ids)

    def reply(self, ids: list[int], stop_ids: set[int]) -> None:
        """Record the model's reply to the current prompt, and prepare the next turn."""
        ended = bool(ids) and ids[-1] in stop_ids
        text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True).strip()
        source, conversation, turn = self.conversation["source"], self.conversation["id"], len(self.replies)
        key = self.conversation["id"] if "row" in self.conversation else turn_key(source, conversation, turn)
        self.rows.append({"source": source, "conversation": conversation, "turn": turn, **self.fields,
                          "prompt_tokens": len(self.prompt), "completion": text, "completion_ids": list(ids),
                          "ended": ended, "sample": 0, "key": key})
        self.replies.append(text)
        self._prepare()


class ShardedRun:
    """One run into a shard folder: `open` checks the folder and plans what is missing; `run`
    decodes it with a generator. A folder made with another model, engine or settings is refused.

    Args:
        model_key: the model as the manifest records it (`streamspec.data.distill.model_key`).
        conversations: `load_conversations(args)` (or records of the same shape).
        max_prompt_tokens: a longer turn ends its conversation (default: ``args.max_prompt_tokens``).
        command: what the manifest records as the command (default: this process's).
    """

    def __init__(self, out: str | Path, model_key: str, args: ShardedDistillArgs, conversations: list[dict], tokenizer,
                 stop_ids: list[int], engine: str = "vllm", max_prompt_tokens: int | None = None,
                 command: str | None = None) -> None:
        self.out, self.model_key, self.args, self.engine = Path(out), model_key, args, engine
        self.conversations, self.tokenizer, self.stop_ids = conversations, tokenizer, list(stop_ids)
        self.max_prompt_tokens = max_prompt_tokens if max_prompt_tokens is not None else args.max_prompt_tokens
        self.command = command if command is not None else " ".join(["streamspec", *sys.argv[1:]])
        recorded = check_manifest(self.out, model_key, engine, args.settings())
        self.shards = shard_count(len(conversations), args.shard_size)
        self.manifest = recorded or {"format": FORMAT, "model": model_key, "engine": engine,
                                     "settings": args.settings(), "command": self.command, "runs": [], "shards": {}}
        self.files = {shard_index(p): p for p in shard_files(self.out)}
        present = set(self.files)
        known = self.manifest.get("shards", {})
        self.stats = {i: known.get(f"{i:05d}") or self._read_stats(i) for i in sorted(present)}
        self.todo = [i for i in range(self.shards) if i not in present]
        if args.max_tokens_total is not None and self.set_tokens() >= args.max_tokens_total:
            self.todo = []

    def _read_stats(self, index: int) -> dict:
        return shard_stats(read_shard(self.files[index]))

    def set_tokens(self) -> int:
        return sum(s["completion_tokens"] for s in self.stats.values())

    def _save_manifest(self) -> None:
        self.manifest["shards"] = {f"{i:05d}": self.stats[i] for i in sorted(self.stats)}
        self.manifest["counts"] = {"shards": len(self.stats), "shards_planned": self.shards,
                                   "conversations_planned": len(self.conversations),
                                   **{k: sum(s[k] for s in self.stats.values())
                                      for k in ("conversations", "rows", "prompt_tokens", "completion_tokens")}}
        write_manifest(self.out, self.manifest)

    def run(self, generate: Generator, progress: bool = True, threads: int | None = None,
            max_num_seqs: int | None = None) -> dict:
        """Decode the missing shards with `generate`; returns the summary (see `summary_line`)."""
        from tqdm.auto import tqdm

        args = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        self.manifest["runs"].append({"command": self.command, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                      "threads": threads or args.threads,
                                      "max_num_seqs": max_num_seqs or args.max_num_seqs})
        self._save_manifest()
        size, stop = args.shard_size, set(self.stop_ids)
        # within a shard, the conversations of most turns first: they set when the shard is done
        queue = deque((i, j) for i in self.todo for j in sorted(
            range(i * size, min((i + 1) * size, len(self.conversations))),
            key=lambda j: -len(self.conversations[j].get("turns", ()))))
        left = {i: min((i + 1) * size, len(self.conversations)) - i * size for i in self.todo}
        done: dict[int, dict[int, _Chat]] = {i: {} for i in self.todo}
        started: set[int] = set()
        in_flight = IN_FLIGHT_PER_SEQ * (max_num_seqs or args.max_num_seqs)
        by_tokens, tokens_before = args.max_tokens_total is not None, self.set_tokens()
        bar = tqdm(total=(args.max_tokens_total - tokens_before) if by_tokens else len(queue),
                   unit="tok" if by_tokens else "conv", desc=f"distilling into {self.out.name}", disable=not progress,
                   smoothing=0.05)
        active: list[_Chat] = []
        totals = {"conversations": 0, "rows": 0, "completion_tokens": 0, "skipped_turns": 0}
        admitting, start = True, time.perf_counter()

        def finish(shard: int, chat: _Chat) -> None:
            done[shard][chat.index] = chat
            totals["conversations"] += 1
            totals["skipped_turns"] += chat.skipped
            bar.update(0 if by_tokens else 1)
            left[shard] -= 1
            if left[shard] == 0:
                rows = [row for j in sorted(done[shard]) for row in done[shard][j].rows]
                write_shard(self.out, shard, rows)
                self.stats[shard] = shard_stats(rows)
                self._save_manifest()
                del done[shard]

        while True:
            while len(active) < in_flight and queue and (admitting or queue[0][0] in started):
                shard, j = queue.popleft()
                started.add(shard)
                chat = _Chat(j, self.conversations[j], self.tokenizer, args.max_turns, self.max_prompt_tokens)
                chat.shard = shard
                if chat.prompt is None:
                    finish(shard, chat)
                else:
                    active.append(chat)
            if not active:
                break
            outputs = generate([c.prompt for c in active], args.max_new_tokens, self.stop_ids)
            if len(outputs) != len(active):
                raise RuntimeError(f"the generator answered {len(outputs)} outputs for {len(active)} prompts")
            still = []
            for chat, ids in zip(active, outputs):
                chat.reply(list(ids), stop)
                totals["rows"] += 1
                totals["completion_tokens"] += len(ids)
                bar.update(len(ids) if by_tokens else 0)
                if chat.prompt is None:
                    finish(chat.shard, chat)
                else:
                    still.append(chat)
            active = still
            seconds = time.perf_counter() - start
            bar.set_postfix_str(f"{totals['completion_tokens'] / max(seconds, 1e-9):.1f} tok/s" if not by_tokens
                                else f"{totals['conversations']} conv")
            if by_tokens and tokens_before + totals["completion_tokens"] >= args.max_tokens_total:
                admitting = False  # finish the shards begun, start no other
        bar.close()
        return self.summary(totals, time.perf_counter() - start)

    def summary(self, totals: dict | None = None, seconds: float = 0.0) -> dict:
        totals = totals or {"conversations": 0, "rows": 0, "completion_tokens": 0, "skipped_turns": 0}
        done_conversations = sum(s["conversations"] for s in self.stats.values())
        rate = totals["completion_tokens"] / seconds if seconds else 0.0
        missing = len(self.conversations) - sum(min((i + 1) * self.args.shard_size, len(self.conversations))
                                                 - i * self.args.shard_size for i in self.stats)
        per_conversation = seconds / totals["conversations"] if totals["conversations"] else None
        return {"folder": str(self.out), **totals, "seconds": round(seconds, 1), "hours": round(seconds / 3600, 3),
                "tokens_per_second": round(rate, 1), "shards": len(self.stats), "shards_planned": self.shards,
                "set_conversations": done_conversations, "set_tokens": self.set_tokens(),
                "conversations_left": missing,
                "seconds_left": missing * per_conversation if per_conversation is not None else None}


def summary_line(summary: dict) -> str:
    """The end-of-run summary for a person."""
    line = (f"distilled {summary['conversations']:,} conversations ({summary['rows']:,} turns), "
            f"{summary['completion_tokens']:,} tokens in {summary['seconds']:,.0f} s ({summary['hours']:.2f} h): "
            f"{summary['tokens_per_second']:.1f} tokens/s. {summary['folder']} holds {summary['shards']} of "
            f"{summary['shards_planned']} shards ({summary['set_conversations']:,} conversations, "
            f"{summary['set_tokens']:,} tokens)")
    if summary["skipped_turns"]:
        line += f"; {summary['skipped_turns']:,} turns left out (prompt longer than max_prompt_tokens)"
    if summary["conversations_left"] and summary["seconds_left"] is not None:
        line += (f"; the other {summary['conversations_left']:,} conversations would take about "
                 f"{summary['seconds_left'] / 3600:.1f} h at this speed")
    return line


def distill_with_vllm(model: str, args: ShardedDistillArgs, out: str | Path, progress: bool = True,
                      python: str | None = None) -> dict:
    """Distil `args`' conversations with `model`'s greedy text through vLLM's offline engine (in
    vLLM's environment: `streamspec.vllm.client.vllm_python`) into the shard folder `out`. A
    folder with shards of the same settings is resumed; the engine starts only when shards are
    missing. Returns the summary (`summary_line`)."""
    from transformers import AutoConfig

    from ..assets import builtin_model_path, load_tokenizer
    from ..data.distill import model_key
    from ..vllm.client import VLLMGenerator

    folder = builtin_model_path(model)
    tokenizer = load_tokenizer(model)
    context = getattr(AutoConfig.from_pretrained(folder), "max_position_embeddings", None)
    longest = args.max_prompt_tokens
    if longest is None and context is not None:
        longest = context - args.max_new_tokens
    runner = ShardedRun(out, model_key(model), args, load_conversations(args), tokenizer,
                        stop_token_ids(tokenizer, folder), max_prompt_tokens=longest)
    if not runner.todo:
        logger.warning("distilled set %s: nothing to do (%d of %d shards, %d tokens)", out, len(runner.stats),
                       runner.shards, runner.set_tokens())
        return runner.summary()
    with VLLMGenerator(folder, log=Path(out) / "engine.log", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       threads=args.threads, seed=args.seed) as engine:
        if progress:
            print(f"vLLM started in {engine.start_seconds:.0f} s", file=sys.stderr)
        summary = runner.run(engine, progress=progress)
    summary["engine_start_seconds"] = round(engine.start_seconds or 0.0, 1)
    return summary


__all__ = ["Generator", "ShardedRun", "distill_with_vllm", "load_conversations", "stop_token_ids",
           "resolve_sources", "sharded_args", "summary_line"]
