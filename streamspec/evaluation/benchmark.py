"""Side-by-side speed and quality of decoding methods on the same held-out prompts (batch 1,
greedy), in one process: what `streamspec eval` runs.

Methods:
- ``baseline``: transformers `generate` on the model users would run today (the next-token LoRA
  fine-tune given as ``baseline``, or the unpatched base for a lossless checkpoint): speedup 1.0;
- ``baseline_default_kernels``: the same, with torch's default CPU linear kernels, when the others
  run with streamspec's packed oneDNN kernels (`streamspec.kernels`, on by default on a CPU): every
  other method uses the same kernels as ``baseline``, so their speedups are the decoding method's
  own, and this row shows what the kernels alone give;
- ``prompt_lookup``: transformers prompt-lookup decoding on that same model;
- ``streamed_ar``: the streamed model, one token per pass (speculative=False);
- ``chain``, ``tree``, ``tree_pruned``: speculative streaming with tree_top_k 1, the given tree (or
  with ``"auto"`` the fastest shape on validation prompts), and that tree with the pruning
  threshold chosen on validation prompts;
- ``tree_lookup``: that tree with prompt-lookup branches merged in (`streamspec.decoding.lookup`), the
  branch length, number of matches and node budget given or (``"auto"``) the fastest of
  `LOOKUP_CANDIDATES` on validation prompts;
- ``tree_confidence``: each pass's tree grown by confidence from 3 candidates per stream
  (`streamspec.decoding.tree.grow_tree`), its node budget given or (``"auto"``) the fastest of
  `BUDGET_CANDIDATES` on validation prompts;
- ``medusa``: Medusa heads (`streamspec.patch.medusa`) on the baseline's model, when a Medusa
  checkpoint is given, decoded through the same tree verifier with the ``tree`` row's shape (with
  ``"auto"``: its own fastest shape on the validation prompts).

Every draft method reports ``draft_parameters``: the parameters it adds to the model (streams with
their adapters; the heads).

Each method reports tokens/s, walltime speedup over the baseline, CRR (generated tokens ÷ forward
passes), mean tokens per pass, acceptance by depth, whether its outputs equal the streamed
model's autoregressive outputs, and quality (SQL exact match and validity, or ROUGE). For
streamspec's decoders it also splits the time: the prefill call per prompt, then per decoding
step the transformer layers, the LM / early-exit heads and the rest (tree, masks, cache moves).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..data.build import prompt_ids
from ..decoding.config import DecodeConfig
from ..decoding.generate import generate
from .metrics import sql_exact_match, sql_is_valid
from ..decoding.lookup import PromptLookup
from ..decoding.tree import tree_shape


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
    """Counts forward calls of a module (how many passes transformers `generate` made)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = module.register_forward_pre_hook(self._count)

    def _count(self, *args) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def hf_method(name: str, model, eos_token_id, **generate_kwargs) -> Callable:
    """A method that decodes with transformers `generate` (greedy) and counts its passes."""
    counter = CallCounter(model)

    device = next(model.parameters()).device

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], int, list[int], dict]:
        ids = ids.to(device)
        before = counter.calls
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=eos_token_id, pad_token_id=eos_token_id, **generate_kwargs,
            )
        new = out[0, ids.shape[1]:].tolist()
        return new, counter.calls - before, [], {}

    run.__name__ = name
    return run


def row_config(base: DecodeConfig | None = None, **options) -> DecodeConfig:
    """A row's decode options: `base` (what the command gives every row: verify, compile) with the
    row's own. A row whose tree is built on the host (lookup branches, a confidence budget) or
    pruned cannot be compiled: it runs uncompiled (its summary entry says so)."""
    base = base or DecodeConfig()
    if base.compile_backend is not None and any(options.get(k) is not None for k in ("lookup", "tree_budget",
                                                                                   "prune_threshold")):
        base = base.replace(compile=False)
    return base.replace(**options)


def streaming_method(model, eos_token_id, config: DecodeConfig | None = None, speculative: bool = True,
                     **options) -> Callable:
    """A method that decodes with `streamspec.decoding.generate`, with `config` (see `row_config`)
    and the row's own decode options."""

    device = next(model.parameters()).device
    config = row_config(config, **options)
    if not speculative:
        config = config.replace(compile=False)  # one token per pass runs uncompiled

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], int, list[int], dict]:
        out = generate(model, ids.to(device), max_new_tokens, eos_token_id=eos_token_id, speculative=speculative,
                       config=config)
        split = {}
        if out.forward_seconds_per_pass:  # the first call is the prefill
            split = {"prefill": out.seconds_per_pass[0], "forward": sum(out.forward_seconds_per_pass[1:]),
                     "head": sum(out.head_seconds_per_pass[1:]), "overhead": sum(out.overhead_seconds_per_pass[1:])}
        return out.tokens[0].tolist(), out.forward_passes, out.accepted_per_pass[1:], split

    run.config = config
    return run


def run_methods(methods: dict[str, Callable], tokenizer, rows: list[dict], max_new_tokens: int,
                on_prompt: Callable[[dict[str, MethodResult], int], None] | None = None) -> dict[str, MethodResult]:
    """Every method on every prompt, methods interleaved per prompt so machine noise hits all alike.
    Each method first decodes a few tokens of the first prompt, untimed, so that no method pays
    for first-call costs (allocations, kernel set-up) that another does not. `on_prompt` is
    called with the results so far after each prompt (a long run saves them as it goes)."""
    results = {name: MethodResult(name) for name in methods}
    if rows:
        ids = prompt_ids(tokenizer, rows[0])
        for method in methods.values():
            method(ids, 4)
    for row in tqdm(rows, desc="benchmark", unit="prompt"):
        ids = prompt_ids(tokenizer, row)
        for name, method in methods.items():
            start = time.perf_counter()
            new, passes, accepted, split = method(ids, max_new_tokens)
            r = results[name]
            r.prompts += 1
            for part, seconds in split.items():
                r.split[part] = r.split.get(part, 0.0) + seconds
            r.seconds += time.perf_counter() - start
            r.tokens += len(new)
            r.passes += passes
            r.accepted.extend(accepted)
            r.token_ids.append(new)
            r.texts.append(tokenizer.decode(new, skip_special_tokens=True))
        if on_prompt is not None:
            on_prompt(results, results[next(iter(results))].prompts)
    return results


def quality(task: str, rows: list[dict], texts: list[str]) -> dict:
    """SQL exact match and validity, or ROUGE-1/2/L/Lsum F1 (in %). A user's rows (prompt and
    completion only) are matched against their completion; validity needs a schema, so it is
    reported only when every row has one."""
    if task == "sql":
        n = max(len(rows), 1)
        matched = sum(sql_exact_match(t, r.get("query", r["completion"])) for t, r in zip(texts, rows))
        out = {"exact_match": round(100 * matched / n, 2)}
        if all("schema" in r for r in rows):
            out["valid"] = round(100 * sum(sql_is_valid(t, r["schema"]) for t, r in zip(texts, rows)) / n, 2)
        return out
    from rouge_score import rouge_scorer

    kinds = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
    scorer = rouge_scorer.RougeScorer(kinds, use_stemmer=True)
    totals = dict.fromkeys(kinds, 0.0)
    for text, row in zip(texts, rows):
        scores = scorer.score(row["completion"], text)
        for k in kinds:
            totals[k] += scores[k].fmeasure
    return {k: round(100 * v / max(len(rows), 1), 2) for k, v in totals.items()}


def report(
    task: str, rows: list[dict], results: dict[str, MethodResult], reference: str = "streamed_ar",
    baseline_is_base: bool = False,
) -> dict:
    """Summaries per method, the baseline being ``baseline`` when present. With
    `baseline_is_base` (a lossless checkpoint measured against its own base), every method also
    reports whether its tokens are the baseline's."""
    base = results.get("baseline")
    base_tps = base.tokens / base.seconds if base and base.seconds else None
    out = {}
    for name, r in results.items():
        entry = r.summary(base_tps)
        if reference in results and name != "prompt_lookup" and not name.startswith("baseline"):
            entry["identical_to_autoregressive"] = r.token_ids == results[reference].token_ids
        if base is not None and name != "baseline" and (name == "baseline_default_kernels" or baseline_is_base):
            entry["identical_to_baseline"] = r.token_ids == base.token_ids
        entry.update(quality(task, rows, r.texts))
        out[name] = entry
    return out


def markdown_table(summary: dict) -> str:
    """One row per method: speed, CRR, exactness, quality, and where each pass's time goes."""
    columns = ["tokens_per_second", "speedup", "crr", "mean_tokens_per_pass", "identical_to_autoregressive", "ms_per_pass",
               "ms_prefill", "ms_per_step_forward", "ms_per_step_head", "ms_per_step_overhead"]
    if any("identical_to_baseline" in entry for entry in summary.values()):
        columns.insert(5, "identical_to_baseline")
    if any("draft_parameters" in entry for entry in summary.values()):
        columns.append("draft_parameters")
    quality_keys = [k for k in next(iter(summary.values())) if k in ("exact_match", "valid", "rouge1", "rouge2", "rougeL", "rougeLsum")]
    head = ["method", *columns, *quality_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in summary.items():
        label = name
        if "tree_top_k" in entry:
            label += f" {entry['tree_top_k']}"
        if "prune_threshold" in entry:
            label += f" (threshold {entry['prune_threshold']})"
        cells = ["" if entry.get(c) is None else str(entry[c]) for c in columns + quality_keys]
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def save_report(summary: dict, out_dir: str | Path, sweep: list[dict] | None = None) -> dict[str, Path]:
    """JSON, Markdown and PNG plots (speedup and CRR against tree_top_k; tokens-per-pass histogram)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "benchmark.json", "markdown": out / "benchmark.md"}
    paths["json"].write_text(json.dumps({"methods": summary, "sweep": sweep or []}, indent=2) + "\n")
    paths["markdown"].write_text(markdown_table(summary) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = [name for name in (*DRAFT_METHODS, "medusa") if summary.get(name, {}).get("accepted_per_pass_histogram")]
    width = 0.8 / max(len(drawn), 1)
    for i, name in enumerate(drawn):
        histogram = summary[name]["accepted_per_pass_histogram"]
        ax.bar([int(k) - 0.4 + width * (i + 0.5) for k in histogram], list(histogram.values()), width=width, label=name)
    ax.set_xlabel("tokens accepted per pass")
    ax.set_ylabel("passes")
    ax.legend()
    fig.tight_layout()
    paths["histogram"] = out / "tokens_per_pass.png"
    fig.savefig(paths["histogram"], dpi=120)
    plt.close(fig)

    # every method side by side: walltime speedup over the baseline and CRR
    names = [n for n, e in summary.items() if e.get("speedup") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "speedup", "walltime speedup over the baseline"), (axes[1], "crr", "CRR (tokens per pass)")):
        ax.barh(names, [summary[n][key] or 0 for n in names])
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_title(title)
    fig.tight_layout()
    paths["methods"] = out / "methods.png"
    fig.savefig(paths["methods"], dpi=120)
    plt.close(fig)

    if sweep:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for pruned in (False, True):
            points = sorted((p["tree_top_k"], p) for p in sweep if p["pruned"] == pruned)
            label = "pruned" if pruned else "no pruning"
            axes[0].plot([k for k, _ in points], [p["speedup"] for _, p in points], marker="o", label=label)
            axes[1].plot([k for k, _ in points], [p["crr"] for _, p in points], marker="o", label=label)
        for ax, title in zip(axes, ("walltime speedup", "CRR")):
            ax.set_xticks(sorted({p["tree_top_k"] for p in sweep}))
            ax.set_xlabel("tree_top_k")
            ax.set_title(title)
            ax.legend()
        fig.tight_layout()
        paths["sweep"] = out / "speedup_vs_tree_top_k.png"
        fig.savefig(paths["sweep"], dpi=120)
        plt.close(fig)
    return paths


def held_out_rows(task: str, data: str | None = None, split: str = "test", schema_style: str = "spider") -> list[dict]:
    """Prompts to benchmark: Spider's held-out databases (their schemas in `schema_style`, see
    `streamspec.data.schema_styles`), ACLSum, or a JSONL file with prompt and completion fields."""
    if schema_style != "spider" and (task != "sql" or data is not None):
        raise ValueError(f"schema_style {schema_style!r} re-renders Spider prompts: it needs task 'sql' and no data file")
    if data is not None:
        from ..data.build import load_rows

        return load_rows(path=data)
    if task == "sql" and schema_style != "spider":
        from ..data.schema_styles import styled_spider_rows

        return styled_spider_rows(schema_style, split)
    if task == "sql":
        from ..data.spider import load_spider

        return load_spider(split)
    if task == "summarize":
        from ..data.aclsum import load_aclsum

        return load_aclsum(split)
    raise ValueError(f"task must be 'sql' or 'summarize' (or give data=FILE), got {task!r}")


# Shapes `tree_top_k="auto"` tries on validation prompts: wide at the next token, where the streams
# are surest, narrow below (see docs/benchmarks.md), and the paper's full trees.
TREE_CANDIDATES = (1, (2, 1, 1), (3, 1, 1), (4, 1, 1), (6, 1, 1), (3, 2, 1), 2, 3)


def _pick_fastest(results: dict[str, MethodResult]) -> tuple[str, dict[str, dict]]:
    """The name of the method with the best tokens/s, and every method's tokens/s and CRR."""
    table = {name: {"tokens_per_second": round(r.tokens / max(r.seconds, 1e-9), 2),
                    "crr": round(r.tokens / max(r.passes, 1), 3)} for name, r in results.items()}
    return max(table, key=lambda name: table[name]["tokens_per_second"]), table


def choose_config(model, tokenizer, rows: list[dict], candidates: dict[str, DecodeConfig],
                  max_new_tokens: int) -> tuple[str, dict]:
    """The candidate decode config with the best tokens/s on validation prompts (never the test
    ones): its name, and each candidate's tokens/s and CRR. The `choose_*` functions below are
    this chooser over one option's candidates."""
    methods = {name: streaming_method(model, tokenizer.eos_token_id, config=c) for name, c in candidates.items()}
    return _pick_fastest(run_methods(methods, tokenizer, rows, max_new_tokens))


def choose_tree(model, tokenizer, rows: list[dict], candidates, max_new_tokens: int,
                base: DecodeConfig | None = None) -> tuple[int | tuple[int, ...], dict]:
    """The tree shape with the best tokens/s on validation prompts (never the test ones), among
    the candidates that fit the model's number of streams; and each candidate's tokens/s and CRR."""
    g = model.stream_config.num_streams
    shapes = {str(c): c for c in candidates if isinstance(c, int) or len(c) <= g}
    if not shapes:
        raise ValueError(f"none of the tree shapes {candidates} fits a model with {g} streams")
    best, table = choose_config(model, tokenizer, rows, {n: row_config(base, tree_top_k=c) for n, c in shapes.items()},
                                max_new_tokens)
    return shapes[best], table


# Lookup settings tried on validation prompts: branch length L, matches M, and a node budget.
LOOKUP_CANDIDATES = (PromptLookup(4, 1), PromptLookup(8, 1), PromptLookup(8, 2), PromptLookup(12, 2),
                     PromptLookup(16, 3, budget=32))
DEFAULT_LOOKUP = PromptLookup(8, 2)

# Node budgets tried on validation for the confidence-shaped tree (3 candidates per stream).
BUDGET_CANDIDATES = (3, 4, 6, 8, 12, 16)
DEFAULT_BUDGET = 6
CONFIDENCE_TOP_K = 3


def choose_budget(model, tokenizer, rows: list[dict], candidates, max_new_tokens: int,
                  base: DecodeConfig | None = None) -> tuple[int, dict]:
    """The confidence tree's node budget with the best tokens/s on validation prompts; and each
    budget's tokens/s and CRR."""
    configs = {str(b): row_config(base, tree_top_k=CONFIDENCE_TOP_K, tree_budget=b) for b in candidates}
    best, table = choose_config(model, tokenizer, rows, configs, max_new_tokens)
    return int(best), table


def lookup_name(lookup: PromptLookup) -> str:
    """``L,M,N`` (and ``/budget``) as the command line writes it."""
    return f"{lookup.tokens},{lookup.matches},{lookup.ngram}" + (f"/{lookup.budget}" if lookup.budget else "")


def choose_lookup(model, tokenizer, rows: list[dict], tree_top_k, candidates, max_new_tokens: int,
                  base: DecodeConfig | None = None) -> tuple[PromptLookup, dict]:
    """The lookup setting with the best tokens/s on validation prompts (never the test ones), with
    the stream tree `tree_top_k`; and each setting's tokens/s and CRR."""
    settings = {lookup_name(c): c for c in candidates}
    configs = {name: row_config(base, tree_top_k=tree_top_k, lookup=c) for name, c in settings.items()}
    best, table = choose_config(model, tokenizer, rows, configs, max_new_tokens)
    return settings[best], table


def choose_threshold(model, tokenizer, rows: list[dict], tree_top_k, thresholds: list[float],
                     max_new_tokens: int, base: DecodeConfig | None = None) -> tuple[float, dict]:
    """The pruning threshold with the best tokens/s on validation prompts (never the test ones);
    and each threshold's tokens/s and CRR."""
    configs = {f"{t}": row_config(base, tree_top_k=tree_top_k, prune_threshold=t) for t in thresholds}
    best, table = choose_config(model, tokenizer, rows, configs, max_new_tokens)
    return float(best), table


def run_benchmark(
    checkpoint: str,
    task: str = "sql",
    data: str | None = None,
    baseline: str | None = None,
    limit: int | None = 50,
    validation_limit: int = 10,
    tree_top_k: int | tuple[int, ...] | str = 3,
    thresholds: tuple[float, ...] = (0.01, 0.05, 0.1, 0.2),
    sweep_top_k: tuple[int, ...] = (),
    lookup: PromptLookup | str | None = "auto",
    tree_budget: int | str | None = "auto",
    max_new_tokens: int = 128,
    out_dir: str | None = None,
    cpu_kernels: bool = True,
    device: str = "auto",
    dtype: str = "auto",
    medusa: str | None = None,
    schema_style: str = "spider",
    decode: DecodeConfig | None = None,
) -> dict:
    """The whole side-by-side benchmark; see the module docstring. Returns the summary.

    Args:
        checkpoint: a streamed checkpoint (a folder, or shipped weights: ``streamspec:NAME``).
        baseline: a peft adapter folder of the next-token fine-tune on the same base; default the
            unpatched base model (the right baseline for a lossless checkpoint).
        limit / validation_limit: how many test / validation prompts (fixed order).
        tree_top_k: the ``tree`` method's shape (see `streamspec.decoding.generate`), or ``"auto"``:
            the fastest of `TREE_CANDIDATES` on the validation prompts.
        sweep_top_k: also measure speedup and CRR for these tree_top_k, with and without pruning.
        lookup: the ``tree_lookup`` row's `PromptLookup`, ``"auto"`` (the fastest of
            `LOOKUP_CANDIDATES` on validation prompts; `DEFAULT_LOOKUP` with `data`, which has
            no validation split) or None (no such row).
        tree_budget: the ``tree_confidence`` row's node budget, ``"auto"`` (the fastest of
            `BUDGET_CANDIDATES` on validation prompts; `DEFAULT_BUDGET` with `data`) or None.
        cpu_kernels: on a CPU, run every model's fp32 linear layers through packed oneDNN kernels
            (`streamspec.kernels.pack_linear_layers`) and add the ``baseline_default_kernels`` row.
        device / dtype: where and in what precision both models run (`streamspec.loading`;
            ``auto``: CUDA in bfloat16 when available, else the CPU in float32).
        schema_style: SQL prompts with the schema in another style (`streamspec.data.schema_styles`:
            untyped, compact, renamed, long), test and validation alike.
        medusa: a Medusa checkpoint folder (`streamspec.patch.medusa`) trained on the baseline's
            model: adds the ``medusa`` row. Refused when its base is another model.
    """
    from ..patch.checkpoint import read_checkpoint_meta
    from ..loading import load_for_inference

    auto_tree = tree_top_k == "auto"
    if isinstance(tree_top_k, list):
        tree_top_k = tuple(tree_top_k)
    if (auto_tree or thresholds) and data is None and validation_limit < 1:
        raise ValueError(f"validation_limit must be >= 1 to choose a tree or threshold on validation, got {validation_limit}")
    if auto_tree and data is not None:
        raise ValueError("tree_top_k='auto' chooses on the task's validation split; with data=FILE give a shape")
    auto_lookup = lookup == "auto"
    if isinstance(lookup, str) and not auto_lookup:
        raise ValueError(f"lookup must be a PromptLookup, 'auto' or None, got {lookup!r}")
    if auto_lookup and data is not None:  # no validation split: the usual setting
        lookup, auto_lookup = DEFAULT_LOOKUP, False
    auto_budget = tree_budget == "auto"
    if isinstance(tree_budget, str) and not auto_budget:
        raise ValueError(f"tree_budget must be an int, 'auto' or None, got {tree_budget!r}")
    if auto_budget and data is not None:
        tree_budget, auto_budget = DEFAULT_BUDGET, False
    if auto_budget and validation_limit < 1:
        raise ValueError(f"validation_limit must be >= 1 to choose the tree budget on validation, got {validation_limit}")
    if auto_lookup and validation_limit < 1:
        raise ValueError(f"validation_limit must be >= 1 to choose the lookup on validation, got {validation_limit}")
    from ..assets import shipped_or_path

    checkpoint = shipped_or_path(checkpoint)
    meta = read_checkpoint_meta(checkpoint)
    loaded = load_for_inference(checkpoint, device=device, dtype=dtype, cpu_kernels=False)  # packed below, with the baseline
    model, tokenizer = loaded.model, loaded.tokenizer
    if not auto_tree:
        tree_shape(tree_top_k, model.stream_config.num_streams)  # a bad shape fails before any decoding
    rows = held_out_rows(task, data, schema_style=schema_style)[:limit]
    base_model = _baseline_model(meta, checkpoint, baseline, loaded.device, loaded.dtype)
    eos = tokenizer.eos_token_id
    packed = cpu_kernels and _pack_for_cpu(model, base_model)
    heads = None
    if medusa is not None:  # refused (another base, a tree deeper than the heads) before anything is decoded
        heads = _medusa_model(medusa, base_model)
        if not auto_tree:
            tree_shape(tree_top_k, heads.stream_config.num_streams)

    threshold = None
    validation = None
    if data is None and (auto_tree or thresholds or auto_lookup or auto_budget):
        validation = held_out_rows(task, split="validation", schema_style=schema_style)[:validation_limit]
    if auto_tree:
        tree_top_k, tree_table = choose_tree(model, tokenizer, validation, TREE_CANDIDATES, max_new_tokens, decode)
    if validation is not None and thresholds:
        threshold, threshold_table = choose_threshold(model, tokenizer, validation, tree_top_k, list(thresholds),
                                                      max_new_tokens, decode)
    if auto_budget:
        tree_budget, budget_table = choose_budget(model, tokenizer, validation, BUDGET_CANDIDATES, max_new_tokens,
                                                  decode)
    if heads is not None:
        if auto_tree:
            medusa_shape, medusa_table = choose_tree(heads, tokenizer, validation, TREE_CANDIDATES, max_new_tokens,
                                                     decode)
        else:
            medusa_shape = tree_top_k
    if auto_lookup:
        lookup, lookup_table = choose_lookup(model, tokenizer, validation, tree_top_k, LOOKUP_CANDIDATES, max_new_tokens,
                                             decode)
    methods = {
        "baseline": hf_method("baseline", base_model, eos),
        **({"baseline_default_kernels": with_default_kernels(hf_method("baseline", base_model, eos), base_model)}
           if packed else {}),
        "prompt_lookup": hf_method("prompt_lookup", base_model, eos, prompt_lookup_num_tokens=10),
        "streamed_ar": streaming_method(model, eos, decode, speculative=False),
        "chain": streaming_method(model, eos, decode, tree_top_k=1),
        "tree": streaming_method(model, eos, decode, tree_top_k=tree_top_k),
    }
    if threshold is not None:
        methods["tree_pruned"] = streaming_method(model, eos, decode, tree_top_k=tree_top_k, prune_threshold=threshold)
    if lookup is not None:
        methods["tree_lookup"] = streaming_method(model, eos, decode, tree_top_k=tree_top_k, lookup=lookup)
    if tree_budget is not None:
        methods["tree_confidence"] = streaming_method(model, eos, decode, tree_top_k=CONFIDENCE_TOP_K,
                                                      tree_budget=tree_budget)
    if heads is not None:
        methods["medusa"] = streaming_method(heads, eos, decode, tree_top_k=medusa_shape)
    lossless_on_base = baseline is None and model.stream_config.mode == "lossless"
    save_partial = None
    if out_dir is not None:
        partial = Path(out_dir) / "partial.json"
        partial.parent.mkdir(parents=True, exist_ok=True)

        def save_partial(so_far: dict[str, MethodResult], done: int) -> None:
            # every method's figures on the prompts finished so far: a late failure loses nothing
            entry = {"prompts_done": done, "prompts": len(rows),
                     "methods": report(task, rows[:done], so_far, baseline_is_base=lossless_on_base)}
            partial.write_text(json.dumps(entry, indent=2) + "\n")

    results = run_methods(methods, tokenizer, rows, max_new_tokens, on_prompt=save_partial)
    summary = report(task, rows, results, baseline_is_base=lossless_on_base)
    summary["tree"]["tree_top_k"] = tree_top_k if isinstance(tree_top_k, int) else list(tree_top_k)
    summary["tree"]["tree_chosen_on_validation"] = auto_tree
    if auto_tree:  # what each candidate did on the validation prompts
        summary["tree"]["validation"] = tree_table
    if threshold is not None:
        summary["tree_pruned"]["tree_top_k"] = summary["tree"]["tree_top_k"]
        summary["tree_pruned"]["prune_threshold"] = threshold
        summary["tree_pruned"]["validation"] = threshold_table
    if tree_budget is not None:
        summary["tree_confidence"].update(tree_top_k=CONFIDENCE_TOP_K, tree_budget=tree_budget,
                                          budget_chosen_on_validation=auto_budget)
        if auto_budget:
            summary["tree_confidence"]["validation"] = budget_table
    if lookup is not None:
        summary["tree_lookup"]["tree_top_k"] = summary["tree"]["tree_top_k"]
        summary["tree_lookup"]["lookup"] = lookup_name(lookup)
        summary["tree_lookup"]["lookup_chosen_on_validation"] = auto_lookup
        if auto_lookup:
            summary["tree_lookup"]["validation"] = lookup_table

    if heads is not None:
        summary["medusa"].update(tree_top_k=medusa_shape if isinstance(medusa_shape, int) else list(medusa_shape),
                                 tree_chosen_on_validation=auto_tree, draft_parameters=heads.num_draft_parameters())
        if auto_tree:
            summary["medusa"]["validation"] = medusa_table
    for name in DRAFT_METHODS:
        if name in summary:
            summary[name]["draft_parameters"] = model.num_stream_parameters()
    for name, method in methods.items():  # how each row of ours verified, and whether it was compiled
        config = getattr(method, "config", None)
        if config is not None and name in summary:
            summary[name].update(verify=config.verify, compile=config.compile)

    if out_dir is not None:
        save_report(summary, out_dir)  # the main table is safe before the sweep runs
    sweep = []
    if sweep_top_k:
        base_tps = results["baseline"].tokens / results["baseline"].seconds
        measured = {(1, False): "chain", (tree_top_k, False): "tree", (tree_top_k, True): "tree_pruned"}
        for k in sweep_top_k:
            for pruned in (False, True):
                if pruned and threshold is None:
                    continue
                if measured.get((k, pruned)) in results:  # already run above, on the same prompts
                    run = results[measured[(k, pruned)]]
                else:
                    run = run_methods({"m": streaming_method(model, eos, tree_top_k=k, prune_threshold=threshold if pruned else None)},
                                      tokenizer, rows, max_new_tokens)["m"]
                entry = run.summary(base_tps)
                sweep.append({"tree_top_k": k, "pruned": pruned, "speedup": entry["speedup"], "crr": entry["crr"]})
    if out_dir is not None:
        paths = save_report(summary, out_dir, sweep)
        summary_paths = {k: str(v) for k, v in paths.items()}
        print(markdown_table(summary))
        print("plots: " + ", ".join(v for k, v in summary_paths.items() if v.endswith(".png")))
    return summary


DRAFT_METHODS = ("chain", "tree", "tree_pruned", "tree_lookup", "tree_confidence")  # the streams' rows


def _medusa_model(folder: str, base_model):
    """Medusa heads from `folder` on the benchmark's baseline model (shared, not loaded twice);
    refused strictly when the heads were trained on another base (`load_medusa_heads`)."""
    from ..patch.medusa import MedusaConfig, MedusaModel, load_medusa_heads, read_medusa_meta

    heads = MedusaModel(base_model, MedusaConfig(**read_medusa_meta(folder)["medusa_config"]))
    load_medusa_heads(heads, folder)
    p = next(base_model.parameters())
    return heads.to(device=p.device, dtype=p.dtype).eval()


def _pack_for_cpu(*models) -> bool:
    """Pack all the models' fp32 CPU linear layers for oneDNN (see `streamspec.kernels`), or none:
    False when one is on another device or in another dtype, or this torch has no oneDNN."""
    from ..kernels import cpu_kernels_available, pack_linear_layers

    if not cpu_kernels_available():
        return False
    for m in models:
        p = next(m.parameters())
        if p.device.type != "cpu" or p.dtype != torch.float32:
            return False
    for m in models:
        pack_linear_layers(m)
    return True


def with_default_kernels(method: Callable, model) -> Callable:
    """`method` run with torch's default linear kernels in `model` (see `streamspec.kernels`)."""
    from ..kernels import default_linear_kernels

    def run(ids: torch.Tensor, max_new_tokens: int):
        with default_linear_kernels(model):
            return method(ids, max_new_tokens)

    return run


def _baseline_model(meta: dict, checkpoint: str, baseline: str | None, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32):
    from ..assets import load_base_model
    from ..patch.checkpoint import recorded_base

    base_name = recorded_base(checkpoint, meta)
    model = load_base_model(base_name, dtype=dtype)
    if baseline is not None:
        from ..patch.checkpoint import _load_adapter

        model = _load_adapter(model, Path(baseline)).merge_and_unload().eval()
    return model.to(device)
