"""The GPU check: exactness, the end-to-end table, pass costs, a training step and SpecReason's
model costs on one CUDA machine, in about 8 minutes with its compiles (`streamspec.evaluation.gpu_check`).
Prints one table and writes JSON (after every row). Imports only torch, transformers and peft.

    make gpu-check                                   # = python eval/gpu_check.py --out gpu_check.json
    python eval/gpu_check.py --parts a,c             # some parts only
    OMP_NUM_THREADS=1 python eval/gpu_check.py --device cpu --quick   # small versions, on a CPU
"""

import argparse
import sys

from streamspec.evaluation.gpu_check import PARTS, forbidden_imports, run_check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda, cuda:N or cpu")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="small versions of every part (a CPU runs them)")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON written after every row")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every part's time budget")
    args = parser.parse_args()
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    try:
        runner = run_check(args.device, parts, args.quick, args.out, args.budget_scale)
    except ValueError as err:
        parser.error(str(err))
    print()
    print(runner.table())
    bad = forbidden_imports()
    if bad:
        print(f"the check imported {', '.join(bad)}: it must run with torch, transformers and peft alone",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
