"""Tokens/s of `streamspec.generate` for one-token-per-pass decoding, the chain and draft trees,
and a batch, with the packed CPU kernels as `streamspec eval` uses them: the figures of
docs/benchmarks.md, "Batches".

    python eval/decode_step_speed.py --checkpoint runs/smollm2-reason-lossless-adapters/final \
        --limit 4 --max-new-tokens 64 --trees 1 2,1,1 3 --batch 4 --repeats 2 \
        --verify auto device --lookup 8,2 --head-rows 1 4 16 40 160

`--verify` adds a row per tree for each setting of `generate`'s ``verify`` (``auto``: the host
walk on a CPU; ``device``: the device step), `--lookup L,M` a row per tree with prompt-lookup
branches, `--tree-budget N...` a row per budget of trees grown by confidence, `--head-rows` the time of one
LM-head call over that many rows (median of 7).

Prompts are GSM8K validation problems (rows 1237+) in the checkpoint's chat template; every
result is checked against one-token-per-pass decoding (greedy), so a faster row that decodes
something else is reported, not hidden. Pass ``--compile`` to time `generate(..., compile=True)`
next to the uncompiled rows (with `--batch`, batches too) (when this version has it): each compile row first decodes every
prompt once untimed, and the seconds that took (compilation included: the first call compiles,
and a prompt whose cache capacity falls in another 256-entry step compiles again) are reported
as ``warmup_seconds``, apart from the timed repeats.
"""

import argparse
import inspect
import json
import time

import torch

from streamspec.cli import add_device_args, lookup_arg, tree_arg
from streamspec.decoding import generate
from streamspec.kernels import cpu_kernels_available, pack_linear_layers
from streamspec.loading import load_for_inference
from streamspec.reason.tasks import load_problems


def _decode_batches(model, tokenizer, prompts, args, eos, device, extra, reference=None):
    """Decode the prompts in batches of ``--batch`` (padded on the tokenizer's side); returns the
    seconds, the tokens and whether every row equals one token a pass (`reference`)."""
    seconds = tokens = 0
    same = True
    for first in range(0, len(prompts), args.batch):
        group = prompts[first : first + args.batch]
        batch = tokenizer.pad({"input_ids": [p[0].tolist() for p in group]}, return_tensors="pt")
        start = time.perf_counter()
        out = generate(model, batch.input_ids.to(device), args.max_new_tokens, eos_token_id=eos,
                       attention_mask=batch.attention_mask.to(device), **extra)
        seconds += time.perf_counter() - start
        for j, n in enumerate(out.lengths):
            if reference is not None:
                same &= out.tokens[j, :n].tolist() == reference[first + j]
            tokens += n
    return seconds, tokens, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a streamed checkpoint")
    parser.add_argument("--offset", type=int, default=1240, help="first GSM8K row (train split; 1237+ is validation)")
    parser.add_argument("--limit", type=int, default=4, help="problems")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trees", type=tree_arg, nargs="+", default=[1, (2, 1, 1), 3])
    parser.add_argument("--batch", type=int, default=0, help="also decode the prompts in batches of this size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also time compile=True")
    parser.add_argument("--verify", nargs="+", default=["auto"], choices=["auto", "device", "host"],
                        help="one row per tree and per verify setting (generate's verify=)")
    parser.add_argument("--tree-budget", type=int, nargs="*", default=[],
                        help="also time trees grown by confidence (3 candidates per stream) up to each budget")
    parser.add_argument("--head-rows", type=int, nargs="*", default=[],
                        help="also time one LM-head call (final norm, head, argmax) over this many rows each")
    parser.add_argument("--lookup", type=lookup_arg, default=None, metavar="L,M[,N]",
                        help="also time each tree with these prompt-lookup branches")
    add_device_args(parser)
    args = parser.parse_args()
    if args.limit < 1 or args.repeats < 1 or args.max_new_tokens < 1 or args.batch < 0:
        parser.error("--limit, --repeats and --max-new-tokens must be >= 1, --batch >= 0")
    torch.set_num_threads(args.threads)
    loaded = load_for_inference(args.checkpoint, device=args.device, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    if device.type == "cpu" and cpu_kernels_available():
        pack_linear_layers(model)
    prompts = []
    for problem in load_problems(task="gsm8k", offset=args.offset, limit=args.limit):
        text = tokenizer.apply_chat_template([{"role": "user", "content": problem.question}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device))
    eos = tokenizer.eos_token_id
    can_compile = "compile" in inspect.signature(generate).parameters
    rows: list[tuple[str, dict]] = [("one token per pass", {"speculative": False})]
    can_verify = "verify" in inspect.signature(generate).parameters
    for verify in args.verify if can_verify else ["auto"]:
        extra = {"verify": verify} if verify != "auto" else {}
        suffix = f", verify={verify}" if verify != "auto" else ""
        rows += [(f"tree {t}{suffix}", {"tree_top_k": t, **extra}) for t in args.trees]
        if args.lookup is not None:
            rows += [(f"tree {t} + lookup {args.lookup.tokens},{args.lookup.matches}{suffix}",
                      {"tree_top_k": t, "lookup": args.lookup, **extra}) for t in args.trees]
        rows += [(f"confidence tree, budget {b}{suffix}", {"tree_top_k": 3, "tree_budget": b, **extra})
                 for b in args.tree_budget]
    if args.compile and can_compile:
        rows += [(f"tree {t}, compile", {"tree_top_k": t, "compile": True}) for t in args.trees]
    head_ms = {}
    with torch.no_grad():
        for rows_count in args.head_rows:
            hidden = torch.randn(rows_count, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                model.head(hidden).argmax(-1).tolist()
                times.append(time.perf_counter() - start)
            head_ms[rows_count] = round(sorted(times)[3] * 1000, 2)  # median of 7
    reference: dict[int, list[int]] = {}
    results: dict[str, dict] = {}
    for name, kwargs in rows:
        if kwargs.get("compile"):
            start = time.perf_counter()
            for ids in prompts:
                generate(model, ids, args.max_new_tokens, eos_token_id=eos, **kwargs)
            results[name] = {"tokens_per_second": [], "tokens_per_pass": None, "identical": True,
                             "warmup_seconds": round(time.perf_counter() - start, 1)}
    for repeat in range(args.repeats):
        for name, kwargs in rows:
            seconds = tokens = passes = 0
            same = True
            for i, ids in enumerate(prompts):
                start = time.perf_counter()
                out = generate(model, ids, args.max_new_tokens, eos_token_id=eos, **kwargs)
                seconds += time.perf_counter() - start
                got = out.tokens[0].tolist()
                reference.setdefault(i, got)
                same &= got == reference[i]
                tokens, passes = tokens + len(got), passes + out.forward_passes
            entry = results.setdefault(name, {"tokens_per_second": [], "tokens_per_pass": None, "identical": True})
            entry["tokens_per_second"].append(round(tokens / seconds, 2))
            entry["tokens_per_pass"] = round(tokens / passes, 3)
            entry["identical"] &= same
        if args.batch > 1:
            for compiled in [False] + ([True] if args.compile and can_compile else []):
                extra = {"compile": True} if compiled else {}
                name = f"batch {args.batch}, chain" + (", compile" if compiled else "")
                if compiled and repeat == 0:  # untimed: the first calls compile (one graph per batch size)
                    start = time.perf_counter()
                    _decode_batches(model, tokenizer, prompts, args, eos, device, extra)
                    results[name] = {"tokens_per_second": [], "identical": True,
                                     "warmup_seconds": round(time.perf_counter() - start, 1)}
                seconds, tokens, same = _decode_batches(model, tokenizer, prompts, args, eos, device, extra, reference)
                entry = results.setdefault(name, {"tokens_per_second": [], "identical": True})
                entry["tokens_per_second"].append(round(tokens / seconds, 2))
                entry["identical"] &= same
    print(json.dumps({"device": str(device), "dtype": str(next(model.parameters()).dtype), "threads": args.threads,
                      "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "lm_head_ms_by_rows": head_ms, "results": results}, indent=1))


if __name__ == "__main__":
    main()
