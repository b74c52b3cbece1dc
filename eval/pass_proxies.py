"""The pass proxies a CPU measures for a GPU (docs/gpu.md, "What a CPU measures for a GPU"): for one
token a pass and the chain, compiled, on the default model with the shipped SQL streams: the first
compile's seconds and the kernels inductor generated for it, then on held-out Spider prompts the
host ms a pass outside the compiled call, device→host reads and graph calls a pass, the tensors the
host builds through `torch.tensor` per generation (a pass that builds one shows as one per pass
more), and tokens/s. Counts do not depend on the machine's load;
times do. A fresh inductor cache (`TORCHINDUCTOR_CACHE_DIR`) makes the compile and kernel figures
those of a first compile.

    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python eval/pass_proxies.py --limit 3
"""

import argparse
import json
import time

import torch
from torch._inductor import metrics

from streamspec.data.build import prompt_ids
from streamspec.data.tasks import task_rows
from streamspec.decoding import DecodeConfig, generate
from streamspec.devices import cpu_model
from streamspec.loading import load_for_inference

ROWS = {"one token": (DecodeConfig(compile=True), False), "chain": (DecodeConfig(tree_top_k=1, compile=True), True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="streamspec:smollm2-135m-sql-streams")
    parser.add_argument("--limit", type=int, default=3, help="held-out prompts (the test split's first N)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s)", flush=True)
    loaded = load_for_inference(args.checkpoint, dtype="float32")
    model, eos = loaded.model, loaded.tokenizer.eos_token_id
    prompts = [prompt_ids(loaded.tokenizer, row) for row in task_rows("sql", "test")[: args.limit]]
    results = {}
    for name, (config, speculative) in ROWS.items():
        kernels = metrics.generated_kernel_count
        start = time.perf_counter()
        generate(model, prompts[0], 8, config=config, eos_token_id=eos, speculative=speculative)
        figures = {"first_call_s": round(time.perf_counter() - start, 1),
                   "kernels_generated": metrics.generated_kernel_count - kernels}
        built, make = [0], torch.tensor

        def counted(*a, **k):
            built[0] += 1
            return make(*a, **k)

        seconds = tokens = passes = host = reads = calls = made = 0
        for ids in prompts:
            built[0] = 0
            torch.tensor = counted
            try:
                begin = time.perf_counter()
                out = generate(model, ids, args.max_new_tokens, config=config, eos_token_id=eos,
                               speculative=speculative)
                seconds += time.perf_counter() - begin
            finally:
                torch.tensor = make
            steps = out.forward_passes - 1
            passes, tokens = passes + steps, tokens + out.tokens.shape[1]
            host += sum(out.seconds_per_pass[1:]) - sum(out.forward_seconds_per_pass[1:])
            reads, calls = reads + out.host_reads - 1, calls + out.graph_calls  # (the prefill's read apart)
            made += built[0]
        figures.update(tokens_per_s=round(tokens / seconds, 2), host_ms_per_pass=round(1000 * host / passes, 3),
                       reads_per_pass=round(reads / passes, 3), graph_calls_per_pass=round(calls / passes, 3),
                       host_tensors_per_call=round(made / len(prompts), 2), passes_per_call=round(passes / len(prompts), 1))
        results[name] = figures
        print(name, json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
