"""Rewrite docs/benchmarks.md's tables and the plots in docs/figures from docs/results/*.json
(`streamspec.evaluation.results.regenerate`).

    python eval/report.py            # rewrite the tables, draw the plots
    python eval/report.py --check    # write nothing; exit 1 when a table differs from its file
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamspec.evaluation.results import ResultError, regenerate

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (docs/ and docs/results/ under it)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table is stale")
    parser.add_argument("--no-figures", action="store_true", help="rewrite the tables only")
    args = parser.parse_args(argv)
    try:
        stale = regenerate(args.root, check=args.check, figures=not args.no_figures)
    except ResultError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        print("stale tables: " + ", ".join(stale) if stale else "every table matches its result file")
        return 1 if stale else 0
    print("rewrote " + (", ".join(stale) if stale else "nothing (every table was current)") + "; figures in docs/figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
