"""Resuming training: a training checkpoint loaded back into the draft model a recipe built."""

from __future__ import annotations

from pathlib import Path

import torch

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
        meta = read_checkpoint_meta(folder)
        check_base(folder, meta, model.hf_model)
        if _adds_next_token_input(model, meta):
            load_into_next_token_streams(model, folder)
            return folder
    load_draft_checkpoint(model, folder)
    return folder


def _adds_next_token_input(model: StreamedModel, meta: dict) -> bool:
    """The recipe's streams read the next token and the checkpoint's are otherwise the same."""
    from ..config import StreamConfig

    mine = model.stream_config.to_dict()
    theirs = StreamConfig.from_dict(meta["stream_config"]).to_dict()
    return mine["next_token_input"] and not theirs["next_token_input"] and {**theirs, "next_token_input": True} == mine


def load_into_next_token_streams(model: StreamedModel, folder: Path) -> None:
    """Trained streams (without ``next_token_input``) into streams that read the next token: every
    weight the checkpoint holds, strictly, and the next-token map left at its zero start, so the
    run starts from exactly those streams' drafts."""
    import logging

    from .checkpoint import load_stream_weights
    from .saving import WEIGHTS_FILE, CheckpointError

    meta = read_checkpoint_meta(folder)
    if meta.get("merged") or meta.get("adapter"):
        raise CheckpointError(f"{folder}: starting streams that read the next token from it needs a checkpoint of "
                              "lossless streams alone (no adapter, not merged)")
    load_stream_weights(model, folder / WEIGHTS_FILE, absent=("next_token_map.",))
    with torch.no_grad():
        model.streams.next_token_map.weight.zero_()
    logging.getLogger(__name__).info("%s: streams loaded; the next-token map starts at zero", folder)
