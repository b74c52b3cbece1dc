"""Distilled sets at scale: conversations, their rows, and a folder of resumable JSONL shards.

A sharded set is a folder (``streamspec distill --engine vllm --out DIR``)::

    DIR/manifest.json           the model, the settings that decide the content, the commands, counts
    DIR/shard-00000.jsonl.gz    conversations 0..N-1 of the set's order, one row per turn
    DIR/shard-00001.jsonl.gz    conversations N..2N-1, ...

Shards are gzip-compressed JSONL (about a fifth of the text: a set of millions of tokens stays small
enough to keep beside the recipes that train on it); a shard written uncompressed
(``shard-00000.jsonl``, as earlier versions wrote them) reads the same. A shard is written whole
(a temporary file renamed into place), so a shard file that exists is complete; a run that stops
resumes at the first missing shard, and a run with other settings into the same folder is refused.
`read_distilled` (`streamspec.data.distill`) reads the folder back.

A conversation is a prompt record of `streamspec.data.sources` (its user turns), or one row of a
built-in task (one turn). Turn k's prompt is the user turns 1..k with the model's *own* replies
1..k-1 between them, through the tokenizer's chat template (`streamspec.data.build.format_prompt`,
as the trainer formats it). Each row::

    {"source", "conversation" (the record's id), "turn" (0 for the first), "messages" (the prompt:
     user and assistant turns, ending with the user's) or the task row's own fields ("prompt", ...),
     "prompt_tokens", "completion" (text), "completion_ids" (the generated ids, the end-of-turn
     token included when the model stopped), "ended", "sample": 0, "key"}
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "streamspec-distill-shards/1"
SPLITS = ("train", "validation")


@dataclass
class ShardedDistillArgs:
    """What `streamspec distill --engine vllm` decodes and how; `settings()` is what decides the
    set's content (a resume must repeat it).

    Args:
        sources: prompt sources of the registry (`streamspec.data.sources`, e.g. chitchat, evals),
            or with `task` the task's sources (train, validation, unused_databases).
        task: a built-in task (sql, summarize, gsm8k_solutions) whose prompts are distilled; None
            for registry sources.
        split: which side of the registry's train/validation split (registry sources only).
        shard_size: conversations per shard file.
        max_turns: at most this many turns of each conversation (None: all).
        max_prompt_tokens: a turn whose prompt is longer ends its conversation (None: what the
            engine's context leaves after `max_new_tokens`).
        limit: only the first `limit` conversations of the set's order.
        questions_from: the ``schema_questions`` set whose questions the ``self_instruct`` source
            asks (`streamspec.data.self_instruct`).
        max_tokens_total: stop once the set holds this many generated tokens, at a shard boundary.
        max_num_seqs: requests the engine decodes at once; threads: its CPU threads.
    """

    sources: list[str] = field(default_factory=lambda: ["chitchat"])
    task: str | None = None
    split: str = "train"
    validation_fraction: float = 0.02
    questions_per_database: int = 4
    seed: int = 0
    max_new_tokens: int = 160
    max_turns: int | None = None
    max_prompt_tokens: int | None = None
    shard_size: int = 100
    dtype: str = "float32"
    limit: int | None = None
    max_tokens_total: int | None = None
    max_num_seqs: int = 32
    threads: int = 1
    questions_from: str | None = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("distill: name at least one prompt source")
        if self.split not in SPLITS:
            raise ValueError(f"distill split must be one of {list(SPLITS)}, got {self.split!r}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(f"distill validation_fraction must be in [0, 1), got {self.validation_fraction!r}")
        for name in ("max_new_tokens", "shard_size", "max_num_seqs", "threads", "questions_per_database"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill {name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("max_turns", "max_prompt_tokens", "limit", "max_tokens_total"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"distill {name} must be >= 1 or unset, got {value!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"distill dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def settings(self) -> dict:
        """What decides the content of the shards: a resume into the same folder must match it.
        (`limit` and `max_tokens_total` only say where to stop; threads and batch size how fast.)"""
        keep = ("sources", "task", "split", "validation_fraction", "questions_per_database", "seed", "max_new_tokens",
                "max_turns", "max_prompt_tokens", "shard_size", "dtype")
        settings = {k: v for k, v in asdict(self).items() if k in keep}
        if self.task is not None:  # the registry's split does not apply to a task's own splits
            settings.pop("split"), settings.pop("validation_fraction")
        else:
            settings.pop("questions_per_database")
        if self.questions_from is not None:  # the folder's name: the set it names is part of the content
            settings["questions_from"] = Path(self.questions_from).name
        return settings


# ----------------------------------------------------------------------------- conversations

def turn_messages(turns: list[str], replies: list[str]) -> list[dict]:
    """The chat up to user turn ``len(replies)``: user turns with the model's replies between them."""
    messages = []
    for k, reply in enumerate(replies):
        messages += [{"role": "user", "content": turns[k]}, {"role": "assistant", "content": reply}]
    return messages + [{"role": "user", "content": turns[len(replies)]}]


def turn_key(source: str, conversation: str, turn: int) -> str:
    return hashlib.sha256(f"{source}\n{conversation}\n{turn}".encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the folder

SHARD_SUFFIXES = (".jsonl.gz", ".jsonl")


def shard_path(folder: str | Path, index: int) -> Path:
    """Where shard `index` is written (gzip-compressed JSONL)."""
    return Path(folder) / f"shard-{index:05d}.jsonl.gz"


def shard_index(path: str | Path) -> int | None:
    """The index of a shard file (``shard-00007.jsonl.gz`` or ``.jsonl``), None for any other name."""
    name = Path(path).name
    for suffix in SHARD_SUFFIXES:
        stem = name[:-len(suffix)] if name.endswith(suffix) else ""
        if len(stem) == 11 and stem.startswith("shard-") and stem[6:].isdigit():
            return int(stem[6:])
    return None


def shard_count(conversations: int, shard_size: int) -> int:
    return -(-conversations // shard_size)


def shard_files(folder: str | Path) -> list[Path]:
    """The shard files in a folder, in order (a shard held both compressed and not: the compressed)."""
    found: dict[int, Path] = {}
    for path in sorted(Path(folder).glob("shard-*")):
        index = shard_index(path)
        if index is not None and (index not in found or path.name.endswith(".gz")):
            found[index] = path
    return [found[i] for i in sorted(found)]


def read_shard(path: str | Path) -> list[dict]:
    """The rows of one shard file, compressed or not."""
    path = Path(path)
    data = path.read_bytes()
    text = (gzip.decompress(data) if path.name.endswith(".gz") else data).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _write_atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it into place: readers (and a
    resume) see the whole file or none."""
    _write_atomic_bytes(path, text.encode("utf-8"))


def write_shard(folder: str | Path, index: int, rows: list[dict]) -> Path:
    """Shard `index`, written whole; the same rows give the same bytes (no time in the gzip header)."""
    path = shard_path(folder, index)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    _write_atomic_bytes(path, gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    return path


def read_manifest(folder: str | Path) -> dict | None:
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def write_manifest(folder: str | Path, manifest: dict) -> None:
    write_atomic(Path(folder) / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def check_manifest(folder: str | Path, model: str, engine: str, settings: dict) -> dict | None:
    """The folder's manifest when it was made with this model, engine and these settings; None for
    a new folder. Raises naming what differs otherwise (or when shards have no manifest)."""
    folder = Path(folder)
    recorded = read_manifest(folder)
    if recorded is None:
        if shard_files(folder):
            raise ValueError(f"{folder} holds shards but no {MANIFEST}: give another --out folder")
        return None
    if recorded.get("format") != FORMAT:
        raise ValueError(f"{folder / MANIFEST} is not a distilled set's manifest ({FORMAT}); give another --out folder")
    wanted = {"model": model, "engine": engine, **settings}
    had = {"model": recorded.get("model"), "engine": recorded.get("engine"), **recorded.get("settings", {})}
    differ = sorted(k for k in set(wanted) | set(had) if wanted.get(k) != had.get(k))
    if differ:
        changes = ", ".join(f"{k}: {had.get(k)!r} there, {wanted.get(k)!r} now" for k in differ)
        raise ValueError(f"{folder} was distilled with other settings ({changes}); resume with the same settings, "
                         f"or give another --out folder")
    return recorded


def read_shards(folder: str | Path) -> list[dict]:
    """The rows of a sharded set, shard by shard (a missing shard is left out)."""
    folder = Path(folder)
    if read_manifest(folder) is None:
        raise FileNotFoundError(f"{folder} has no {MANIFEST}: not a distilled set (build one with "
                                "`streamspec distill --engine vllm --out FOLDER`)")
    return [row for path in shard_files(folder) for row in read_shard(path)]


def shard_stats(rows: list[dict]) -> dict:
    """What one shard holds: conversations, rows (turns), prompt and generated tokens."""
    return {"conversations": len({(r["source"], r["conversation"]) for r in rows}), "rows": len(rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "completion_tokens": sum(len(r["completion_ids"]) for r in rows)}


def training_row(row: dict) -> dict:
    """A distilled row as the trainer reads it (`streamspec.data.build.tokenize_rows`): the prompt
    (messages, or the task's prompt), the completion text and its generated ids."""
    kept = {k: row[k] for k in ("messages", "prompt", "completion", "completion_ids") if k in row}
    if "completion" not in kept or ("messages" not in kept and "prompt" not in kept):
        raise ValueError(f"a distilled row needs a prompt (messages or prompt) and a completion; has {sorted(row)}")
    return kept
