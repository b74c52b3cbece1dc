"""Train a study's points (`streamspec.training.study`: data scaling, capacity) one after another,
each resumable, evaluate each point's chain on held-out prompts, and print the table.

    python eval/scale_study.py --study sql-data --out runs/study-sql
    python eval/scale_study.py --study sql-capacity --out runs/study-sql --points rank-128 full-rank

A stopped study continues with the same command (finished points are kept, a point with a
checkpoint resumes from it). Run it from the repository root: the recipes' data folders are
relative to it.
"""

import argparse
import sys

from streamspec.training.study import STUDIES, run_study


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", required=True, choices=sorted(STUDIES))
    parser.add_argument("--out", default="runs/study-sql", help="where each point's folder goes")
    parser.add_argument("--points", nargs="+", default=None, help="only these points (default: every one)")
    parser.add_argument("--no-eval", action="store_true", help="train only")
    parser.add_argument("--limit", type=int, default=30, help="held-out prompts each point is evaluated on")
    args = parser.parse_args()
    try:
        print(run_study(args.study, args.out, args.points, evaluate=not args.no_eval, limit=args.limit))
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"scale_study: error: {err}")


if __name__ == "__main__":
    main()
