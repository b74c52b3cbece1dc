"""What a speculative loop of one sequence takes and hands on: its options (`Speculation`), the
state the prefill leaves for the loop (`Prefilled`), and the host's side of a pass's commit
(`commit_tokens`), shared by the uncompiled loop (`streamspec.decoding.loop`) and the compiled
ones (`streamspec.decoding.compiled`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .lookup import NgramIndex, PromptLookup
from .output import GenerateOutput, _within_limits
from .sampling import Sampler


class Clock:
    """perf_counter, after waiting for the device when profiling on an accelerator (there kernels
    run asynchronously, so unsynchronised times only say when work was queued)."""

    def __init__(self, device: torch.device, profile: bool) -> None:
        self.sync = profile and device.type == "cuda"

    def __call__(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class Speculation:
    """How `speculate` decodes one sequence (checked by the caller: `generate`, a `DecodingSession`).

    Attributes:
        max_new_tokens: the most tokens it adds.
        sampler: how the main stream chooses (greedy, or keyed draws).
        shape: the stream tree's candidates per depth (`streamspec.decoding.tree.tree_shape`).
        stop: the tokens that end the text.
        on_tokens: called with each pass's accepted tokens (cut at the limit and after a stop
            token); returning True stops after that pass.
        clock: what times the passes (`Clock`).
        compile: the compile backend, or None (uncompiled).
        prune_threshold: early-exit pruning (uncompiled only).
        lookup: prompt-lookup branches merged into each pass's tree.
        tree_budget: each pass's tree grown by confidence to this many nodes.
        host_walk: verify with the host walk (`streamspec.decoding.verify.walk_on_host`).
        history: the text before the new tokens (the entries the cache holds), for the lookup.
    """

    max_new_tokens: int
    sampler: Sampler
    shape: tuple[int, ...]
    stop: set[int] = field(default_factory=set)
    on_tokens: Callable[[list[int]], bool | None] | None = None
    clock: Callable[[], float] = time.perf_counter
    compile: str | None = None
    prune_threshold: float | None = None
    lookup: PromptLookup | None = None
    tree_budget: int | None = None
    host_walk: bool = False
    history: list[int] | None = None

    @property
    def host_tree(self) -> bool:
        """Whether each pass's tree is built on the host (lookup branches, a confidence budget)."""
        return self.lookup is not None or self.tree_budget is not None


@dataclass
class Prefilled:
    """What the prefill leaves for a loop: the output so far, the tokens generated (the root),
    the cache's stored entries, the root [1] and the first draft's candidates [D, k] on the
    device, and for a tree built on the host their host copies (with scores for a confidence
    budget) and the text's n-gram index (lookup)."""

    out: GenerateOutput
    generated: list[int]
    past: int
    root: torch.Tensor
    candidates: torch.Tensor
    ended: bool
    host_candidates: list[list[int]] | None = None
    host_scores: list[list[float]] | None = None
    text: NgramIndex | None = None


def commit_tokens(run: Speculation, generated: list[int], new: list[int]) -> bool:
    """The host's part of a pass's commit: hand the new tokens to `on_tokens` (cut at the limit
    and after a stop token) and extend `generated`. Returns whether the text ended."""
    stopped = run.on_tokens is not None and bool(
        run.on_tokens(_within_limits(new, len(generated), run.max_new_tokens, run.stop)))
    generated.extend(new)
    return stopped or any(t in run.stop for t in new)


def finish(out: GenerateOutput, run: Speculation, generated: list[int], past: int, like: torch.Tensor):
    """`speculate`'s return: the output with its kept tokens, the cache's stored entries, the kept
    tokens as a list."""
    kept = _within_limits(generated, 0, run.max_new_tokens, run.stop)
    out.tokens = torch.tensor([kept], dtype=like.dtype, device=like.device)
    return out, past, kept
