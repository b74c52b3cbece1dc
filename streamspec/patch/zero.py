"""DeepSpeed ZeRO support: partitioned weights read directly, and checkpoints of what trains.

ZeRO-3 partitions every parameter across the processes and gathers a module's own parameters
only around that module's calls (forward and backward). Most of streamspec calls modules; the
few places that read a weight directly (the fused loss reads the LM head's weight, a checkpoint
reads the embedding's fingerprint and the trained weights) gather it with `gathered`. Without
DeepSpeed, or under ZeRO-0/1/2 where every process holds whole parameters, it does nothing.

A DeepSpeed checkpoint of a streamed model (`save_trainable`) holds the trainable weights and
their optimizer state only: the frozen base is the base's own files. Resume checks it strictly
(`check_trainable_checkpoint`) before DeepSpeed loads it.

Also here: the recipe's DeepSpeed config check, and what ZeRO-3's partitioned loading needs
before the model is built (`init_deepspeed_comm`, `check_partitioned`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter that ZeRO-3 manages (partitioned across processes)."""
    return hasattr(param, "ds_id")


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor], modifier_rank: int | None = None):
    """Inside the block, the ZeRO-3 parameters among `params` that are partitioned now are whole
    on every process (a collective: every process must enter it); they are partitioned again on
    exit. Parameters that are whole already (not ZeRO-3's, persistent, or in use by a module)
    are left as they are. `modifier_rank`: the process whose changes to them are kept."""
    params = [p for p in params if is_partitioned(p) and p.ds_status.name == "NOT_AVAILABLE"]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def save_trainable(engine, output_dir: str) -> None:
    """``engine.save_checkpoint`` with the trainable weights only (and all of the optimizer state,
    which covers only them). DeepSpeed's ``exclude_frozen_parameters`` drops a frozen weight by
    one name only, so a tied LM head (SmolLM2's) would still be saved under its second name: the
    state dict is filtered by every name of every frozen parameter."""
    module_state_dict = engine.module_state_dict

    def trainable_state_dict(*args, exclude_frozen_parameters=False, **kwargs):
        state = module_state_dict(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name, p in engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    state.pop(name, None)
        return state

    engine.module_state_dict = trainable_state_dict
    try:
        engine.save_checkpoint(output_dir, exclude_frozen_parameters=True)
    finally:
        del engine.module_state_dict  # the class's method again


def check_deepspeed_config(recipe) -> dict | None:
    """Read and check the recipe's DeepSpeed config."""
    path = recipe.training.deepspeed
    if path is None:
        return None
    if not Path(path).is_file():
        raise FileNotFoundError(f"training.deepspeed: {path} does not exist")
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"training.deepspeed: {path} is not valid JSON ({err})") from err
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"training.deepspeed: zero_optimization.stage must be 0..3, got {stage!r}")
    streams = recipe.streams
    if stage == 3 and streams is not None and streams.mode == "shared" and not recipe.lora.enabled:
        # The base trains: its final norm and LM head are also used with detached weights (the
        # early-exit loss), and its checkpoints are merged, i.e. the whole base gathered.
        raise ValueError(
            "training.deepspeed: ZeRO-3 trains streamed models with LoRA (lora.enabled) or lossless streams; "
            "a full fine-tune of the base with streams needs ZeRO-2 (recipes/deepspeed/zero2.json)"
        )
    return config


def init_deepspeed_comm(args) -> None:
    """Under DeepSpeed on CPUs, accelerate starts torch.distributed (gloo) but not DeepSpeed's own
    communication layer, which ZeRO-3's partitioned loading (before the Trainer exists) needs to
    see every process; on GPUs accelerate starts both and this does nothing."""
    if not args.deepspeed or not torch.distributed.is_initialized():
        return
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def check_partitioned(model) -> None:
    """Under ZeRO-3 the base must have been loaded partitioned, not whole on every process."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    embedding = getattr(model, "hf_model", model).get_input_embeddings().weight
    if is_deepspeed_zero3_enabled() and not is_partitioned(embedding):
        raise RuntimeError("ZeRO-3 is on but the base model was loaded whole: load it after the TrainingArguments")
    if is_partitioned(embedding):
        logger.warning("ZeRO-3: the base is loaded partitioned, %d of %d embedding values on this process",
                    embedding.ds_tensor.numel(), embedding.ds_numel)
