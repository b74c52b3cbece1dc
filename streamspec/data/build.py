"""From rows of (prompt, completion) to tokenised training examples and padded batches.

- Prompts go through the tokenizer's chat template when it has one (the completion is the
  assistant's turn, closed by the template's end-of-turn token); otherwise prompt, a newline,
  completion and the EOS token.
- A distilled row's ``completion_ids`` (the tokens the model generated, its end-of-turn token
  included when it stopped) are taken as they are, not re-tokenised from the text.
- Labels are -100 on every prompt token: only the completion is trained, and so only completion
  positions (and the last prompt position) carry streams.
- Rows longer than `max_length` are dropped or truncated by an explicit setting, and the count is
  logged; a row left with no completion token is always dropped (and counted).
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

logger = logging.getLogger(__name__)

OVERFLOW = ("drop", "truncate")


def load_rows(
    path: str | list[str] | None = None,
    dataset: str | None = None,
    split: str = "train",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    messages_field: str | None = None,
) -> list[dict]:
    """Your own data as rows with ``prompt`` and ``completion``.

    Args:
        path: a .jsonl, .json (a list of objects) or .csv file, or a distilled set's shard folder
            (`streamspec distill --engine vllm --out FOLDER`: its rows keep their prompt, or chat
            messages, and the generated ids); or a list of them, read in order.
        dataset: a `datasets` name or local folder (with `split`), instead of a path.
        prompt_field, completion_field: the columns holding prompt and completion.
        messages_field: a column of chat messages ({"role", "content"}) instead: the last
            assistant message is the completion, the user messages before it the prompt.
    """
    if (path is None) == (dataset is None):
        raise ValueError("give exactly one of data.path (a .jsonl/.json/.csv file) or data.dataset (a datasets name)")
    if isinstance(path, (list, tuple)):
        if not path:
            raise ValueError("data.path is an empty list: name at least one file or distilled set folder")
        return [row for one in path for row in load_rows(path=one, prompt_field=prompt_field,
                                                          completion_field=completion_field, messages_field=messages_field)]
    if path is not None and Path(path).is_dir():
        from .distill import read_distilled
        from .distill_shards import training_row

        return [training_row(r) for r in read_distilled(path)]
    if path is not None:
        records = _read_file(Path(path))
    else:
        import datasets

        records = list(datasets.load_dataset(dataset, split=split))
    rows = []
    for i, record in enumerate(records):
        if messages_field:
            rows.append(_from_messages(record, messages_field, i))
            continue
        missing = [f for f in (prompt_field, completion_field) if not isinstance(record.get(f), str)]
        if missing:
            raise ValueError(f"row {i} has no text field(s) {missing}; its fields are {sorted(record)}")
        rows.append({"prompt": record[prompt_field], "completion": record[completion_field]})
    return rows


def _read_file(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of objects")
        return data
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as handle:
            return list(csv.DictReader(handle))
    raise ValueError(f"data file {path} must end in .jsonl, .json or .csv")


def _from_messages(record: dict, field: str, index: int) -> dict:
    messages = record.get(field)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"row {index} has no list of messages in field {field!r}")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        raise ValueError(f"row {index}: the last message must be an assistant message with text content")
    return {"messages": messages[:-1], "completion": last["content"]}


def format_prompt(tokenizer, row: dict) -> str:
    """The prompt text as the model sees it (chat template applied when there is one)."""
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n\n".join(m["content"] for m in messages) + "\n"


def prompt_ids(tokenizer, row: dict):
    """The prompt as decoding takes it: a [1, T] LongTensor of the formatted prompt's ids (no
    special tokens added beyond what the chat template writes)."""
    return tokenizer(format_prompt(tokenizer, row), return_tensors="pt", add_special_tokens=False).input_ids


def completion_suffix(tokenizer) -> str:
    """What closes a completion: the end-of-turn / EOS token."""
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer has no eos_token: completions could not be closed")
    return tokenizer.eos_token


@dataclass
class TokenizeStats:
    kept: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_completion: int = 0


def tokenize_rows(
    rows: Iterable[dict], tokenizer, max_length: int, overflow: str = "drop"
) -> tuple[list[dict], TokenizeStats]:
    """Rows → {"input_ids", "labels"} examples (labels -100 on the prompt)."""
    if overflow not in OVERFLOW:
        raise ValueError(f"data.overflow must be one of {list(OVERFLOW)}, got {overflow!r}")
    if max_length < 2:
        raise ValueError(f"data.max_length must be at least 2, got {max_length}")
    suffix = completion_suffix(tokenizer)
    stats = TokenizeStats()
    examples = []
    for row in rows:
        prompt = tokenizer(format_prompt(tokenizer, row), add_special_tokens=False).input_ids
        if row.get("completion_ids"):  # a distilled row: the model's own tokens, as it generated them
            completion = [int(t) for t in row["completion_ids"]]
        else:
            completion = tokenizer(row["completion"] + suffix, add_special_tokens=False).input_ids
        ids = prompt + completion
        labels = [-100] * len(prompt) + completion
        if len(ids) > max_length:
            if overflow == "drop":
                stats.dropped_too_long += 1
                continue
            ids, labels = ids[:max_length], labels[:max_length]
            if all(label == -100 for label in labels[1:]):
                stats.dropped_no_completion += 1
                continue
            stats.truncated += 1
        examples.append({"input_ids": ids, "labels": labels})
        stats.kept += 1
    return examples, stats


def log_stats(name: str, stats: TokenizeStats, max_length: int) -> None:
    logger.warning(
        "%s: %d examples kept; %d truncated, %d dropped as longer than max_length=%d, %d dropped with no completion "
        "token left",
        name, stats.kept, stats.truncated, stats.dropped_too_long, max_length, stats.dropped_no_completion,
    )


class PadCollator:
    """Right-pads input_ids (with pad_id), labels (-100) and builds attention_mask."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
