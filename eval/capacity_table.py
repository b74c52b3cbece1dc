"""The capacity study's table: for each training run (an output folder of `train/finetune.py`),
what it trained (streams: Ns, stream-adapter rank, init, learning rates; or Medusa heads), the
parameters the drafts add, the training time, and the validation top-1 of every draft after each
epoch (from training_summary.json; the run's own validation rows, the model's own text for a
distilled recipe).

    python eval/capacity_table.py runs/smollm2-sql-streams-offline runs/smollm2-sql-medusa-offline [...]
"""

import argparse
import json
from pathlib import Path

import yaml
from safetensors import safe_open


def added_parameters(final: Path) -> int | None:
    for name in ("streams.safetensors", "heads.safetensors"):
        path = final / name
        if path.is_file():
            with safe_open(str(path), framework="pt") as handle:
                return sum(_numel(handle.get_slice(k).get_shape()) for k in handle.keys())
    return None


def _numel(shape) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def describe(recipe: dict) -> str:
    if recipe.get("medusa"):
        return f"Medusa, {recipe['medusa']['num_heads']} heads"
    s, t = recipe["streams"], recipe["training"]
    rank = s.get("stream_adapter_rank")
    return (f"streams Ns={s['stream_layers']}, γ={s['num_streams']}, rank={rank if rank else '-'}, "
            f"init={s.get('stream_init', 'identity')}, lr={t['learning_rate']:g}/{t.get('stream_learning_rate') or t['learning_rate']:g}")


def rows(folder: Path) -> list[str]:
    recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
    summary = json.loads((folder / "training_summary.json").read_text())
    params = added_parameters(folder / "final")
    drafts = sorted({k[len("eval_"):-len("_top1")] for e in summary["validation"] for k in e
                     if k.endswith("_top1") and not k.startswith("eval_main") and not k.startswith("eval_early")})
    out = []
    for e in summary["validation"]:
        top1 = " / ".join(f"{100 * e[f'eval_{d}_top1']:.1f}" for d in drafts)
        out.append(f"| {describe(recipe)} | {params:,} | {e.get('epoch', 0):.0f} | {top1} | "
                   f"{summary['wall_seconds']:.0f} s total, {summary['seconds_per_step']:.2f} s/step |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="training output folders")
    args = parser.parse_args()
    print("| configuration | parameters added | epoch | validation top-1 per draft (%) | training time |")
    print("|---|---|---|---|---|")
    for run in args.runs:
        print("\n".join(rows(Path(run))))


if __name__ == "__main__":
    main()
