"""What stream-only adapters cost a decoding step: one-token-per-pass decoding of a checkpoint with
`stream_adapter_rank`, with its adapters attached and detached, alternately, on validation prompts.

    python eval/stream_adapter_cost.py --checkpoint runs/smollm2-sql-lossless-adapters-main/final

Each pass carries γ stream rows through the MSA layers either way; only the adapters' residuals
differ. Prints the median milliseconds per decoding pass (prefill excluded) both ways.
"""

import argparse
import json
import statistics

import torch

from streamspec.evaluation.benchmark import held_out_rows
from streamspec.cli import add_device_args
from streamspec.data.build import prompt_ids
from streamspec.decoding import generate
from streamspec.loading import load_for_inference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--task", choices=["sql", "summarize"], default="sql")
    parser.add_argument("--limit", type=int, default=5, help="validation prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    add_device_args(parser)
    args = parser.parse_args()
    loaded = load_for_inference(args.checkpoint, device=args.device, dtype=args.dtype)  # packed kernels on a CPU
    model, tokenizer = loaded.model, loaded.tokenizer
    adapters = getattr(model.streams, "adapters", None)
    if adapters is None:
        raise SystemExit(f"{args.checkpoint} has no stream adapters (stream_adapter_rank is null)")
    rows = held_out_rows(args.task, split="validation")[: args.limit]
    prompts = [prompt_ids(tokenizer, r).to(loaded.device) for r in rows]
    steps = {"with_adapters": [], "without_adapters": []}
    with torch.no_grad():
        for _ in range(args.repeats):
            for ids in prompts:
                for name in steps:
                    if name == "with_adapters":
                        model.streams.adapters = adapters
                    else:
                        del model.streams.adapters
                    model.insert_stream_modules()  # the adapter wrappers follow what streams holds
                    out = generate(model, ids, args.max_new_tokens, speculative=False)
                    steps[name] += out.seconds_per_pass[1:]
    model.streams.adapters = adapters
    model.insert_stream_modules()
    result = {name: round(1000 * statistics.median(times), 2) for name, times in steps.items()}
    result["difference_ms"] = round(result["with_adapters"] - result["without_adapters"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
