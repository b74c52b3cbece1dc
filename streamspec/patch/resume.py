"""Resuming training: a training checkpoint loaded back into the draft model a recipe built."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_training_checkpoint
from .medusa import MedusaModel, load_medusa_heads
from .model import StreamedModel


def load_draft_checkpoint(model, folder: str | Path) -> None:
    """Load a training checkpoint into a draft model built from the same recipe, strictly: streams
    (and their LoRA adapter or merged base) or Medusa heads, each from its own format (what
    `DecoderParts.save_training_checkpoint` wrote)."""
    if isinstance(model, MedusaModel):
        return load_medusa_heads(model, folder)
    if not isinstance(model, StreamedModel):
        raise TypeError(f"load_draft_checkpoint loads streams or Medusa heads, not into a {type(model).__name__}")
    load_training_checkpoint(model, Path(folder))
