"""The bf16 stream rows measured side by side (`StreamedModel.use_bf16_stream_rows`): two copies of
one float32 model in one process, one with its stream rows in bf16 and one without, decode the same
held-out prompts compiled, in alternating order (so a drift of the machine's speed reaches both
alike). Prints per decoding row each model's tokens/s, forward ms a pass after the prefill and
tokens a pass, the ratio, and whether the two decoded the same tokens (they must: stream rows only
draft).

    OMP_NUM_THREADS=2 python eval/bf16_stream_rows_ab.py --limit 10 --repeats 2
"""

import argparse
import collections
import time

import torch

from streamspec.data.build import prompt_ids
from streamspec.data.tasks import task_rows
from streamspec.decoding import DecodeConfig, generate
from streamspec.devices import cpu_model
from streamspec.loading import load_for_inference

ROWS = {
    "chain": DecodeConfig(tree_top_k=1, compile=True),
    "confidence tree (7)": DecodeConfig(tree_top_k=3, tree_budget=7, compile=True),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="streamspec:smollm2-135m-sql-streams")
    parser.add_argument("--task", default="sql")
    parser.add_argument("--limit", type=int, default=10, help="held-out prompts (the test split's first N)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s)", flush=True)
    plain = load_for_inference(args.checkpoint, dtype="float32", bf16_stream_rows=False)
    low = load_for_inference(args.checkpoint, dtype="float32")
    if not low.model.use_bf16_stream_rows():
        raise SystemExit("the bf16 stream rows do not apply here (a float32 lossless streamed model on a CPU "
                         "with AVX-512 BF16 and streamspec's kernels is needed)")
    models = {"float32 stream rows": plain.model, "bf16 stream rows": low.model}
    tokenizer, eos = plain.tokenizer, plain.tokenizer.eos_token_id
    prompts = [prompt_ids(tokenizer, row) for row in task_rows(args.task, "test")[: args.limit]]
    for name, config in ROWS.items():
        for model in models.values():  # the first compile, outside the timings
            generate(model, prompts[0], 8, config=config, eos_token_id=eos)
        seconds, tokens, passes, forward = (collections.Counter() for _ in range(4))
        same = True
        for repeat in range(args.repeats):
            for i, ids in enumerate(prompts):
                order = list(models.items())
                outputs = {}
                for label, model in order if (i + repeat) % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    out = generate(model, ids, args.max_new_tokens, config=config, eos_token_id=eos)
                    seconds[label] += time.perf_counter() - start
                    tokens[label] += out.tokens.shape[1]
                    passes[label] += out.forward_passes - 1  # after the prefill
                    forward[label] += sum(out.seconds_per_pass[1:])
                    outputs[label] = out.tokens.tolist()
                same &= len({str(v) for v in outputs.values()}) == 1
        speed = {label: tokens[label] / seconds[label] for label in models}
        for label in models:
            print(f"{name}, {label}: {speed[label]:.2f} tokens/s, {1000 * forward[label] / passes[label]:.2f} ms "
                  f"a pass, {tokens[label] / (passes[label] + args.limit * args.repeats):.3f} tokens a pass",
                  flush=True)
        print(f"{name}: bf16 / float32 tokens/s {speed['bf16 stream rows'] / speed['float32 stream rows']:.3f}, "
              f"same tokens: {same}", flush=True)
