"""Resuming training: a training checkpoint loaded back into the draft model a recipe built."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import check_base, checkpoint_folder, load_training_checkpoint, read_checkpoint_meta
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


def init_draft_from(model, source: str | Path) -> Path:
    """Start a training run from trained streams or heads instead of fresh ones (a recipe's
    ``training.init_from``): a streamed checkpoint folder, a run's ``final`` or ``checkpoint-*``
    folder, or shipped weights by name (``streamspec:smollm2-135m-sql-streams``). Strict like
    every load: the checkpoint must have been made for this base (architecture, size and weights)
    and hold the recipe's stream config (or Medusa config) exactly, or nothing is loaded. Only the
    weights are taken; the optimizer, schedule and step count start afresh. Returns the folder."""
    folder = checkpoint_folder(source)
    if not folder.is_dir():
        raise FileNotFoundError(f"training.init_from: {source!r} is not a checkpoint folder or shipped weights")
    if isinstance(model, StreamedModel):
        check_base(folder, read_checkpoint_meta(folder), model.hf_model)
    load_draft_checkpoint(model, folder)
    return folder
