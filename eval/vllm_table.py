"""The vLLM rows of a `streamspec eval --peers vllm,... --out DIR` run as a docs/results file (then
`python eval/report.py` puts its table in docs/benchmarks.md and draws the acceptance per draft
position as docs/figures/<OUT's name>_acceptance_per_position.png); the peers: vllm, vllm_ngram,
vllm_suffix, vllm_streams, vllm_eagle3, vllm_peagle.

    python eval/vllm_table.py DIR docs/results/vllm_drafters_spider.json --command "..." --machine "$(lscpu | sed -n 's/Model name: *//p'), 2 cores"
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from streamspec.evaluation.vllm_peers import result_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the eval run's --out folder (its benchmark.json)")
    parser.add_argument("out", type=Path, help="the result file to write")
    parser.add_argument("--title", default="vLLM's CPU build: SmolLM2-135M fp32, the shipped SQL streams, held-out Spider")
    parser.add_argument("--command", required=True, help="what reproduces the run")
    parser.add_argument("--machine", required=True, help="lscpu's model name, cores")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default=None)
    args = parser.parse_args(argv)
    summary = json.loads((args.run / "benchmark.json").read_text())
    table = result_table(summary, title=args.title, command=args.command, machine=args.machine, threads=args.threads,
                         date=datetime.date.today().isoformat(), plot_positions=args.out.stem,
                         **({"note": args.note} if args.note else {}))
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
