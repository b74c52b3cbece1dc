"""Top-1 of each draft (stream j, or Medusa head j) and of the chain against the model's own
tokens, teacher-forced, for several checkpoints on the same rows: the validation split of a
recipe's data (for a ``data.distill`` recipe, the model's own completions of the validation
prompts, what lossless decoding is accepted against), or the model's own greedy replies to a
task's held-out prompts (``--task``: Spider's held-out questions, MT-bench's first turns).

    python eval/draft_accuracy.py --recipe recipes/smollm2-135m/sql_streams_distilled.yaml \
        --checkpoints runs/smollm2-sql-streams-labelled/final runs/smollm2-sql-medusa/final
    python eval/draft_accuracy.py --task chat --limit 30 --max-new-tokens 128 \
        --checkpoints runs/smollm2-chat-streams-10/final

Prints one JSON line per checkpoint: ``{term}_top1`` (and ``{term}_loss``) for main, each draft
and the chain (``chain_j``: streams 1..j all right), the chain's tokens a pass averaged over the
text's positions, and with ``--task`` for streams ``chain_crr``: the CRR a greedy chain reaches on
those replies, walked pass by pass from the teacher-forced drafts (what `streamspec eval`'s chain
row measures by decoding, with no timing).
"""

import argparse
import json
import sys

from streamspec.data.build import tokenize_rows
from streamspec.evaluation.benchmark import held_out_rows
from streamspec.training.draft_accuracy import chain_crr, draft_accuracy, greedy_examples, tokens_a_pass
from streamspec.loading import load_for_inference
from streamspec.training.recipe import load_recipe
from streamspec.training.trainer import task_rows

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rows_from = parser.add_mutually_exclusive_group(required=True)
    rows_from.add_argument("--recipe", help="whose validation rows to score (its data section)")
    rows_from.add_argument("--task", choices=["sql", "chat", "summarize"],
                           help="score the model's own greedy replies to this task's held-out prompts")
    parser.add_argument("--checkpoints", nargs="+", required=True, help="streamed or Medusa checkpoints")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="only the first N rows (prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="--task: the replies' length at most")
    args = parser.parse_args()
    try:
        recipe = load_recipe(args.recipe) if args.recipe else None
        rows = (task_rows(recipe, "validation") if recipe else held_out_rows(args.task))[: args.limit]
        for checkpoint in args.checkpoints:
            loaded = load_for_inference(checkpoint, device="cpu", dtype="float32", cpu_kernels=False)
            tokenizer = loaded.tokenizer
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if recipe:
                examples, _ = tokenize_rows(rows, tokenizer, recipe.data.max_length, recipe.data.overflow)
            else:  # the checkpoint's own main outputs: what its drafts are accepted against
                examples = greedy_examples(loaded.model.hf_model, tokenizer, rows, args.max_new_tokens)
            metrics = draft_accuracy(loaded.model, examples, pad, args.batch_size)
            simulated = {}
            if not recipe and hasattr(loaded.model, "stream_hits"):  # streams on their own replies
                simulated["chain_crr"] = round(chain_crr(loaded.model, examples), 4)
            print(json.dumps({"checkpoint": checkpoint, "rows": len(examples), **metrics,
                              "chain_tokens_a_pass": tokens_a_pass(metrics), **simulated}), flush=True)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"draft_accuracy: error: {err}")
