"""How much slower a LoRA training step is with streams than the next-token step with the same
LoRA, on real Spider batches of SmolLM2-135M (measured alternately in one process).

    python eval/train_step_time.py [--steps 6] [--batch 4]
"""

import argparse
import json

from streamspec.training.profiling import train_step_time_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(train_step_time_ratio(args.steps, args.batch), indent=2))


if __name__ == "__main__":
    main()
