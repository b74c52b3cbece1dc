"""A lever measured before it is built: drafts through a subset of the vocabulary (the prompt's
tokens, end of text, and the tokens of the task's training split: its prompts and gold answers),
the way frequency-ranked draft vocabularies cut the drafts' LM head. Prints the chain's tokens per
pass after the prefill on held-out prompts (eager, verified on the device) with the drafts' logits
masked to the subset against the full vocabulary, and what the drafts' head costs on one
sequence's 3 stream rows: the bf16 copy over the whole vocabulary against one over the subset's
size. Verification keeps the full head, so the tokens are the model's own either way.

    OMP_NUM_THREADS=1 python eval/draft_vocab_subset.py --limit 10
"""

import argparse
import collections
import time

import torch

from streamspec.data.build import prompt_ids
from streamspec.data.tasks import task_rows
from streamspec.decoding import DecodeConfig, generate
from streamspec.devices import cpu_model
from streamspec.kernels import pack_linear_layers
from streamspec.loading import load_for_inference


def training_tokens(tokenizer, task: str) -> set[int]:
    counts = collections.Counter()
    for row in task_rows(task, "train"):
        counts.update(prompt_ids(tokenizer, row)[0].tolist())
        counts.update(tokenizer(row["completion"], add_special_tokens=False).input_ids)
    return set(counts)


def head_ms(rows: torch.Tensor, vocab: int, repeats: int = 50) -> float:
    head = torch.nn.Linear(rows.shape[1], vocab, bias=False).to(torch.bfloat16)
    pack_linear_layers(head)
    x = rows.to(torch.bfloat16)
    with torch.no_grad():
        for _ in range(5):
            head(x)
        start = time.perf_counter()
        for _ in range(repeats):
            head(x)
    return 1000 * (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="streamspec:smollm2-135m-sql-streams")
    parser.add_argument("--task", default="sql")
    parser.add_argument("--limit", type=int, default=10, help="held-out prompts (the test split's first N)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    loaded = load_for_inference(args.checkpoint, dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s)")
    known = training_tokens(tokenizer, args.task)
    vocab = model.hf_model.lm_head.weight.shape[0]
    print(f"{len(known)} distinct tokens in the {args.task} training split, of {vocab}")
    full_head = model.draft_head
    config = DecodeConfig(compile=False, verify="device", tree_top_k=1)
    for subset in (False, True):
        tokens = passes = 0
        for row in task_rows(args.task, "test")[: args.limit]:
            ids = prompt_ids(tokenizer, row)
            if subset:
                keep = torch.zeros(vocab, dtype=torch.bool)
                keep[sorted(known)] = True
                keep[ids[0]] = True
                keep[tokenizer.eos_token_id] = True
                model.draft_head = lambda hidden, keep=keep: full_head(hidden).masked_fill(~keep, float("-inf"))
            out = generate(model, ids, args.max_new_tokens, config=config)
            model.draft_head = full_head
            tokens += out.tokens.shape[1]
            passes += out.forward_passes - 1
        what = "prompt + training tokens" if subset else "full vocabulary"
        print(f"drafts over the {what}: {tokens / passes:.3f} tokens a pass after the prefill ({tokens} tokens)")
    rows = torch.randn(3, model.hf_model.lm_head.weight.shape[1])
    for size in (vocab, 8192, 2048):
        print(f"bf16 drafts' head, 3 rows, {size} tokens: {head_ms(rows, size):.3f} ms")
