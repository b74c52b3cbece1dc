"""The capacity study's table (`streamspec.evaluation.capacity`): per training run, what it
trained, the parameters its drafts add, its training time, the validation top-1 of every draft
after each epoch, and with --evals (one `streamspec eval --out` folder per run, '-' for none) the
chain's (or Medusa row's) CRR, ms a pass and speedup on held-out prompts.

    python eval/capacity_table.py runs/study/base runs/study/medusa --evals runs/study/eval-base runs/study/eval-medusa
"""

import argparse
import sys

from streamspec.evaluation.capacity import capacity_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="training output folders")
    parser.add_argument("--evals", nargs="+", default=None,
                        help="each run's `streamspec eval --out` folder, in the runs' order ('-' for none)")
    args = parser.parse_args()
    evals = None if args.evals is None else [None if e == "-" else e for e in args.evals]
    try:
        print(capacity_table(args.runs, evals))
    except (FileNotFoundError, ValueError) as err:  # a folder that is not a finished run or eval
        sys.exit(f"capacity_table: error: {err}")


if __name__ == "__main__":
    main()
