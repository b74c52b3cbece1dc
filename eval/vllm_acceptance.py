"""Streams checkpoints side by side as vLLM's drafter: each exported in the DFlash layout (with a
pruned draft vocabulary when asked) and run in one vLLM process beside vLLM plain on the same
held-out prompts; prints each one's mean acceptance length, acceptance per draft position,
tokens/s and whether its outputs equal plain vLLM's, and writes them as JSON. ``--lookup MIN:MAX``
adds each checkpoint again with lookup drafts merged into its drafts (row NAME+lookup;
`streamspec.vllm.lookup`; ``--lookup suffix:0`` suffix decoding's, row NAME+suffix0; several
values, a row each), ``--lookup-drafts K [K ...]`` such a row for each K drafts a step
(NAME+lookup+KK; up to 2γ, lookup filling the positions past the streams'), ``--peers ngram
suffix`` vLLM's own lookup drafters beside them, ``--eagle3 FOLDER`` / ``--peagle FOLDER`` EAGLE-3 and
P-EAGLE drafters trained by speculators (``eval/train_peer_drafters.py``) beside them.

    python eval/vllm_acceptance.py --task sql --limit 32 --out runs/vllm-acceptance.json \\
        --draft-vocab 8192 --draft-vocab-from distilled/sql distilled/sql-styles distilled/sql-self-instruct \\
        shipped=streamspec:smollm2-135m-sql-streams next-token=runs/smollm2-sql-streams-next-token/final

Acceptance does not depend on what else the machine runs; tokens/s does (compare within one run).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from streamspec.assets import DEFAULT_MODEL_ID, load_tokenizer
from streamspec.data.build import prompt_ids
from streamspec.evaluation.benchmark import held_out_rows
from streamspec.evaluation.vllm_acceptance import (PEERS, acceptance_rows, acceptance_runs, acceptance_table,
                                                   lookup_row_name, named_checkpoints)
from streamspec.evaluation.vllm_peers import check_concurrency, vllm_base
from streamspec.vllm.client import check_suffix_decoding, run_vllm
from streamspec.vllm.run import check_drafter_folder
from streamspec.vllm.export import export_for_vllm
from streamspec.vllm.lookup import parse_lookup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", metavar="NAME=CHECKPOINT", help="lossless streamed checkpoints")
    parser.add_argument("--task", default="sql", choices=["sql", "chat"], help="whose held-out prompts")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="requests at once")
    parser.add_argument("--draft-vocab", type=int, default=None, help="a pruned draft vocabulary of N ids")
    parser.add_argument("--draft-vocab-from", nargs="+", default=None, metavar="DISTILLED")
    parser.add_argument("--lookup", nargs="+", default=None, metavar="MIN:MAX|suffix[:CACHED]",
                        help="also each checkpoint with lookup drafts merged, a row for each value "
                             "(`streamspec export --lookup`)")
    parser.add_argument("--lookup-drafts", type=int, nargs="+", default=None, metavar="K",
                        help="drafts a step of the lookup rows, a row each (`streamspec export --drafts`; default γ; "
                             "up to 2γ, lookup filling the positions past the streams')")
    parser.add_argument("--peers", nargs="+", default=[], choices=sorted(PEERS),
                        help="vLLM's lookup drafters in the same process (n-gram as `streamspec eval` runs it; suffix)")
    parser.add_argument("--eagle3", default=None, metavar="FOLDER",
                        help="the vllm_eagle3 row: an EAGLE-3 drafter trained by speculators (eval/train_peer_drafters.py)")
    parser.add_argument("--peagle", default=None, metavar="FOLDER", help="the vllm_peagle row: a P-EAGLE drafter, likewise")
    parser.add_argument("--base", default=DEFAULT_MODEL_ID, help="the served model")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file the rows go to")
    args = parser.parse_args(argv)
    if args.lookup_drafts and not args.lookup:
        parser.error("--lookup-drafts gives the lookup rows their drafts a step: it goes with --lookup MIN:MAX")
    try:
        checkpoints = named_checkpoints(args.checkpoints)
        trained = {method: check_drafter_folder(method, folder)
                   for method, folder in (("eagle3", args.eagle3), ("peagle", args.peagle)) if folder}
        concurrency = check_concurrency(args.concurrency)
        tokenizer = load_tokenizer(args.base)
        prompts = [prompt_ids(tokenizer, row)[0].tolist() for row in held_out_rows(args.task)[:args.limit]]
        with tempfile.TemporaryDirectory() as tmp:
            folders = {}
            for name, checkpoint in checkpoints.items():
                variants = [(name, None, None)]
                for lookup in args.lookup or []:
                    variants += [(lookup_row_name(name, k, lookup), lookup, k) for k in args.lookup_drafts or [None]]
                for row, lookup, drafts in variants:
                    folders[row] = export_for_vllm(checkpoint, Path(tmp) / row, layout="dflash", dtype="float32",
                                                   draft_vocab=args.draft_vocab,
                                                   draft_vocab_from=args.draft_vocab_from, lookup=lookup, drafts=drafts)
            if "suffix" in args.peers or any(isinstance(parse_lookup(v), dict) for v in args.lookup or []):
                check_suffix_decoding()  # raises naming the fix (`make vllm`) before any engine starts
            spec = {"model": vllm_base(args.base), "prompts": prompts, "max_tokens": args.max_new_tokens,
                    "dtype": "float32", "runs": acceptance_runs(folders, concurrency, tuple(args.peers), trained)}
            # vLLM's start, then up to 15 minutes a run (long replies one at a time on one thread)
            results = run_vllm(spec, timeout=600 + 900 * len(spec["runs"]))["runs"]
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        sys.exit(f"vllm_acceptance: error: {err}")
    rows = acceptance_rows(results, checkpoints)
    print(acceptance_table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"task": args.task, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                                        "draft_vocab": args.draft_vocab, "lookup": args.lookup,
                                        "lookup_drafts": args.lookup_drafts, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
