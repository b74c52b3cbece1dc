"""Tokens/s and tokens per pass of a SpecReason drafter alone, with and without its streams and
for several draft trees, on GSM8K validation problems (rows 1237+, which no evaluation uses):

    python eval/reason_draft_speed.py --drafter runs/smollm2-reason-lossless-adapters/final \
        --offset 1240 --limit 3 --max-new-tokens 96 --trees 1 2,1,1 3 --repeats 2

Each problem is rendered as SpecReason's drafter sees it (the solving prompt in the chat template)
and decoded greedily by `streamspec.decoding.session.DecodingSession`, one thread.
"""

import argparse
import json
import time

import torch

from streamspec.cli import tree_arg
from streamspec.loading import load_for_inference
from streamspec.reason.backends import chat_frame
from streamspec.reason.tasks import load_problems
from streamspec.decoding.session import DecodingSession


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="a streamed checkpoint")
    parser.add_argument("--offset", type=int, default=1240)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--trees", type=tree_arg, nargs="+", default=[1, (2, 1, 1), 3])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_for_inference(args.drafter, device="cpu", dtype="float32")
    frame = chat_frame(loaded.tokenizer)
    prompts = [loaded.tokenizer.encode(frame.prefix(p.question), add_special_tokens=False)
               for p in load_problems(task="gsm8k", offset=args.offset, limit=args.limit)]
    results: dict[str, list] = {}
    for _ in range(args.repeats):
        for tree in ["plain", *args.trees]:
            seconds = tokens = passes = 0
            for ids in prompts:
                session = DecodingSession(loaded.model.hf_model) if tree == "plain" else DecodingSession(loaded.model, tree_top_k=tree)
                session.extend(ids)
                start = time.perf_counter()
                out = session.generate(args.max_new_tokens)
                seconds += time.perf_counter() - start
                tokens, passes = tokens + len(out.tokens), passes + out.forward_passes
            results.setdefault(str(tree), []).append({"tokens_per_second": round(tokens / seconds, 2),
                                                      "tokens_per_pass": round(tokens / passes, 3)})
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
