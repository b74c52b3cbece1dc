"""Validation top-1 of each draft (stream j, or Medusa head j) against the model's own next
tokens, for several checkpoints on the same rows: the validation split of a recipe's data (for a
``data.distill`` recipe, the model's own completions of the validation prompts, what lossless
decoding is accepted against).

    python eval/draft_accuracy.py --recipe recipes/smollm2-135m/sql_streams_distilled.yaml \
        --checkpoints runs/smollm2-sql-streams-labelled/final runs/smollm2-sql-streams-distilled/final \
                      runs/smollm2-sql-medusa/final

Prints one JSON line per checkpoint: ``{term}_top1`` and ``{term}_loss`` for main and each draft.
"""

import argparse
import json

import torch

from streamspec.data.build import PadCollator, tokenize_rows
from streamspec.loading import load_for_inference
from streamspec.training.recipe import load_recipe
from streamspec.training.trainer import evaluation_counts, summarize_counts, task_rows

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="whose validation rows to score (its data section)")
    parser.add_argument("--checkpoints", nargs="+", required=True, help="streamed or Medusa checkpoints")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="only the first N validation rows")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    rows = task_rows(recipe, "validation")[: args.limit]
    for checkpoint in args.checkpoints:
        loaded = load_for_inference(checkpoint, device="cpu", dtype="float32", cpu_kernels=False)
        tokenizer = loaded.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        examples, _ = tokenize_rows(rows, tokenizer, recipe.data.max_length, recipe.data.overflow)
        collate = PadCollator(pad)
        sums: dict[str, float] = {}
        with torch.no_grad():
            for i in range(0, len(examples), args.batch_size):
                for key, value in evaluation_counts(loaded.model, collate(examples[i : i + args.batch_size])).items():
                    sums[key] = sums.get(key, 0.0) + value
        print(json.dumps({"checkpoint": checkpoint, "rows": len(examples), **summarize_counts(sums)}), flush=True)
