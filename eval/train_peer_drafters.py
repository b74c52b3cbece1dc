"""Train the vLLM rows' peer drafters (EAGLE-3, P-EAGLE) for a model with vLLM's own training
library, speculators, on a self-distilled set (the one the streams train on), within a step and
time budget. Each drafter folder loads in vLLM as {"method": "eagle3", "model": FOLDER,
"num_speculative_tokens": K} (P-EAGLE with "parallel_drafting": true) and is the --eagle3 /
--peagle folder of `streamspec eval --peers vllm_eagle3,vllm_peagle`; training.json beside it
holds the parameters trained, the tokens seen and the wall times.

    python eval/train_peer_drafters.py --distilled DIR --out runs/peer-drafters --max-seconds 600
    # a long run in several calls (each continues from the last checkpoint; the hidden states kept)
    python eval/train_peer_drafters.py --distilled DIR1 DIR2 --method eagle3 --resume --checkpoint-freq 0.1 \
        --hidden-states-dtype bfloat16 --max-seconds 3600
    # a set whose hidden states would not fit the disk: the target runs as training reads each row
    python eval/train_peer_drafters.py --distilled DIR --method eagle3 --epochs 1 --hidden-states online
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from streamspec.assets import DEFAULT_MODEL_ID
from streamspec.evaluation.peer_drafters import MAX_LENGTH, METHODS, distilled_examples, summary_line, train_peer_drafter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distilled", required=True, nargs="+",
                        help="the distilled set(s): shard folders or JSONL files, read in order")
    parser.add_argument("--model", default=DEFAULT_MODEL_ID, help="the target (a folder or a streamspec: id)")
    parser.add_argument("--method", nargs="+", default=["eagle3"], choices=METHODS)
    parser.add_argument("--out", type=Path, default=Path("runs/peer-drafters"),
                        help="one drafter folder per method in it (OUT/eagle3, OUT/peagle); speculators' data, "
                             "checkpoints and logs in OUT/work")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the epochs)")
    parser.add_argument("--max-seconds", type=float, default=None, help="training's wall-clock budget")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-rows", type=int, default=None, help="only the first N rows (after a seeded shuffle)")
    parser.add_argument("--in-order", action="store_true",
                        help="no shuffle: --max-rows takes the sets' first N rows, the ones a streams recipe's "
                             "data.max_train_examples: N trains on")
    parser.add_argument("--max-length", type=int, default=MAX_LENGTH, help="longer rows are dropped")
    parser.add_argument("--total-seq-len", type=int, default=2048, help="tokens packed into one step")
    parser.add_argument("--draft-vocab-size", type=int, default=8192,
                        help="the drafter's vocabulary: the most frequent completion tokens (0: the model's)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3: steps unrolled in training")
    parser.add_argument("--num-depths", type=int, default=4, help="P-EAGLE: positions drafted in parallel")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-hidden-states", action="store_true")
    parser.add_argument("--hidden-states-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="what the target's hidden states are stored in (bfloat16: half the disk)")
    parser.add_argument("--hidden-states", choices=["files", "online"], default="files",
                        help="the target's hidden states written once before training (files: reused by later "
                             "epochs, calls and methods) or computed as training reads each row (online: no disk)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in OUT/work (the same rows and settings)")
    parser.add_argument("--checkpoint-freq", type=float, default=1.0,
                        help="a checkpoint every N epochs (below 1: within an epoch, for --resume)")
    args = parser.parse_args(argv)
    examples, data = distilled_examples(args.model, args.distilled, max_length=args.max_length,
                                        max_rows=args.max_rows, seed=args.seed, shuffle=not args.in_order)
    data["distilled"] = [Path(d).name for d in args.distilled]
    print(f"{data['used']} rows ({data['distilled_rows']} distilled, {data['dropped_too_long']} over "
          f"{args.max_length} tokens dropped)")
    for i, method in enumerate(args.method):
        last = i == len(args.method) - 1  # the methods train on the same hidden states, made once
        report = train_peer_drafter(
            args.model, examples, args.out / method, method=method, work=args.out / "work", data=data,
            max_steps=args.max_steps,
            max_seconds=args.max_seconds, epochs=args.epochs, total_seq_len=args.total_seq_len,
            max_length=args.max_length, draft_vocab_size=args.draft_vocab_size or None, lr=args.lr,
            ttt_steps=args.ttt_steps, num_depths=args.num_depths, threads=args.threads, seed=args.seed,
            keep_hidden_states=args.keep_hidden_states or not last, hidden_states_dtype=args.hidden_states_dtype,
            hidden_states=args.hidden_states, resume=args.resume, checkpoint_freq=args.checkpoint_freq)
        print(summary_line(report))
        print(json.dumps({"method": "eagle3", "model": str(args.out / method),
                          "num_speculative_tokens": report["num_speculative_tokens"],
                          **({"parallel_drafting": True} if method == "peagle" else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
