"""Fine-tune a model with speculative streams from a YAML recipe.

    python train/finetune.py --recipe recipes/smollm2-135m/sql.yaml [section.key=value ...] [--resume]
    torchrun --nproc_per_node 8 train/finetune.py --recipe recipes/llama-3.1-8b/sql_zero2.yaml
    deepspeed --num_gpus 8 train/finetune.py --recipe recipes/llama-3.1-8b/sql_zero2.yaml

The logic lives in `streamspec.training.trainer`; this file only parses the command line.
"""

import sys

from streamspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
