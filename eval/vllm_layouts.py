"""The shipped SQL streams in vLLM's two draft layouts side by side on held-out Spider questions:
P-EAGLE (eagle3 with parallel drafting, K = γ+1, the last draft a filler) and DFlash (K = γ), beside
plain vLLM, one request at a time and 8 at once: tokens/s, mean acceptance length, acceptance per
draft position (`streamspec.evaluation.vllm_layouts`); writes a docs/results file.

    python eval/vllm_layouts.py --limit 10 --rounds 2 --out docs/results/vllm_layouts.json \
        --machine "$(lscpu | sed -n 's/Model name: *//p'), 2 cores"
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

from streamspec.assets import default_model_path, load_default_tokenizer
from streamspec.data.build import prompt_ids
from streamspec.evaluation.benchmark import held_out_rows
from streamspec.evaluation.vllm_layouts import layout_rows, layout_runs, layout_table
from streamspec.vllm.client import run_vllm
from streamspec.vllm.export import export_for_vllm
from streamspec.vllm.format import LAYOUTS

CHECKPOINT = "streamspec:smollm2-135m-sql-streams"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="held-out Spider questions")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=1, help="fresh engines per row, interleaved")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", required=True, help="lscpu's model name, cores")
    args = parser.parse_args(argv)
    tokenizer = load_default_tokenizer()
    prompts = [prompt_ids(tokenizer, row)[0].tolist() for row in held_out_rows("sql")[:args.limit]]
    with tempfile.TemporaryDirectory() as tmp:
        folders = {layout: str(export_for_vllm(CHECKPOINT, Path(tmp) / layout, layout=layout)) for layout in LAYOUTS}
        runs = layout_runs(folders, tuple(args.concurrency), args.rounds)
        spec = {"model": str(default_model_path()), "prompts": prompts, "max_tokens": args.max_new_tokens,
                "runs": runs}
        results = run_vllm(spec, env={"OMP_NUM_THREADS": "1"})["runs"]
    rows = layout_rows(runs, results)
    print(json.dumps(rows, indent=1))
    command = (f"python eval/vllm_layouts.py --limit {args.limit} --max-new-tokens {args.max_new_tokens} --rounds "
               f"{args.rounds} --out {args.out}")
    table = layout_table(rows, limit=args.limit, command=command, machine=args.machine,
                         date=datetime.date.today().isoformat(), new_tokens=args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
