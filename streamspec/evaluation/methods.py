"""The decoding methods the benchmark compares, as callables over the same prompts: transformers
`generate` (plain and with prompt lookup: `hf_method`), streamspec's decoders (`streaming_method`,
each row's `DecodeConfig` from `row_config`), and `run_methods`, which runs them side by side with
the methods interleaved per prompt so that machine noise hits all alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..data.build import prompt_ids
from ..decoding.config import DecodeConfig
from ..decoding.generate import generate


@dataclass
class MethodResult:
    name: str
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    passes: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens per pass, after prefill
    # streamspec only: seconds of the prefill calls, and of the decoding steps after them split
    # into the transformer layers, the LM / early-exit heads, and the rest
    split: dict[str, float] = field(default_factory=dict)
    prompts: int = 0
    # the pass proxies a CPU measures for a GPU (streamspec only; docs/gpu.md): device→host reads
    # and compiled-graph calls after the prefills, and the kernels inductor generated per graph
    # this method compiled in its warm-up (none: nothing compiled, or served from inductor's cache)
    counts: dict[str, int] = field(default_factory=dict)

    def summary(self, baseline_tps: float | None) -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        depth = {}
        for n in self.accepted:
            depth[n] = depth.get(n, 0) + 1
        timing = {}
        steps = self.passes - self.prompts
        if self.split and steps > 0:
            timing = {"ms_prefill": round(1000 * self.split["prefill"] / self.prompts, 1)}
            timing.update({f"ms_per_step_{k}": round(1000 * self.split[k] / steps, 2) for k in ("forward", "head", "overhead")})
            # host time a pass outside the model's (compiled) call: the read, the commit, the bookkeeping
            timing["ms_per_step_host"] = round(1000 * (self.split["head"] + self.split["overhead"]) / steps, 3)
        if "host_reads" in self.counts and steps > 0:
            timing["reads_per_step"] = round((self.counts["host_reads"] - self.prompts) / steps, 3)
            timing["graph_calls_per_step"] = round(self.counts["graph_calls"] / steps, 3)
        if self.counts.get("graphs_compiled"):
            timing["kernels_per_graph"] = round(self.counts["kernels_generated"] / self.counts["graphs_compiled"], 1)
        return {
            **timing,
            "tokens_per_second": round(tps, 2),
            "speedup": round(tps / baseline_tps, 3) if baseline_tps else None,
            "crr": round(self.tokens / self.passes, 3) if self.passes else None,
            "mean_tokens_per_pass": round(sum(self.accepted) / len(self.accepted), 3) if self.accepted else None,
            "accepted_per_pass_histogram": dict(sorted(depth.items())),
            "tokens": self.tokens,
            "passes": self.passes,
            "seconds": round(self.seconds, 2),
            "ms_per_pass": round(1000 * self.seconds / self.passes, 2) if self.passes else None,
        }


class CallCounter:
    """Counts forward calls of a module (how many passes transformers `generate` made) and times
    each (`durations`, seconds per call in order: the first call of a generation is its prefill)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self.durations: list[float] = []
        self._start = 0.0
        self._handles = [module.register_forward_pre_hook(self._count), module.register_forward_hook(self._done)]

    def _count(self, *args) -> None:
        self.calls += 1
        self._start = time.perf_counter()

    def _done(self, *args) -> None:
        self.durations.append(time.perf_counter() - self._start)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def hf_method(name: str, model, eos_token_id, **generate_kwargs) -> Callable:
    """A method that decodes with transformers `generate` (greedy) and counts its passes."""
    counter = CallCounter(model)

    device = next(model.parameters()).device

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], int, list[int], dict]:
        ids = ids.to(device)
        before, timed = counter.calls, len(counter.durations)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=eos_token_id, pad_token_id=eos_token_id, **generate_kwargs,
            )
        total = time.perf_counter() - start
        new = out[0, ids.shape[1]:].tolist()
        calls = counter.durations[timed:]
        # the model's own calls (the first is the prefill; the LM head is inside them) and the rest
        split = {"prefill": calls[0], "forward": sum(calls[1:]), "head": 0.0,
                 "overhead": max(total - sum(calls), 0.0)} if calls else {}
        return new, counter.calls - before, [], split

    run.__name__ = name
    return run


def row_config(base: DecodeConfig | None = None, **options) -> DecodeConfig:
    """A row's decode options: `base` (what the command gives every row: verify, compile) with the
    row's own. A pruned row cannot be compiled: it runs uncompiled (its summary entry says so);
    trees built on the host (lookup branches, a confidence budget) compile padded."""
    base = base or DecodeConfig()
    if (base.compile_backend is not None or base.compile == "auto") and options.get("prune_threshold") is not None:
        base = base.replace(compile=False)
    return base.replace(**options)


def streaming_method(model, eos_token_id, config: DecodeConfig | None = None, speculative: bool = True,
                     **options) -> Callable:
    """A method that decodes with `streamspec.decoding.generate`, with `config` (see `row_config`)
    and the row's own decode options."""

    device = next(model.parameters()).device
    config = row_config(config, **options).resolved(model, speculative=speculative)

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], int, list[int], dict]:
        out = generate(model, ids.to(device), max_new_tokens, eos_token_id=eos_token_id, speculative=speculative,
                       config=config)
        split = {}
        if out.forward_seconds_per_pass:  # the first call is the prefill
            split = {"prefill": out.seconds_per_pass[0], "forward": sum(out.forward_seconds_per_pass[1:]),
                     "head": sum(out.head_seconds_per_pass[1:]), "overhead": sum(out.overhead_seconds_per_pass[1:])}
            split.update(host_reads=out.host_reads, graph_calls=out.graph_calls)
        return out.tokens[0].tolist(), out.forward_passes, out.accepted_per_pass[1:], split

    run.config = config
    return run


def run_methods(methods: dict[str, Callable], tokenizer, rows: list[dict], max_new_tokens: int,
                on_prompt: Callable[[dict[str, MethodResult], int], None] | None = None) -> dict[str, MethodResult]:
    """Every method on every prompt, methods interleaved per prompt so machine noise hits all alike.
    Each method first decodes, untimed, the first prompt and the first of each further cache size
    the run needs (`_warm_up_prompts`), so that no method pays for first-call costs
    (allocations, kernel set-up, a compiled row's compilation per cache size) that another does
    not. `on_prompt` is
    called with the results so far after each prompt (a long run saves them as it goes)."""
    results = {name: MethodResult(name) for name in methods}
    for ids in _warm_up_prompts(tokenizer, rows, max_new_tokens):
        for name, method in methods.items():
            with _KernelCount(results[name]):
                method(ids, max_new_tokens)
    for row in tqdm(rows, desc="benchmark", unit="prompt"):
        ids = prompt_ids(tokenizer, row)
        for name, method in methods.items():
            start = time.perf_counter()
            new, passes, accepted, split = method(ids, max_new_tokens)
            r = results[name]
            r.prompts += 1
            for part, value in split.items():
                if part in ("host_reads", "graph_calls"):
                    r.counts[part] = r.counts.get(part, 0) + value
                else:
                    r.split[part] = r.split.get(part, 0.0) + value
            r.seconds += time.perf_counter() - start
            r.tokens += len(new)
            r.passes += passes
            r.accepted.extend(accepted)
            r.token_ids.append(new)
            r.texts.append(tokenizer.decode(new, skip_special_tokens=True))
        if on_prompt is not None:
            on_prompt(results, results[next(iter(results))].prompts)
    return results




class _KernelCount:
    """Around a warm-up call: the kernels inductor generated for the graphs it compiled, counted in
    the method's `counts` (its summary's ``kernels_per_graph``: a load-independent proxy of a
    pass's GPU cost).
    Graphs served from inductor's on-disk cache generate nothing and are not counted."""

    def __init__(self, result: MethodResult) -> None:
        self.result = result

    def __enter__(self):
        from torch._inductor import metrics

        from ..decoding.graphs import graphs_called

        self.kernels, self.graphs = metrics.generated_kernel_count, graphs_called()
        return self

    def __exit__(self, *exc) -> None:
        from torch._inductor import metrics

        from ..decoding.graphs import graphs_called

        kernels, graphs = metrics.generated_kernel_count - self.kernels, graphs_called() - self.graphs
        if kernels > 0 and graphs > 0:
            counts = self.result.counts
            counts["kernels_generated"] = counts.get("kernels_generated", 0) + kernels
            counts["graphs_compiled"] = counts.get("graphs_compiled", 0) + graphs


def _warm_up_prompts(tokenizer, rows: list[dict], max_new_tokens: int) -> list[torch.Tensor]:
    """The untimed warm-up's prompts: the first, then the first of each further cache size the run
    will need (`streamspec.decoding.compiled.compiled_capacity`: the same for every method whose
    pass fits in its room): a compiled pass compiles once per cache size, and this way every size
    is met before the timed prompts (a tree of more rows than `COMPILED_ROOM` may still meet a
    new one, announced on stderr)."""
    from ..decoding.compiled import compiled_capacity

    chosen, seen = [], set()
    for row in rows:
        ids = prompt_ids(tokenizer, row)
        bucket = compiled_capacity(ids.shape[1] + max_new_tokens)
        if bucket not in seen:
            seen.add(bucket)
            chosen.append(ids)
    return chosen


def with_default_kernels(method: Callable, model) -> Callable:
    """`method` run with torch's default linear kernels in `model` (see `streamspec.kernels`)."""
    from ..kernels import default_kernels

    def run(ids: torch.Tensor, max_new_tokens: int):
        with default_kernels(model):
            return method(ids, max_new_tokens)

    return run
