"""Prompt records from the registry's sources: one source at a time (`iter_prompts`), or several
deduplicated and split into train and validation (`load_prompts`), and a data card of a set.

A record is ``{"source", "id", "messages"}`` where ``messages`` holds only user turns, in order.

Deduplication and the split both use one key per record: a hash of its first user turn,
normalised (Unicode NFKC, lower case, whitespace collapsed). A record goes to validation when its
key, hashed with the seed, falls below `validation_fraction`: the split depends on the text alone,
so it holds out about that fraction of every source, stays the same when sources are added or
reordered, and a prompt that two sources share lands on the same side in both.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from .registry import SOURCES, default_sources, get_source

SPLITS = ("train", "validation")


def iter_prompts(name: str, root: str | Path | None = None) -> Iterator[dict]:
    """The prompt records of one source, in the file's order (records without any non-empty
    user turn are skipped).

    Args:
        name: a key of `SOURCES`.
        root: read from this folder (the one holding the package's top folder, or for the TPC
            sources sqlglot's sdist archive or unpacked folder) instead of the installed package.
    """
    source = get_source(name)
    folder = source.locate(root)
    for key, turns in source.reader(folder, source.path):
        turns = [t.strip() for t in turns if isinstance(t, str) and t.strip()]
        if turns:
            yield {"source": name, "id": key, "messages": [{"role": "user", "content": t} for t in turns]}


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip().lower()


def prompt_key(record: dict) -> str:
    """The deduplication key of a record: a hash of its normalised first user turn."""
    return hashlib.sha256(normalise(record["messages"][0]["content"]).encode("utf-8")).hexdigest()


def split_of_key(key: str, validation_fraction: float, seed: int = 0) -> str:
    draw = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16) / 16**15
    return "validation" if draw < validation_fraction else "train"


@dataclass
class SourceCount:
    """What one source gave a prompt set."""

    read: int = 0  # records read
    duplicates: int = 0  # first user turn seen before (in this source or an earlier one)
    test_overlap: int = 0  # first user turn equal to one of an installed test-only source
    train: int = 0
    validation: int = 0


@dataclass
class PromptSet:
    """Records of one split, and what each source gave (both splits are counted)."""

    split: str
    rows: list[dict]
    counts: dict[str, SourceCount]
    validation_fraction: float
    seed: int
    test_sources_checked: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)


def evaluation_prompt_keys(names: list[str] | None = None) -> tuple[set[str], list[str]]:
    """Keys of every record of the installed test-only sources (or of `names`), and which
    sources they came from."""
    if names is None:
        names = [n for n, s in SOURCES.items() if s.test_only and s.installed()]
    return {prompt_key(r) for n in names for r in iter_prompts(n)}, list(names)


def load_prompts(names: list[str] | None = None, split: str = "train", validation_fraction: float = 0.02,
                 seed: int = 0, limit_per_source: int | None = None,
                 exclude_keys: set[str] | None = None) -> PromptSet:
    """Records of several sources for self-distillation, deduplicated across them.

    Args:
        names: sources in order of preference (a duplicate keeps the copy of the first); default
            `default_sources()` (installed, neither opt-in nor test-only). Test-only sources
            are refused.
        split: train or validation (see the module docstring for how records are split).
        validation_fraction: the share of each source held out for validation.
        seed: changes which records are held out.
        limit_per_source: read at most this many records of each source (before deduplication).
        exclude_keys: keys (`prompt_key`) to leave out; default: those of every installed
            test-only source, so that no test prompt is trained on even when another source
            repeats it.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction!r}")
    names = list(default_sources() if names is None else names)
    if len(set(names)) != len(names):
        raise ValueError(f"a source is named twice: {names}")
    refused = [n for n in names if get_source(n).test_only]
    if refused:
        raise ValueError(f"prompt sources {refused} are test sets (test_only): never train or select models on "
                         "them; read them for evaluation with iter_prompts (MT-bench: mtbench_first_turns)")
    checked: list[str] = []
    if exclude_keys is None:
        exclude_keys, checked = evaluation_prompt_keys()
    seen: set[str] = set()
    rows: list[dict] = []
    counts: dict[str, SourceCount] = {}
    for name in names:
        count = counts[name] = SourceCount()
        for number, record in enumerate(iter_prompts(name)):
            if limit_per_source is not None and number >= limit_per_source:
                break
            count.read += 1
            key = prompt_key(record)
            if key in exclude_keys:
                count.test_overlap += 1
                continue
            if key in seen:
                count.duplicates += 1
                continue
            seen.add(key)
            side = split_of_key(key, validation_fraction, seed)
            setattr(count, side, getattr(count, side) + 1)
            if side == split:
                rows.append(record)
    return PromptSet(split, rows, counts, validation_fraction, seed, checked)


def mtbench_first_turns(root: str | Path | None = None) -> list[str]:
    """MT-bench's 80 first-turn questions, in question_id order: for evaluation only."""
    return [record["messages"][0]["content"] for record in iter_prompts("mtbench", root)]


# ----------------------------------------------------------------------------- data card

def card_data(prompts: PromptSet) -> dict:
    """What a data card states: per source its package, path, licence, flags and counts."""
    sources = []
    for name, count in prompts.counts.items():
        source = SOURCES[name]
        sources.append({"name": name, "kind": source.kind, "requirement": source.requirement, "path": source.path,
                        "licence": source.licence, "opt_in": source.opt_in, "note": source.note, **asdict(count)})
    return {"split_rule": "sha256 of the normalised first user turn",
            "validation_fraction": prompts.validation_fraction, "seed": prompts.seed,
            "test_sources_checked": prompts.test_sources_checked,
            "train": sum(c.train for c in prompts.counts.values()),
            "validation": sum(c.validation for c in prompts.counts.values()), "sources": sources}


def card_markdown(data: dict) -> str:
    lines = ["# Prompt set", "",
             f"{data['train']} training and {data['validation']} validation prompts (validation fraction "
             f"{data['validation_fraction']}, seed {data['seed']}; split and deduplicated by a hash of the "
             "normalised first user turn, earlier sources keeping shared prompts).", "",
             "Left out as equal to a test prompt: records of "
             + (", ".join(data["test_sources_checked"]) or "no test-only source (none installed)") + ".", "",
             "| source | kind | package | licence | read | duplicates | test overlap | train | validation |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for s in data["sources"]:
        licence = s["licence"] + (" (opt-in)" if s["opt_in"] else "")
        lines.append(f"| {s['name']} | {s['kind']} | `{s['requirement']}` | {licence} | {s['read']} | "
                     f"{s['duplicates']} | {s['test_overlap']} | {s['train']} | {s['validation']} |")
    lines += ["", "## What each source holds", ""]
    lines += [f"- **{s['name']}**: `{s['path']}`. {s['note']}".rstrip() for s in data["sources"]]
    return "\n".join(lines) + "\n"


def write_data_card(out: str | Path, prompts: PromptSet | None = None, **load_args) -> tuple[Path, Path]:
    """Write a data card as Markdown at `out` and as JSON beside it (same name, ``.json``).

    Args:
        prompts: the set to describe; default: ``load_prompts(**load_args)``.
    """
    prompts = prompts if prompts is not None else load_prompts(**load_args)
    data = card_data(prompts)
    return write_card_files(out, card_markdown(data), data)


def write_card_files(out: str | Path, markdown_text: str, data: dict) -> tuple[Path, Path]:
    """A card as Markdown at `out` (``.md`` in place of a ``.json`` name) and its data as JSON beside it."""
    out = Path(out)
    markdown = out if out.suffix != ".json" else out.with_suffix(".md")
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(markdown_text, encoding="utf-8")
    as_json = markdown.with_suffix(".json")
    as_json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return markdown, as_json


def source_table() -> list[dict]:
    """Every registered source: name, kind, requirement, installed or not, licence, flags, the
    rows measured when the registry was written (`streamspec data list`)."""
    return [{"name": s.name, "kind": s.kind, "requirement": s.requirement, "installed": s.installed(),
             "licence": s.licence, "opt_in": s.opt_in, "test_only": s.test_only, "rows": s.rows,
             "unavailable": s.unavailable} for s in SOURCES.values()]


def format_source_table(rows: list[dict] | None = None) -> str:
    """`source_table` as aligned text columns (`streamspec data list`)."""
    rows = source_table() if rows is None else rows
    header = ("source", "kind", "installed", "rows", "flags", "package", "licence")
    lines = [header]
    for r in rows:
        flags = ",".join(f for f, on in (("opt-in", r["opt_in"]), ("test-only", r["test_only"])) if on) or "-"
        installed = "unavailable" if r["unavailable"] else ("yes" if r["installed"] else "no")
        lines.append((r["name"], r["kind"], installed, "?" if r["rows"] is None else str(r["rows"]), flags,
                      r["requirement"], r["licence"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1] for line in lines)
