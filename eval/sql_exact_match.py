"""Exact match and validity of greedy SQL on Spider's held-out test databases.

    python eval/sql_exact_match.py --kind base
    python eval/sql_exact_match.py --kind next_token --path runs/smollm2-sql-next-token/final
    python eval/sql_exact_match.py --kind streamed --path runs/smollm2-sql/final [--limit 100]
    python eval/sql_exact_match.py --kind speculative --path runs/smollm2-sql/final   # same outputs, fewer passes

Exact match compares normalised SQL text (case, spacing, quotes; see streamspec.evaluation.metrics);
valid means the query runs against the database's schema in an in-memory SQLite.
"""

import argparse
import json
import time

from streamspec.data.spider import load_spider
from streamspec.evaluation.metrics import evaluate_sql, greedy_generator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", required=True, choices=["base", "next_token", "streamed", "speculative"])
    parser.add_argument("--path", help="adapter folder (next_token) or streamed checkpoint (streamed)")
    parser.add_argument("--limit", type=int, help="only the first N test questions (fixed order)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="write the predictions and scores as JSON here")
    args = parser.parse_args()
    if args.kind != "base" and not args.path:
        parser.error(f"--kind {args.kind} needs --path")
    rows = load_spider("test")[: args.limit]
    stats = []
    generate, tokenizer = greedy_generator(args.kind, args.path, stats=stats)
    start = time.perf_counter()
    result = evaluate_sql(generate, tokenizer, rows, args.max_new_tokens)
    result["seconds"] = round(time.perf_counter() - start, 1)
    if stats:
        tokens = sum(s.tokens.shape[1] for s in stats)
        passes = sum(s.forward_passes for s in stats)
        result["tokens_per_pass"] = round(tokens / passes, 3)
    print(json.dumps({k: v for k, v in result.items() if k != "predictions"}))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"kind": args.kind, "path": args.path, **result}, handle, indent=2)


if __name__ == "__main__":
    main()
