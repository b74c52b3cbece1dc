"""SQL streams in vLLM's two draft layouts side by side on held-out Spider questions: P-EAGLE
(eagle3 with parallel drafting, K = γ+1, the last draft a filler) and DFlash (K = γ), and a layout
with a pruned draft vocabulary, beside plain vLLM, one request at a time and 8 at once: tokens/s,
mean acceptance length, acceptance per draft position (`streamspec.evaluation.vllm_layouts`);
writes a docs/results file.

    python eval/vllm_layouts.py --limit 10 --rounds 2 --out docs/results/vllm_layouts.json \
        --machine "$(lscpu | sed -n 's/Model name: *//p'), 2 cores"
    # DFlash with and without an 8192-id draft vocabulary counted in the streams' training sets
    python eval/vllm_layouts.py --layouts dflash --draft-vocab 8192 \
        --draft-vocab-from distilled/sql distilled/sql-styles distilled/sql-self-instruct --out ... --machine ...
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
from streamspec.evaluation.vllm_layouts import layout_rows, layout_runs, layout_table, variant_key
from streamspec.vllm.client import run_vllm
from streamspec.vllm.export import export_for_vllm
from streamspec.vllm.format import LAYOUTS

CHECKPOINT = "streamspec:smollm2-135m-sql-streams"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=CHECKPOINT, help="the streams (a checkpoint or streamspec:NAME)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="also each layout with an N-id draft vocabulary (counted in --draft-vocab-from)")
    parser.add_argument("--draft-vocab-from", nargs="+", default=None, metavar="DISTILLED")
    parser.add_argument("--limit", type=int, default=10, help="held-out Spider questions")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=1, help="fresh engines per row, interleaved")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", required=True, help="lscpu's model name, cores")
    args = parser.parse_args(argv)
    if (args.draft_vocab is None) != (args.draft_vocab_from is None):
        parser.error("--draft-vocab N and --draft-vocab-from DISTILLED go together")
    tokenizer = load_default_tokenizer()
    prompts = [prompt_ids(tokenizer, row)[0].tolist() for row in held_out_rows("sql")[:args.limit]]
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for layout in args.layouts:
            for vocab in (None, args.draft_vocab) if args.draft_vocab else (None,):
                key = variant_key(layout, vocab)
                folders[key] = str(export_for_vllm(args.checkpoint, Path(tmp) / key, layout=layout, draft_vocab=vocab,
                                                   draft_vocab_from=args.draft_vocab_from if vocab else None))
        runs = layout_runs(folders, tuple(args.concurrency), args.rounds)
        spec = {"model": str(default_model_path()), "prompts": prompts, "max_tokens": args.max_new_tokens,
                "runs": runs}
        results = run_vllm(spec, env={"OMP_NUM_THREADS": "1"})["runs"]
    rows = layout_rows(runs, results)
    print(json.dumps(rows, indent=1))
    command = " ".join(["python eval/vllm_layouts.py", *(argv if argv is not None else sys.argv[1:])])
    streams = "shipped SQL streams" if args.checkpoint == CHECKPOINT else f"streams {args.checkpoint}"
    table = layout_table(rows, limit=args.limit, command=command, machine=args.machine,
                         date=datetime.date.today().isoformat(), new_tokens=args.max_new_tokens, streams=streams)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
