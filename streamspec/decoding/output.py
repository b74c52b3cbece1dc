"""What a decoding call returns (`GenerateOutput`) and the host's side of a pass: the one read
from the device per pass (`read_to_host`), the stop tokens and where the kept tokens end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def read_to_host(values: torch.Tensor) -> list:
    """A read from the device (as a list). The device step makes one per pass (what was accepted,
    whether to stop); the host walk (`verify="host"`) reads at each node it visits. Tests count
    the reads."""
    return values.tolist()


def pack_host_read(summary: torch.Tensor, candidates: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
    """A pass's one read when the host builds the next tree: the verify summary [D+2], the next
    candidates [depth, width] and, for a confidence budget, their scores, flat in one vector."""
    parts = [summary.double(), candidates.flatten().double()]
    if scores is not None:
        parts.append(scores.flatten().double())
    return torch.cat(parts)


def split_host_read(values: list, summary_length: int, width: int, depth: int, with_scores: bool):
    """`pack_host_read`'s vector, read on the host, back into the summary (ints), the candidates
    (``[depth][width]`` ints) and the scores (``[depth][width]`` floats, or None)."""
    summary, rest = [int(v) for v in values[:summary_length]], values[summary_length:]
    candidates = [[int(v) for v in rest[d * width : (d + 1) * width]] for d in range(depth)]
    scores = None
    if with_scores:
        rest = rest[depth * width :]
        scores = [rest[d * width : (d + 1) * width] for d in range(depth)]
    return summary, candidates, scores


def stop_set(eos_token_id: int | list[int] | None) -> set[int]:
    """The token ids that end a text: one id, a list of them, or none."""
    return set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])



@dataclass
class GenerateOutput:
    """Generated tokens and what it took.

    Attributes:
        tokens: [1, n] the new tokens (EOS included when it ended the text).
        forward_passes: model calls, prefill included.
        accepted_per_pass: tokens each call added (prefill: 1).
        nodes_per_pass: draft-tree nodes before and after pruning, per call after prefill.
        seconds_per_pass: wall time of each call, prefill included.
        lengths: for a batch, the number of real tokens of each row of `tokens`.
        forward_seconds_per_pass / head_seconds_per_pass: of each call's time, the part in the
            transformer layers and the part in the LM head and early-exit head (speculative decoding
            of one sequence, or one token per pass; on an accelerator only with ``profile=True``).
            The rest is `overhead_seconds_per_pass`.
        host_reads: device→host reads the loop made (`read`), prefill included.
        graph_calls: compiled-graph calls the loop made (0 uncompiled).
    """

    tokens: torch.Tensor
    forward_passes: int
    accepted_per_pass: list[int] = field(default_factory=list)
    nodes_per_pass: list[tuple[int, int]] = field(default_factory=list)
    seconds_per_pass: list[float] = field(default_factory=list)
    lengths: list[int] | None = None
    forward_seconds_per_pass: list[float] = field(default_factory=list)
    head_seconds_per_pass: list[float] = field(default_factory=list)
    host_reads: int = 0
    graph_calls: int = 0

    def read(self, values: torch.Tensor) -> list:
        """`read_to_host`, counted in `host_reads` (the loops read through it; the benchmark
        prints reads a pass, which a GPU pays as a sync each)."""
        self.host_reads += 1
        return read_to_host(values)

    @property
    def overhead_seconds_per_pass(self) -> list[float]:
        """Per call, the time outside the transformer layers and the LM/early-exit heads: tree
        building, masks, verification bookkeeping, cache moves."""
        return [max(t - f - h, 0.0) for t, f, h in zip(self.seconds_per_pass, self.forward_seconds_per_pass,
                                                         self.head_seconds_per_pass)]

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens.shape[1] / max(self.forward_passes, 1)


def _within_limits(new: list[int], before: int, max_new_tokens: int, stop: set[int]) -> list[int]:
    """The part of `new` that the output keeps: up to max_new_tokens in all, and through the first
    stop token."""
    new = new[: max(max_new_tokens - before, 0)]
    for i, token in enumerate(new):
        if token in stop:
            return new[: i + 1]
    return new


def commit_pass(cache, past: int, new: list[int], paths, generated: list[int], max_new_tokens: int, stop: set[int],
                on_tokens) -> tuple[int, bool]:
    """The end of a speculative pass, the same in every loop: keep the accepted path's entries in
    the cache (`paths`: ``(node indices, layers or None)``), hand the new tokens to `on_tokens`
    (cut at the limit and after a stop token), extend `generated`. Returns the cache's new length
    and whether the text ended (a stop token, or `on_tokens` said stop)."""
    for path, layers in paths:
        cache.keep(past, path, layers, length=len(new))
    stopped = on_tokens is not None and bool(on_tokens(_within_limits(new, len(generated), max_new_tokens, stop)))
    generated.extend(new)
    return past + len(new), stopped or any(t in stop for t in new)


def record_pass(out: "GenerateOutput", new: list[int], nodes: tuple[int, int], start: float, forward_done: float,
                head_done: float, end: float, head_seconds: float = 0.0) -> None:
    """Count one pass in `out`: tokens accepted, tree nodes (before and after pruning), and its
    time split (the model, the heads, the rest); `head_seconds` spent inside the forward part
    (pruning's early-exit head) counts as head time."""
    out.forward_passes += 1
    out.accepted_per_pass.append(len(new))
    out.nodes_per_pass.append(nodes)
    out.seconds_per_pass.append(end - start)
    out.forward_seconds_per_pass.append(forward_done - start - head_seconds)
    out.head_seconds_per_pass.append(head_done - forward_done + head_seconds)
