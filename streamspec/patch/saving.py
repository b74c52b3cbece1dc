"""Writing a streamed checkpoint: its format, what it records of its base (names, shapes, a
fingerprint of a few weights), and `save_streamed`. `streamspec.patch.checkpoint` reads it back."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from .stream_modules import remove_stream_modules, stream_modules_taken_out
from .decoder import DecoderParts
from .zero import gathered

logger = logging.getLogger(__name__)


FORMAT = "streamspec-streamed-checkpoint"


FORMAT_VERSION = 1


CONFIG_FILE = "stream_config.json"


WEIGHTS_FILE = "streams.safetensors"


ADAPTER_DIR = "adapter"


_CHECKED_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")


class CheckpointError(ValueError):
    """A streamed checkpoint is malformed or does not match the model it is loaded into."""


def _base_facts(config) -> dict[str, Any]:
    return {name: getattr(config, name, None) for name in _CHECKED_FIELDS}


def base_fingerprint(model: nn.Module) -> list[float]:
    """A few numbers that tell one base model from another of the same shape: the sums of the
    first and last 8 rows of its input embedding (which neither LoRA nor streams change), in
    float64 whatever the model's dtype, so a bf16 copy of the same base still matches."""
    weight = model.get_input_embeddings().weight
    with gathered([weight]):  # partitioned under DeepSpeed ZeRO-3
        rows = torch.cat([weight[:8], weight[-8:]]).detach().to(torch.float64)
    return [round(float(v), 6) for v in rows.sum(dim=1)]


CUSTOM_GENERATE_FILE = '''"""streamspec's speculative streaming for this model:
model.generate(input_ids, custom_generate=<this folder>, trust_remote_code=True, max_new_tokens=...).
See streamspec.custom_generate."""

from streamspec.custom_generate import generate  # noqa: F401
'''


def write_custom_generate(folder: str | Path) -> Path:
    """Write ``custom_generate/generate.py`` and ``requirements.txt`` (naming streamspec) into a
    merged folder: transformers' way to ship a decoding method with a model
    (`streamspec.custom_generate`)."""
    target = Path(folder) / "custom_generate"
    target.mkdir(parents=True, exist_ok=True)
    (target / "generate.py").write_text(CUSTOM_GENERATE_FILE)
    (target / "requirements.txt").write_text("streamspec\n")
    return target


def save_streamed(model: DecoderParts, directory: str | Path, merge: bool = False, tokenizer=None) -> Path:
    """Write `model` (a `streamspec.patch.model.StreamedModel`) as a streamed checkpoint (see the module docstring); returns the folder."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = model.config
    base_ref: dict[str, Any] = {"name_or_path": getattr(hf_config, "_name_or_path", None), **_base_facts(hf_config),
                                "fingerprint": base_fingerprint(model.hf_model)}
    revision = getattr(hf_config, "_commit_hash", None)
    if revision:
        base_ref["revision"] = revision
    if base_ref["name_or_path"] and Path(base_ref["name_or_path"]).is_dir():
        # also relative to the checkpoint, so that a folder moved together with its base still loads
        base_ref["relative_path"] = os.path.relpath(Path(base_ref["name_or_path"]).resolve(), out.resolve())
    adapter = None
    if merge:
        base = copy.deepcopy(model.base)
        remove_stream_modules(base)  # saved as the plain transformers model it is
        if model.has_lora:
            base = base.merge_and_unload()
        base.save_pretrained(out)
        base_ref["name_or_path"] = None  # the base is this folder
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        write_custom_generate(out)  # model.generate(..., custom_generate=out) decodes with the streams
    elif model.has_lora:
        with stream_modules_taken_out(model.hf_model):  # peft's own layout: it loads without them
            model.base.save_pretrained(out / ADAPTER_DIR)
        adapter = ADAPTER_DIR
    if not merge and not base_ref["name_or_path"]:
        logger.warning("the base model has no name or path (built from a config or in memory): the checkpoint holds the "
                       "streams and adapter only, and loading it needs base_model=")
    state = {k: v.detach().contiguous().cpu() for k, v in model.streams.state_dict().items()}
    save_file(state, out / WEIGHTS_FILE, metadata={"format": FORMAT})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "stream_config": model.stream_config.to_dict(),
        "base_model": base_ref,
        "merged": merge,
        "adapter": adapter,
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out
