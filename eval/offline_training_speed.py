"""Seconds per training step and per epoch, online against offline (`data.cache_activations`), on
the same batches of a recipe's own training examples, measured alternately in one process; the
store's size per example; and each path's loss per batch (offline must equal online). Lossless
streams are timed online both ways: the main stream apart (``online``, the default) and main and
stream rows as one sequence (``online_rows_together``).

    python eval/offline_training_speed.py --recipe recipes/smollm2-135m/sql_streams_distilled.yaml \
        [--steps 6] [--bf16] [key=value overrides ...]
"""

import argparse
import json

from streamspec.devices import cpu_model
from streamspec.training.profiling import offline_step_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per path (one more warms up)")
    parser.add_argument("--bf16", action="store_true", help="also time offline steps on a bfloat16 base")
    parser.add_argument("--store", help="keep the stores in this folder (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, section.key=value")
    args = parser.parse_args()
    dtypes = ("float32", "bfloat16") if args.bf16 else ("float32",)
    result = offline_step_time(args.recipe, args.overrides, args.steps, args.store, dtypes)
    result["cpu"] = cpu_model()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
