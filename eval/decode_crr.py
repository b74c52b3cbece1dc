"""Tokens per pass (CRR), tokens/s, exactness and quality of one token per pass and of several
draft trees, for one streamed checkpoint on the first N prompts of a split (a quicker subset of
`streamspec eval`, without baselines, for comparing checkpoints or tree shapes on the same prompts).

    python eval/decode_crr.py --checkpoint runs/smollm2-sql-b/final --limit 30 --trees 1 3
    python eval/decode_crr.py --checkpoint D --split validation --trees 1 2 3,1,1 2,2,1 --pruned 0.05

Trees are given as for `--tree-top-k`: k candidates per stream, or per depth (3,1,1). Linear layers
run with the packed oneDNN kernels on a CPU unless --default-kernels.
"""

import argparse
import json

from streamspec.evaluation.benchmark import held_out_rows, report, run_methods, streaming_method
from streamspec.cli import add_device_args, tree_arg
from streamspec.loading import load_for_inference

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--task", choices=["sql", "summarize"], default="sql")
    parser.add_argument("--split", choices=["test", "validation"], default="test")
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--trees", type=tree_arg, nargs="+", default=[1, 3], help="tree shapes: 1, 3, 3,1,1 ...")
    parser.add_argument("--pruned", type=float, default=None, help="also run each tree with this pruning threshold")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--default-kernels", action="store_true", help="torch's default CPU linear kernels")
    add_device_args(parser)
    args = parser.parse_args()
    loaded = load_for_inference(args.checkpoint, device=args.device, dtype=args.dtype,
                                cpu_kernels=not args.default_kernels)
    model, tokenizer = loaded.model, loaded.tokenizer
    rows = held_out_rows(args.task, split=args.split)[: args.limit]
    eos = tokenizer.eos_token_id
    methods = {"streamed_ar": streaming_method(model, eos, speculative=False)}
    for tree in args.trees:
        name = f"tree {tree if isinstance(tree, int) else ','.join(map(str, tree))}"
        methods[name] = streaming_method(model, eos, tree_top_k=tree)
        if args.pruned is not None:
            methods[f"{name} pruned {args.pruned}"] = streaming_method(model, eos, tree_top_k=tree, prune_threshold=args.pruned)
    summary = report(args.task, rows, run_methods(methods, tokenizer, rows, args.max_new_tokens))
    ar = summary["streamed_ar"]["tokens_per_second"]
    for entry in summary.values():
        entry["speedup_over_streamed_ar"] = round(entry["tokens_per_second"] / ar, 3) if ar else None
    print(json.dumps(summary, indent=1))
