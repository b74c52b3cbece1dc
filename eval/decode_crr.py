"""Tokens per pass (CRR), tokens/s, exactness and quality of one token per pass, a chain and a tree
for one streamed checkpoint on the first N held-out prompts (a quicker subset of `streamspec eval`,
without baselines, for comparing checkpoints on the same prompts).

    python eval/decode_crr.py --checkpoint runs/smollm2-sql-b/final --limit 30
"""

import argparse
import json

from streamspec.benchmark import held_out_rows, report, run_methods, streaming_method
from streamspec.checkpoint import load_streamed
from streamspec.inference import checkpoint_tokenizer

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--task", choices=["sql", "summarize"], default="sql")
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--tree-top-k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    tokenizer = checkpoint_tokenizer(args.checkpoint)
    model = load_streamed(args.checkpoint, merge_lora=True)
    rows = held_out_rows(args.task)[: args.limit]
    eos = tokenizer.eos_token_id
    methods = {
        "streamed_ar": streaming_method(model, eos, speculative=False),
        "chain": streaming_method(model, eos, tree_top_k=1),
        "tree": streaming_method(model, eos, tree_top_k=args.tree_top_k),
    }
    print(json.dumps(report(args.task, rows, run_methods(methods, tokenizer, rows, args.max_new_tokens)), indent=1))
