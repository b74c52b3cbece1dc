"""Readers of the chat-like sources: each yields (id, user turns) from the files of one package.

Only the user's side of a conversation is kept, in order: a distiller replays the turns and lets
the model write every reply, so the set holds the model's own text. System messages are folded
into the next user turn (a chat template may not take them); few-shot examples and the
assistant's replies are dropped.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path
from typing import IO, Iterator

logger = logging.getLogger(__name__)

Turns = tuple[str, list[str]]


class SourceUnavailable(RuntimeError):
    """A source whose package (or file) is not installed here, or which cannot be used at all."""


def iter_json_array(handle: IO[str], chunk_size: int = 1 << 20, max_item_chars: int = 1 << 26) -> Iterator:
    """The items of a JSON array read from a text stream one at a time, without holding the
    whole file. A file cut short (as ShareGPT's is, at 125 MB) ends cleanly: every complete
    item is yielded and the cut one is dropped.

    `json.JSONDecoder.raw_decode` parses one item at a position of a buffer; when an item runs
    past the buffer's end the parse fails, the buffer is extended by `chunk_size` characters
    and the parse retried. An item that still fails with `max_item_chars` characters after its
    start is malformed, not cut: ValueError.
    """
    decoder = json.JSONDecoder()
    buffer, pos, ended = "", 0, False

    def more() -> bool:
        """Append a chunk, dropping what was already parsed (one copy per chunk, not per item)."""
        nonlocal buffer, pos, ended
        chunk = handle.read(chunk_size)
        buffer, pos, ended = buffer[pos:] + chunk, 0, not chunk
        return bool(chunk)

    def skip(chars: str) -> bool:
        """Move past `chars`; False at the end of the stream."""
        nonlocal pos
        while True:
            while pos < len(buffer) and buffer[pos] in chars:
                pos += 1
            if pos < len(buffer):
                return True
            if ended or not more():
                return False

    if not skip(" \t\r\n"):
        return
    if buffer[pos] != "[":
        raise ValueError(f"expected a JSON array, found {buffer[pos:pos + 20]!r}")
    pos += 1
    while skip(" \t\r\n,") and buffer[pos] != "]":
        try:
            item, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            item, end = None, -1
        # a value that ends exactly at the buffer's end may go on (a number cut in two): read on,
        # and at the end of the stream take it only if it is closed (an object, array or string)
        if end < 0 or (end == len(buffer) and (not ended or buffer[end - 1].isdigit())):
            if ended:
                logger.info("JSON array cut short: stopped before its last, incomplete item")
                return
            if len(buffer) - pos > max_item_chars:
                raise ValueError(f"no valid JSON item in {max_item_chars} characters: {buffer[pos:pos + 80]!r}")
            more()
            continue
        yield item
        pos = end


def fold_messages(messages: list) -> list[str]:
    """User turns from OpenAI-style chat messages: system text joins the next user turn (or the
    last one, at the end; or is the only turn when there is no user message), messages named
    ``example_*`` (few-shot examples) and assistant replies are dropped."""
    turns: list[str] = []
    pending: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            continue
        if str(message.get("name", "")).startswith("example_") or message.get("role") == "assistant":
            continue
        text = message["content"].strip()
        if not text:
            continue
        if message.get("role") == "user":
            turns.append("\n\n".join(pending + [text]))
            pending = []
        else:
            pending.append(text)
    if pending:
        if turns:
            turns[-1] = "\n\n".join([turns[-1]] + pending)
        else:
            turns.append("\n\n".join(pending))
    return turns


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle):
            if line.strip():
                yield number, json.loads(line)


# ----------------------------------------------------------------------------- training sources

def sharegpt(root: Path, path: str) -> Iterator[Turns]:
    # errors="replace": the cut may split a UTF-8 character, and the cut item is dropped anyway
    with open(root / path, encoding="utf-8", errors="replace") as handle:
        for number, item in enumerate(iter_json_array(handle)):
            turns = [m["value"] for m in item.get("conversations") or []
                     if m.get("from") in ("human", "user") and isinstance(m.get("value"), str)]
            yield str(item.get("id", number)), turns


def chitchat(root: Path, path: str) -> Iterator[Turns]:
    conversations = json.loads((root / path).read_text(encoding="utf-8"))
    for key, conversation in conversations.items():
        groups = [g for g in conversation.get("messages") or [] if g]
        if not groups:
            continue
        first = groups[0][0]["sender"]
        yield key, ["\n".join(m["text"] for m in group) for group in groups if group[0]["sender"] == first]


# evals/registry/data folders left out of the `evals` source: those its LICENSE.md gives their own
# licences (some non-commercial), and sql/ (Spider test questions; CoSQL is its own source).
EVALS_LEFT_OUT = {
    "text_compression": "c4, OpenWebText, OSCAR, Wikipedia (CC BY-SA 3.0), github-code, english_quotes",
    "steganography": "several sets, two CC BY-NC 4.0",
    "schelling_point": "OpenWebText, Wikipedia (CC BY-SA 3.0)",
    "ballots": "California ballot propositions (public domain)",
    "sandbagging": "MMLU (MIT)",
    "theory_of_mind": "ToMi (CC BY-NC 4.0), Social IQA (CC BY 4.0)",
    "already_said_that": "WordNet licence",
    "sql": "Spider's test questions (spider_sql.jsonl); CoSQL is the cosql source",
}
EVALS_MAX_BYTES = 1_000_000  # "smaller tasks": the big files are generated puzzles (mazes, logic)


def openai_evals(root: Path, path: str) -> Iterator[Turns]:
    for file in sorted(root.glob(path)):
        folder = file.parent.name
        if folder in EVALS_LEFT_OUT or file.stat().st_size >= EVALS_MAX_BYTES:
            continue
        for number, row in _jsonl(file):
            given = row.get("input") if isinstance(row, dict) else None
            if isinstance(given, str):
                turns = [given]
            elif isinstance(given, list):
                turns = fold_messages(given)
            else:
                continue  # other layouts (games, generated items) are not prompts
            yield f"{folder}/{file.stem}:{number}", turns


_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")


def is_english(text: str) -> bool:
    """WritingBench rows carry no language field: a row is Chinese when more than 5% of its
    characters are CJK (the English rows quote a few such characters at most)."""
    return len(_CJK.findall(text)) <= 0.05 * max(1, len(text))


def writingbench(root: Path, path: str) -> Iterator[Turns]:
    for _, row in _jsonl(root / path):
        if is_english(row["query"]):
            yield str(row["index"]), [row["query"]]


# BFCL's multi-turn and web-search queries name classes whose function docs are in one file each
_BFCL_CLASS_DOCS = {
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
    "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control", "WebSearchAPI": "web_search",
}
_BFCL_SKIPPED = ("memory", "format_sensitivity", "multi_turn_long_context", "multi_turn_miss_func",
                 "multi_turn_miss_param")


def tools_message(functions: list[dict], question: str) -> str:
    """A function-calling query with the functions' JSON schemas before it."""
    schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return ("You can call the functions below (JSON schemas, one per line). To call one, answer with its name "
            f"and arguments as JSON.\n\n{schemas}\n\n{question}")


def bfcl(root: Path, path: str) -> Iterator[Turns]:
    docs_folder = root / Path(path).parent / "multi_turn_func_doc"
    for file in sorted(root.glob(path)):
        category = file.stem.removeprefix("BFCL_v4_")
        if category in _BFCL_SKIPPED:
            continue
        for _, row in _jsonl(file):
            functions = row.get("function")
            if functions is None:
                functions = [json.loads(line) for cls in row.get("involved_classes", [])
                             for line in (docs_folder / f"{_BFCL_CLASS_DOCS[cls]}.json").read_text().splitlines()
                             if line.strip()]
            turns = [t for group in row["question"] for t in fold_messages(group)]
            if turns:
                turns[0] = tools_message(functions, turns[0])
            yield row["id"], turns


# ----------------------------------------------------------------------------- test sets

def mtbench(root: Path, path: str) -> Iterator[Turns]:
    for _, row in _jsonl(root / path):
        yield str(row["question_id"]), list(row["turns"])


def humaneval(root: Path, path: str) -> Iterator[Turns]:
    for _, row in _jsonl(root / path):
        yield row["task_id"], ["Complete the following Python function.\n\n```python\n" + row["prompt"] + "```"]


def ifbench(root: Path, path: str) -> Iterator[Turns]:
    for _, row in _jsonl(root / path):
        yield str(row["key"]), [row["prompt"]]


def atis_geoquery(root: Path, path: str) -> Iterator[Turns]:
    for number, row in enumerate(json.loads((root / path).read_text(encoding="utf-8"))):
        yield str(number), [row["instruction"] + row.get("input", "")]
