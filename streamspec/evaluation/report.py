"""The benchmark's report: quality per method (SQL exact match and validity, or ROUGE), the
summary of every method against the baseline (`report`), its Markdown table and the files and
plots of a run (`save_report`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .methods import MethodResult
from .metrics import sql_exact_match, sql_is_valid

# The streams' rows: each reports ``draft_parameters`` (what the streams add to the model).
DRAFT_METHODS = ("chain", "tree", "tree_pruned", "tree_lookup", "tree_confidence")


def quality(task: str, rows: list[dict], texts: list[str]) -> dict:
    """SQL exact match and validity, or ROUGE-1/2/L/Lsum F1 (in %). A user's rows (prompt and
    completion only) are matched against their completion; validity needs a schema, so it is
    reported only when every row has one. Chat has no reference replies: nothing (every decoding
    row is checked identical to greedy decoding instead)."""
    if task == "chat":
        return {}
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
            # in a reduced precision near-ties may part: the share of prompts with identical outputs
            same = sum(a == b for a, b in zip(r.token_ids, results[reference].token_ids))
            entry["identical_share_to_autoregressive"] = round(same / max(len(r.token_ids), 1), 3)
        if base is not None and name != "baseline" and (name == "baseline_default_kernels" or baseline_is_base):
            entry["identical_to_baseline"] = r.token_ids == base.token_ids
        entry.update(quality(task, rows, r.texts))
        out[name] = entry
    return out


def markdown_table(summary: dict) -> str:
    """One row per method: speed, CRR, exactness, quality, and where each pass's time goes."""
    columns = ["tokens_per_second", "speedup", "crr", "mean_tokens_per_pass", "identical_to_autoregressive", "ms_per_pass",
               "ms_prefill", "ms_per_step_forward", "ms_per_step_head", "ms_per_step_overhead", "ms_per_step_host",
               "reads_per_step", "graph_calls_per_step"]
    if any("kernels_per_graph" in entry for entry in summary.values()):
        columns.append("kernels_per_graph")
    if any("identical_to_baseline" in entry for entry in summary.values()):
        columns.insert(5, "identical_to_baseline")
    if any("draft_parameters" in entry for entry in summary.values()):
        columns.append("draft_parameters")
    if any("x_floor" in entry for entry in summary.values()):  # the memory floor (streamspec.evaluation.peers)
        columns += ["floor_ms", "x_floor"]
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


# What a user reads of a run (`streamspec demo`): the label, and these columns.
USER_COLUMNS = (("tokens_per_second", "tokens/s"), ("speedup", "speedup"), ("crr", "CRR"),
                ("identical_to_autoregressive", "identical"))


def user_table(summary: dict) -> str:
    """One row per method with tokens/s, speedup, CRR and whether its outputs are identical to one
    token a pass, or, where that row was not run, to the baseline's (`identical_to_baseline`; the
    baseline itself: "–")."""
    lines = ["| method | " + " | ".join(label for _, label in USER_COLUMNS) + " |", "|" + "---|" * (len(USER_COLUMNS) + 1)]
    for name, entry in summary.items():
        label = name + (f" {entry['tree_top_k']}" if "tree_top_k" in entry else "")
        cells = []
        for key, _ in USER_COLUMNS:
            value = entry.get(key)
            if key == "identical_to_autoregressive" and value is None:
                value = entry.get("identical_to_baseline")
            if value is None:
                cells.append("–")
            elif isinstance(value, bool):
                cells.append("yes" if value else "no")
            elif key == "speedup":
                cells.append(f"{value:.2f}×")
            else:
                cells.append(f"{value:.2f}")
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
        ax.barh(names, [summary[n].get(key) or 0 for n in names])
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
