"""Train a study's points (`streamspec.training.study`: data scaling, capacity) one after another,
each resumable, measure each point's chain on held-out prompts
(`streamspec.evaluation.study.evaluate_chain`), and print the table.

    python eval/scale_study.py --study sql-data --out runs/study-sql
    python eval/scale_study.py --study sql-capacity --out runs/study-sql --points rank-128 full-rank
    python eval/scale_study.py --study chat-data --out runs/study-chat    # chains on MT-bench's first turns
    # every point reads an activation store built already (the SQL-at-scale run's)
    python eval/scale_study.py --study sql-data --set data.activations_path=runs/store-sql-scale

A stopped study continues with the same command (finished points are kept, a point with a
checkpoint resumes from it, a measured point is not measured again). `--max-minutes M` stops
training after M minutes with a checkpoint (a study longer than the time a machine is held runs
as several such commands). Run it from the repository root: the recipes' data folders are
relative to it.
"""

import argparse
import sys

from streamspec.evaluation.capacity import capacity_table
from streamspec.evaluation.study import evaluate_chain
from streamspec.training.study import STUDIES, point_finished, point_progress, train_study


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", required=True, choices=sorted(STUDIES))
    parser.add_argument("--out", default="runs/study-sql", help="where each point's folder goes")
    parser.add_argument("--points", nargs="+", default=None, help="only these points (default: every one)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="recipe overrides every point shares (not the ones the study varies)")
    parser.add_argument("--no-eval", action="store_true", help="train only")
    parser.add_argument("--task", default=None, choices=["sql", "summarize", "chat"],
                        help="the held-out prompts each point is measured on (default: the study's: sql, or chat's "
                             "MT-bench first turns for chat-data)")
    parser.add_argument("--limit", type=int, default=30, help="held-out prompts each point is measured on")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop training after this many minutes, the point in training with a checkpoint; the "
                             "same command continues it (default: no budget)")
    args = parser.parse_args()
    try:
        study, points, runs = train_study(args.study, args.out, args.points, overrides=args.set,
                                          max_minutes=args.max_minutes)
        done = [(point, run) for point, run in zip(points, runs) if point_finished(run)]
        for point, run in zip(points, runs):
            if not point_finished(run):
                print(f"{point.name}: {point_progress(run)}; the same command continues it")
        if not done:
            return
        evals = None if args.no_eval else [
            evaluate_chain(run / "final", run.parent / f"eval-{point.name}", args.task or study.task, args.limit)
            for point, run in done]
        print(f"{study.about}\n\n{capacity_table([run for _, run in done], evals)}")
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"scale_study: error: {err}")


if __name__ == "__main__":
    main()
