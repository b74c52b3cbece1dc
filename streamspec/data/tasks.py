"""The built-in tasks and their labelled rows, one registry for training, distillation and the
benchmark: ``sql`` (Spider, split by database), ``summarize`` (ACLSum), ``gsm8k_solutions``
(GSM8K worked solutions in SpecReason's step format) and, for the benchmark only, ``chat``
(MT-bench's first turns; chat streams train on distilled sets of `streamspec.data.sources`)."""

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


# The chat sources the shipped chat streams were distilled from (docs/training.md): the chat
# task's validation prompts are their held-out slice, so choosing a tree shape never reads a test set.
CHAT_SOURCES = ("chitchat", "evals", "writingbench", "bfcl")
CHAT_VALIDATION_MAX_CHARS = 2000


def _chat(split: str) -> list[dict]:
    """MT-bench's 80 first turns (test), or first user turns of the chat sources' validation slice
    (those up to `CHAT_VALIDATION_MAX_CHARS`); no reference replies: chat is measured for speed."""
    if split == "test":
        from .sources import mtbench_first_turns

        return [{"prompt": question} for question in mtbench_first_turns()]
    if split == "validation":
        from .sources import load_prompts

        firsts = (record["messages"][0]["content"] for record in load_prompts(list(CHAT_SOURCES), split="validation"))
        return [{"prompt": text} for text in firsts if len(text) <= CHAT_VALIDATION_MAX_CHARS]
    raise ValueError(f"task 'chat' has test (MT-bench's first turns) and validation rows, not {split!r}; chat "
                     "streams train on a distilled set (`streamspec distill --engine vllm --sources ...`, then "
                     "data.task: custom with data.path: FOLDER)")


TASK_ROWS: dict[str, Callable[[str], list[dict]]] = {"sql": _spider, "summarize": _aclsum,
                                                      "gsm8k_solutions": _gsm8k_solutions, "chat": _chat}


def task_rows(task: str, split: str) -> list[dict]:
    """A built-in task's labelled rows of one split (``train``, ``validation`` or ``test``)."""
    if task not in TASK_ROWS:
        raise ValueError(f"no built-in rows for task {task!r}; built-in tasks: {sorted(TASK_ROWS)}")
    return TASK_ROWS[task](split)
