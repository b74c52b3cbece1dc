"""vLLM's speculative settings side by side on held-out Spider questions: drafts a step
(`num_speculative_tokens`) for the streams and for vLLM's n-gram drafter, one request at a time and
8 at once, on vLLM's default one compute thread and on two; writes a docs/results file.

    python eval/vllm_levers.py --limit 10 --out docs/results/vllm_levers.json --machine "AMD EPYC, 2 cores"
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
from streamspec.evaluation.vllm_peers import COLUMNS as VLLM_COLUMNS
from streamspec.vllm.client import run_vllm
from streamspec.vllm.export import export_for_vllm

CHECKPOINT = "streamspec:smollm2-135m-sql-streams"
# vLLM's benchmark columns, with the compute threads and the drafts a step beside the row
COLUMNS = VLLM_COLUMNS[:1] + [{"key": "threads", "label": "threads"}] + VLLM_COLUMNS[1:2] + [
    {"key": "drafts", "label": "drafts a step"}] + VLLM_COLUMNS[2:]


def runs(folder: str) -> list[dict]:
    """Plain, the n-gram drafter at 2/4/6 drafts and the streams at 2/3/4, one at a time; the best
    of each and plain at 8 at once."""
    out = [{"drafter": "none"}]
    out += [{"drafter": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": max(k, 4)} for k in (2, 4, 6)]
    out += [{"drafter": "streams", "folder": folder, "num_speculative_tokens": k} for k in (2, 3, 4)]
    out += [{"drafter": "none", "concurrency": 8}, {"drafter": "ngram", "num_speculative_tokens": 2, "concurrency": 8},
            {"drafter": "streams", "folder": folder, "num_speculative_tokens": 2, "concurrency": 8},
            {"drafter": "streams", "folder": folder, "num_speculative_tokens": 4, "concurrency": 8}]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="vLLM's compute threads (cores 0..n-1)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", required=True, help="lscpu's model name, cores")
    args = parser.parse_args(argv)
    tokenizer = load_default_tokenizer()
    prompts = [prompt_ids(tokenizer, row)[0].tolist() for row in held_out_rows("sql")[:args.limit]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(export_for_vllm(CHECKPOINT, tmp, layout="peagle"))  # its K = 2, 3, 4: the P-EAGLE layout
        for threads in args.threads:
            spec = {"model": str(default_model_path()), "prompts": prompts, "max_tokens": args.max_new_tokens,
                    "runs": runs(folder)}
            env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
            results = run_vllm(spec, env=env)["runs"]
            plain = {r["concurrency"]: r for r in results if r["drafter"] == "none"}
            for r in results:
                base = plain[r["concurrency"]]
                rows.append({"method": r["drafter"] if r["drafter"] != "none" else "vllm", "threads": threads,
                             "concurrency": r["concurrency"], "drafts": r.get("num_speculative_tokens"),
                             "tokens_per_second": round(r["tokens_per_s"], 2),
                             "x_vllm": round(r["tokens_per_s"] / base["tokens_per_s"], 3),
                             "mean_acceptance_length": r["mean_acceptance_length"],
                             "identical": r["outputs"] == base["outputs"]})
            print(json.dumps(rows[-len(results):], indent=1), flush=True)
    table = {"title": f"vLLM's speculative settings: SmolLM2-135M fp32, shipped SQL streams, {args.limit} held-out "
                      "Spider questions", "command": f"python eval/vllm_levers.py --limit {args.limit} --out {args.out}",
             "machine": args.machine, "threads": max(args.threads), "date": datetime.date.today().isoformat(),
             "columns": COLUMNS, "rows": rows}
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
