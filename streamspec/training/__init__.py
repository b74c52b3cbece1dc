"""Fine-tuning: `recipe` (YAML recipes as typed dataclasses), `trainer` (the Trainer, DeepSpeed,
resume, the training summary), `profiling` (memory and time of one training step)."""
