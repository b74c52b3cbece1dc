"""Where one decoding step's time goes: torch's profiler over 32 one-token passes of the shipped SQL
streams, one thread, per configuration (default: bfloat16 compiled on streamspec's CPU kernels,
bfloat16 compiled on torch's and transformers' defaults, float32 eager packed), the operators by
self time and grouped: linear layers, attention, the compiled graph's own code, the rest
(docs/benchmarks.md, "The step at the machine's limit").

    OMP_NUM_THREADS=1 python eval/step_profile.py
    OMP_NUM_THREADS=1 python eval/step_profile.py --configs "bfloat16 packed compiled"
    OMP_NUM_THREADS=1 python eval/step_profile.py --configs "bfloat16 packed compiled" --tree-top-k 2,1,1  # tree passes
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from streamspec.data.build import prompt_ids
from streamspec.data.tasks import task_rows
from streamspec.decoding import DecodeConfig, generate
from streamspec.devices import cpu_model
from streamspec.loading import load_for_inference

CONFIGS = ("bfloat16 packed compiled", "bfloat16 compiled", "float32 packed", "bfloat16 packed", "float32 packed compiled")
# operator names (substrings) of each group; what matches none is "the rest"
GROUPS = {
    "linear layers": ("_linear_pointwise", "packed_linear", "streamspec_native::linear", "aten::mm", "aten::addmm", "aten::linear"),
    "attention": ("scaled_dot_product", "aten::bmm", "aten::softmax", "aten::_softmax", "decode_attention"),
}


def _group(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "compiled graph code" if name.startswith(("## Call CompiledFxGraph", "Torch-Compiled Region")) else "the rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="streamspec:smollm2-135m-sql-streams")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS[:3]), choices=CONFIGS)
    parser.add_argument("--passes", type=int, default=32)
    parser.add_argument("--tree-top-k", default=None, help="profile draft-tree passes of this shape (e.g. 2,1,1) instead of one token a pass")
    args = parser.parse_args()
    tree = tuple(int(k) for k in args.tree_top_k.split(",")) if args.tree_top_k else None
    torch.set_num_threads(torch.get_num_threads())
    what = f"tree {args.tree_top_k} passes (the passes of {args.passes} new tokens)" if tree else "one-token passes"
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s), {args.passes} {what}")
    for name in args.configs:
        dtype = name.split()[0]
        loaded = load_for_inference(args.checkpoint, dtype=dtype, cpu_kernels="packed" in name)
        config = DecodeConfig(compile="compiled" in name, tree_top_k=tree)
        ids = prompt_ids(loaded.tokenizer, task_rows("sql", "test")[0])
        generate(loaded.model, ids, 8, speculative=tree is not None, config=config)  # compiles (or loads) the graph first
        # the prefill alone, then the prefill and the passes: the difference per operator is the passes'
        times = []
        for tokens in (1, args.passes + 1):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = generate(loaded.model, ids, tokens, speculative=tree is not None, config=config)
            times.append({e.key: e.self_cpu_time_total for e in prof.key_averages()})
        passes = out.forward_passes - 1
        step_ms = 1000 * sum(out.seconds_per_pass[1:]) / passes
        per_op = {k: (us - times[0].get(k, 0.0)) / passes for k, us in times[1].items()}
        per_op = {k: us for k, us in per_op.items() if us > 0}
        groups: dict[str, float] = {}
        for key, us in per_op.items():
            groups[_group(key)] = groups.get(_group(key), 0.0) + us
        print(f"\n## {name}: {step_ms:.1f} ms a step (wall); per step, self time by group")
        print("| group | ms a step | share |\n|---|---|---|")
        total = sum(groups.values())
        for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"| {group} | {us / 1000:.2f} | {100 * us / total:.1f}% |")
        print("| operator | ms a step |\n|---|---|")
        for key, us in sorted(per_op.items(), key=lambda kv: -kv[1])[:8]:
            print(f"| {key[:60]} | {us / 1000:.2f} |")

if __name__ == "__main__":
    main()
