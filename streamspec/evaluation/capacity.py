"""The capacity study's table: per training run (an output folder of
`streamspec train`), what it trained (streams: Ns, γ, stream-adapter rank, init, learning rates;
or Medusa heads), the parameters its drafts add, its training time, the validation top-1 of every
draft after each epoch (``training_summary.json``: the run's own validation rows, the model's own
text for a distilled recipe), and, given the run's `streamspec eval` folder, what its drafts do on
held-out prompts: the chain's CRR (tokens a pass), its ms a pass and its speedup over `generate`
in that run (the ``medusa`` row for a Medusa run).

    python eval/capacity_table.py runs/study/base runs/study/medusa --evals runs/study/eval-base runs/study/eval-medusa
"""

from __future__ import annotations

import json
from pathlib import Path

HEADER = ("| configuration | parameters added | epoch | validation top-1 per draft (%) | training time "
          "| held-out CRR | ms a pass | speedup |")
RULE = "|---|---|---|---|---|---|---|---|"


def added_parameters(final: Path) -> int | None:
    """The parameters in a run's exported draft weights (streams or Medusa heads), None if absent."""
    from ..patch.checkpoint import file_parameters

    for name in ("streams.safetensors", "heads.safetensors"):
        path = Path(final) / name
        if path.is_file():
            return file_parameters(path)
    return None


def describe(recipe: dict) -> str:
    """One line naming what a recipe's drafts are (the study's axes)."""
    if recipe.get("medusa"):
        return f"Medusa, {recipe['medusa']['num_heads']} heads"
    s, t = recipe.get("streams") or {}, recipe["training"]
    if not s:
        raise ValueError("the recipe trains neither streams nor Medusa heads: not a capacity-study run")
    rank = s.get("stream_adapter_rank")
    init = s.get("stream_init", "identity")
    if init == "lowrank":
        init += f" (rank {s.get('init_rank') or 8})"
    share = (recipe.get("data") or {}).get("train_fraction", 1.0)
    data = f", data {100 * share:g}%" if share < 1 else ""
    reads = ", reading the next token" if s.get("next_token_input") else ""
    return (f"streams Ns={s.get('stream_layers', 4)}, γ={s.get('num_streams', 3)}, rank={rank if rank else '-'}, "
            f"init={init}{reads}, lr={t['learning_rate']:g}/{t.get('stream_learning_rate') or t['learning_rate']:g}{data}")


def held_out(eval_folder: Path, medusa: bool) -> dict:
    """The chain's (or the Medusa row's) CRR, ms a pass and speedup from a `streamspec eval` folder."""
    path = Path(eval_folder) / "benchmark.json"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark.json in {eval_folder} (the --out folder of `streamspec eval`)")
    methods = json.loads(path.read_text())["methods"]
    name = "medusa" if medusa else "chain"
    if name not in methods:
        raise ValueError(f"{path} has no {name!r} row (rows: {sorted(methods)})"
                         + ("; run `streamspec eval` with --medusa FOLDER" if medusa else ""))
    entry = methods[name]
    return {"crr": entry.get("crr"), "ms_per_pass": entry.get("ms_per_pass"), "speedup": entry.get("speedup")}


def run_rows(run: Path, eval_folder: Path | None = None) -> list[str]:
    """The table's rows for one run: one per validated epoch, the held-out figures on the last."""
    import yaml

    run = Path(run)
    for name in ("recipe.yaml", "training_summary.json"):
        if not (run / name).is_file():
            raise FileNotFoundError(f"{run} has no {name}: not a finished `streamspec train` output folder")
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    summary = json.loads((run / "training_summary.json").read_text())
    params = added_parameters(run / "final")
    evaluated = held_out(eval_folder, bool(recipe.get("medusa"))) if eval_folder is not None else None
    validation = summary.get("validation") or []
    drafts = sorted({k[len("eval_"):-len("_top1")] for e in validation for k in e
                     if k.endswith("_top1") and not k.startswith(("eval_main", "eval_early", "eval_chain"))})
    added = f"{params:,}" if params is not None else "–"
    time = f"{summary['wall_seconds']:.0f} s total, {summary['seconds_per_step']:.2f} s/step"
    out = []
    for i, e in enumerate(validation or [{}]):
        top1 = " / ".join(f"{100 * e[f'eval_{d}_top1']:.1f}" for d in drafts) or "–"
        last = i == max(len(validation), 1) - 1
        figures = ("–", "–", "–")
        if last and evaluated:
            figures = (f"{evaluated['crr']:.2f}", f"{evaluated['ms_per_pass']:.1f}", f"{evaluated['speedup']:.2f}×")
        out.append(f"| {describe(recipe)} | {added} | {round(e.get('epoch', 0), 2):g} | {top1} | {time} | "
                   + " | ".join(figures) + " |")
    return out


def capacity_table(runs: list[Path], evals: list[Path | None] | None = None) -> str:
    """The Markdown table of `runs` (with their `evals` folders, aligned; None where not evaluated)."""
    evals = list(evals) if evals is not None else [None] * len(runs)
    if len(evals) != len(runs):
        raise ValueError(f"{len(evals)} eval folders for {len(runs)} runs: give one per run ('-' for none)")
    lines = [HEADER, RULE]
    for run, folder in zip(runs, evals):
        lines += run_rows(Path(run), Path(folder) if folder is not None else None)
    return "\n".join(lines)

