"""One decoding step of streamspec, eager against compiled, float32 against bfloat16, side by side in
one process on the same held-out prompts (batch 1, greedy): ms per decoding step (the prefill
left out) of one token per pass and of a draft tree, tokens per pass, and bf16's greedy agreement
with float32 (share of identical outputs, and the first position where they part).

What `--compile auto` and `--dtype auto` are decided on (docs/benchmarks.md, "The step at the
machine's limit"). Each configuration first decodes, untimed, one prompt of each compiled cache size
the timed prompts meet, so compile time is paid (and reported) before them.

    OMP_NUM_THREADS=1 python eval/step_speed.py --checkpoint streamspec:smollm2-135m-sql-streams --limit 5
    OMP_NUM_THREADS=1 python eval/step_speed.py --dtypes bfloat16 --lookup 8,1,3 --limit 5   # lookup trees compiled
    OMP_NUM_THREADS=1 python eval/step_speed.py --dtypes "bfloat16" "bfloat16 packed" --limit 5  # streamspec's CPU kernels
    OMP_NUM_THREADS=1 python eval/step_speed.py --dtypes "bfloat16 packed" "bfloat16 packed onednn" --limit 5  # its own kernels or not
    OMP_NUM_THREADS=1 python eval/step_speed.py --dtypes "float32 packed" "float32 packed onednn" --limit 5
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from streamspec.devices import cpu_model
from streamspec.data.build import prompt_ids
from streamspec.data.tasks import task_rows
from streamspec.decoding import DecodeConfig, generate
from streamspec.decoding.compiled import compiled_capacity
from streamspec.decoding.lookup import PromptLookup
from streamspec.evaluation.peers import floor_ms, kv_bytes_per_token, measure_read_bandwidth, weight_bytes
from streamspec.kernels import pack_linear_layers, unpack_linear_layers, use_decode_attention
from streamspec.loading import load_for_inference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="streamspec:smollm2-135m-sql-streams")
    parser.add_argument("--task", default="sql")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree-top-k", default="2,1,1")
    parser.add_argument("--lookup", default=None, metavar="L,M[,N]",
                        help="also the tree with these prompt-lookup branches, eager and compiled")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float32 packed", "bfloat16 packed"],
                        choices=["float32", "bfloat16", "float32 packed", "bfloat16 packed", "float32 packed onednn",
                                 "bfloat16 packed onednn"],
                        help="which models to run: torch's and transformers' default kernels, or ('packed') "
                             "streamspec's CPU kernels (streamspec.kernels: packed oneDNN layers, the decoding "
                             "attention; 'onednn': layers on oneDNN alone and attention on torch's operators, without "
                             "streamspec's own kernels, streamspec.native); the reference for agreement is float32 one token when run")
    parser.add_argument("--out", default=None, help="a JSON file for the figures")
    args = parser.parse_args()
    tree = tuple(int(x) for x in args.tree_top_k.split(","))
    lookup = PromptLookup.parse(args.lookup) if args.lookup else None
    models = {dtype: load_for_inference(args.checkpoint, dtype=dtype, cpu_kernels=False)
              for dtype in ("float32", "bfloat16") if dtype in args.dtypes}
    for dtype in ("float32", "bfloat16"):  # what streamspec runs by default on a CPU: its own kernels
        if f"{dtype} packed" in args.dtypes:
            models[f"{dtype} packed"] = load_for_inference(args.checkpoint, dtype=dtype)
    for dtype in ("float32", "bfloat16"):  # the same on oneDNN and torch's attention alone
        if f"{dtype} packed onednn" in args.dtypes:
            onednn = load_for_inference(args.checkpoint, dtype=dtype)
            unpack_linear_layers(onednn.model)
            pack_linear_layers(onednn.model, own_kernel=False)
            use_decode_attention(onednn.model, own_kernel=False)
            models[f"{dtype} packed onednn"] = onednn
    tokenizer = next(iter(models.values())).tokenizer
    eos = tokenizer.eos_token_id
    rows = task_rows(args.task, "test")[: args.limit]
    configs = {}
    for dtype in models:
        for compiled in (False, True):
            configs[f"{dtype} one token{' compiled' if compiled else ''}"] = (dtype, False, DecodeConfig(compile=compiled))
            configs[f"{dtype} tree {args.tree_top_k}{' compiled' if compiled else ''}"] = (
                dtype, True, DecodeConfig(tree_top_k=tree, compile=compiled))
            if lookup is not None:
                configs[f"{dtype} tree {args.tree_top_k} + lookup {args.lookup}{' compiled' if compiled else ''}"] = (
                    dtype, True, DecodeConfig(tree_top_k=tree, lookup=lookup, compile=compiled))
    # one untimed prompt of each compiled cache size the timed prompts meet (compile paid here)
    sizes, warm_prompts = set(), []
    for row in rows:
        ids = prompt_ids(tokenizer, row)
        if compiled_capacity(ids.shape[1] + args.max_new_tokens) not in sizes:
            sizes.add(compiled_capacity(ids.shape[1] + args.max_new_tokens))
            warm_prompts.append(ids)
    warm = {}
    for name, (dtype, speculative, config) in configs.items():
        start = time.perf_counter()
        for ids in warm_prompts:
            generate(models[dtype].model, ids, args.max_new_tokens, eos_token_id=eos, speculative=speculative,
                     config=config)
        warm[name] = round(time.perf_counter() - start, 1)
    steps = {name: [0.0, 0, 0] for name in configs}  # seconds of decoding steps, steps, tokens
    outputs = {name: [] for name in configs}
    for row in rows:
        ids = prompt_ids(tokenizer, row)
        for name, (dtype, speculative, config) in configs.items():
            out = generate(models[dtype].model, ids, args.max_new_tokens, eos_token_id=eos, speculative=speculative,
                           config=config)
            steps[name][0] += sum(out.seconds_per_pass[1:])
            steps[name][1] += out.forward_passes - 1
            steps[name][2] += out.tokens.shape[1]
            outputs[name].append(out.tokens[0].tolist())
    reference = outputs.get("float32 one token") or outputs[next(iter(outputs))]
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "prompts": len(rows), "rows": {}}
    print(f"{result['cpu']}, {result['threads']} thread(s), {len(rows)} prompts, {args.max_new_tokens} new tokens")
    # the memory floor of a one-token step per dtype: its weights and the KV cache at the mean
    # context over the read bandwidth measured now, at this thread count
    bandwidth = measure_read_bandwidth()
    context = sum(prompt_ids(tokenizer, row).shape[1] for row in rows) / len(rows) + args.max_new_tokens / 2
    result["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    result["floor_ms"] = {}
    for dtype in models:
        model = models[dtype].model
        floor = floor_ms(weight_bytes(model), kv_bytes_per_token(model.config, next(model.parameters()).dtype), context,
                         bandwidth)
        result["floor_ms"][dtype] = round(floor, 2)
    print(f"memory floor of one token a pass (weights + KV at {context:.0f} entries, {bandwidth / 1e9:.1f} GB/s): "
          + ", ".join(f"{d} {ms} ms" for d, ms in result["floor_ms"].items()))
    print(f"| configuration | ms per decoding step | × floor | tokens per pass | tokens/s (steps) | identical to {'fp32 one token' if 'float32 one token' in outputs else next(iter(outputs))} | first call s |")
    print("|---|---|---|---|---|---|---|")
    for name, (seconds, n, tokens) in steps.items():
        same = sum(a == b for a, b in zip(outputs[name], reference))
        entry = {"ms_per_step": round(1000 * seconds / max(n, 1), 2), "tokens_per_pass": round(tokens / max(n + len(rows), 1), 3),
                 "identical_to_fp32": f"{same}/{len(rows)}", "first_call_seconds": warm[name]}
        entry["x_floor"] = round(entry["ms_per_step"] / result["floor_ms"][configs[name][0]], 2)
        result["rows"][name] = entry
        print(f"| {name} | {entry['ms_per_step']} | {entry['x_floor']} | {entry['tokens_per_pass']} | "
              f"{round(1000 * entry['tokens_per_pass'] / max(entry['ms_per_step'], 1e-9), 1)} | {entry['identical_to_fp32']} | "
              f"{warm[name]} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
