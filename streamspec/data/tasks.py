"""The built-in tasks and their labelled rows, one registry for training, distillation and the
benchmark: ``sql`` (Spider, split by database), ``summarize`` (ACLSum) and ``gsm8k_solutions``
(GSM8K worked solutions in SpecReason's step format)."""

from __future__ import annotations

from typing import Callable


def _spider(split: str) -> list[dict]:
    from .spider import load_spider

    return load_spider(split)


def _aclsum(split: str) -> list[dict]:
    from .aclsum import load_aclsum

    return load_aclsum(split)


def _gsm8k_solutions(split: str) -> list[dict]:
    from .reasoning import load_gsm8k_solutions

    return load_gsm8k_solutions(split)


TASK_ROWS: dict[str, Callable[[str], list[dict]]] = {"sql": _spider, "summarize": _aclsum,
                                                      "gsm8k_solutions": _gsm8k_solutions}


def task_rows(task: str, split: str) -> list[dict]:
    """A built-in task's labelled rows of one split (``train``, ``validation`` or ``test``)."""
    if task not in TASK_ROWS:
        raise ValueError(f"no built-in rows for task {task!r}; built-in tasks: {sorted(TASK_ROWS)}")
    return TASK_ROWS[task](split)
