"""Peak memory of one training step of SmolLM2-135M, plain vs with streams (γ=3, Ns=4).

    python eval/train_memory.py [--batch 4] [--length 512] [--labelled 128]

Each variant runs in its own process; prints a Markdown table (and JSON with --json).
"""

import argparse
import json
import subprocess
import sys

from streamspec.training.profiling import VARIANTS, train_step_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--labelled", type=int, nargs="*", default=[512, 128], help="completion lengths to try")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = parser.parse_args()
    if args.one:
        variant, labelled = args.one.split(":")
        print(json.dumps(train_step_memory(variant, args.batch, args.length, int(labelled))))
        return
    rows = []
    for labelled in args.labelled:
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--batch", str(args.batch), "--length", str(args.length), "--one", f"{variant}:{labelled}"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"done: {rows[-1]}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    print("| variant | batch × length | labelled tokens per row | step peak (MiB above loaded model) | process peak RSS (MiB) | step time (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['batch']} × {r['length']} | {r['labelled']} | {r['peak_step_mib']} | {r['peak_rss_mib']} | {r['step_seconds']} |")


if __name__ == "__main__":
    main()
