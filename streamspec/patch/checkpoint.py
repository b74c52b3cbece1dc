"""Streamed checkpoints: save only what is new, load back strictly.

A streamed checkpoint folder holds

- ``stream_config.json``: the `StreamConfig`, the format version, and the base model it was made
  for (``name_or_path`` plus architecture facts checked on load);
- ``streams.safetensors``: the `StreamParameters` weights;
- ``adapter/``: the peft LoRA adapter, when one is attached;
- with ``merge=True`` instead: the base weights with any LoRA merged in (``config.json``,
  ``model.safetensors``, tokenizer files when given), so the folder needs nothing else.

Loading refuses a checkpoint whose keys or shapes do not match, or whose base model differs in
architecture or size: a half-random model is never returned.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..config import StreamConfig
from ..fingerprint import same_fingerprint
from .model import StreamedModel, add_streams
from .stream_modules import stream_modules_taken_out
from .saving import (
    ADAPTER_DIR,
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    WEIGHTS_FILE,
    _CHECKED_FIELDS,
    CheckpointError,
    _base_facts,
    base_fingerprint,
    save_streamed,
)

logger = logging.getLogger(__name__)
def checkpoint_folder(source: str | Path) -> Path:
    """The folder of a streamed checkpoint: a path, or the name of shipped stream weights
    (``streamspec:smollm2-135m-sql-streams``). Every reader of checkpoints resolves through this,
    so a source that one command takes, every command takes."""
    from ..assets import shipped_or_path

    return Path(shipped_or_path(str(source)))


def recorded_base(folder: str | Path, meta: dict[str, Any] | None = None) -> str | None:
    """The base a checkpoint names: the folder itself when merged; else the recorded name or
    path, or, when that path does not exist here (the checkpoint was moved or copied to another
    machine), the same base found at the path recorded relative to the checkpoint."""
    folder = checkpoint_folder(folder)
    meta = meta or read_checkpoint_meta(folder)
    if meta.get("merged"):
        return str(folder)
    recorded = meta["base_model"]
    name = recorded.get("name_or_path")
    relative = recorded.get("relative_path")
    if name and relative and not Path(name).exists() and (folder / relative).exists():
        return str((folder / relative).resolve())
    return name


def read_checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """The parsed ``stream_config.json`` of a streamed checkpoint, checked for format."""
    path = checkpoint_folder(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a streamed checkpoint: {CONFIG_FILE} is missing")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a streamspec checkpoint (format={meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {meta.get('format_version')!r}; this streamspec reads version {FORMAT_VERSION}"
        )
    return meta


def load_streamed(
    directory: str | Path,
    base_model: nn.Module | str | None = None,
    dtype: torch.dtype = torch.float32,
    merge_lora: bool = False,
) -> StreamedModel:
    """Rebuild a `StreamedModel` from a streamed checkpoint.

    Args:
        directory: the checkpoint folder.
        base_model: the base causal LM (an instance, or a hub id / path) to attach the streams to;
            default: the one recorded in the checkpoint (or the folder itself when merged).
        dtype: dtype used when the base is loaded here.
        merge_lora: fold the checkpoint's LoRA adapter into the base weights (for inference: the
            same outputs up to float rounding, and no adapter matmuls on every call). The model
            can then no longer be trained or saved as an adapter.
    """
    from ..assets import load_base_model

    folder = checkpoint_folder(directory)
    meta = read_checkpoint_meta(folder)
    recorded = meta["base_model"]
    if base_model is None:
        base_model = recorded_base(folder, meta)
        if not base_model:
            raise CheckpointError(f"{folder} records no base model (it was saved from a model without a name or path); "
                                  "pass base_model= (the base instance, a folder or a hub id)")
    if isinstance(base_model, (str, Path)):
        base_model = load_base_model(str(base_model), dtype=dtype)
    if hasattr(base_model, "peft_config") or isinstance(base_model, StreamedModel):
        raise CheckpointError("pass the plain base model: the checkpoint carries its own adapter and streams")
    check_base(folder, meta, base_model)

    config = StreamConfig.from_dict(meta["stream_config"])
    if meta.get("adapter"):
        base_model = load_adapter(base_model, folder / meta["adapter"])
        if merge_lora:
            base_model = base_model.merge_and_unload()
    model = add_streams(base_model, config)
    load_stream_weights(model, folder / WEIGHTS_FILE)
    return model.eval()


def check_base(folder: Path, meta: dict[str, Any], base_model: nn.Module) -> None:
    """Refuse a base model other than the one the checkpoint in `folder` was made for: another
    architecture or size, or the same shapes with other weights (the embedding fingerprint)."""
    recorded = meta["base_model"]
    actual = _base_facts(base_model.config)
    wrong = {k: (recorded.get(k), actual[k]) for k in _CHECKED_FIELDS if recorded.get(k) != actual[k]}
    if wrong:
        details = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in wrong.items())
        raise CheckpointError(f"the base model does not match the checkpoint in {folder} ({details})")
    if recorded.get("fingerprint") and not same_fingerprint(recorded["fingerprint"], base_fingerprint(base_model)):
        raise CheckpointError(f"the base model is not the one the checkpoint in {folder} was made for: same shapes, "
                              "different weights (its embedding fingerprint differs)")


def load_stream_weights(model: StreamedModel, path: Path, absent: tuple[str, ...] = ()) -> None:
    """Load a `streams.safetensors` into `model.streams`, refusing missing, unexpected or mis-shaped
    keys; the weights whose names start with one of `absent` must be missing and are left as they are."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    saved = load_file(path)
    expected = {k: v for k, v in model.streams.state_dict().items() if not (absent and k.startswith(absent))}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = sorted(k for k in set(saved) & set(expected) if saved[k].shape != expected[k].shape)
    if missing or unexpected or shapes:
        problems = []
        if missing:
            problems.append(f"missing {missing}")
        if unexpected:
            problems.append(f"unexpected {unexpected}")
        if shapes:
            problems.append(
                "mis-shaped " + ", ".join(f"{k} {tuple(saved[k].shape)} vs {tuple(expected[k].shape)}" for k in shapes)
            )
        raise CheckpointError(f"{path} does not match the stream config: " + "; ".join(problems))
    model.streams.load_state_dict(saved, strict=not absent)


def load_adapter(base: nn.Module, folder: Path) -> nn.Module:
    """Wrap `base` in the adapter saved in `folder` (strictly: every LoRA weight must load)."""
    from peft import LoraConfig, get_peft_model

    if not folder.is_dir():
        raise CheckpointError(f"adapter folder {folder} does not exist")
    if not (folder / "adapter_config.json").is_file():
        raise CheckpointError(f"the adapter in {folder} is incomplete (adapter_config.json missing)")
    model = get_peft_model(base, LoraConfig.from_pretrained(str(folder)))
    load_adapter_weights(model, folder)
    return model


def load_adapter_weights(model: nn.Module, folder: Path) -> None:
    """Load `folder`'s adapter weights into a peft model that already has the adapter's shape."""
    from peft import set_peft_model_state_dict

    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"the adapter in {folder} is incomplete (adapter_model.safetensors missing)")
    try:
        with stream_modules_taken_out(model):  # peft finds its layers where its layout names them
            result = set_peft_model_state_dict(model, load_file(weights))
    except RuntimeError as err:  # size mismatch
        raise CheckpointError(f"the adapter in {folder} does not fit the base model: {err}") from err
    missing = sorted(k for k in result.missing_keys if "lora_" in k)
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"the adapter in {folder} does not match the base model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )


def merge_adapter(adapter: str | Path, out: str | Path, base: str | None = None,
                  dtype: str | torch.dtype | None = None) -> Path:
    """Fold a peft LoRA adapter (a plain next-token fine-tune, say) into its base model and save a
    plain transformers folder with the tokenizer: a base to add lossless streams to, whose outputs
    the streamed model then reproduces exactly.

    Args:
        adapter: the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        out: the folder to write.
        base: the base the adapter was trained on (a hub id, a folder, or the default model id);
            default: the one the adapter records (``base_model_name_or_path`` in its
            ``adapter_config.json``), else `streamspec.assets.DEFAULT_MODEL_ID`.
        dtype: the dtype to merge and save in; None or ``auto``: the base's own (its config's
            ``torch_dtype``, see `streamspec.devices.base_dtype`).
    """
    from ..assets import DEFAULT_MODEL_ID, load_base_model
    from ..devices import dtype_or_base

    base = base or adapter_base(Path(adapter)) or DEFAULT_MODEL_ID
    model = load_base_model(base, dtype=dtype_or_base(dtype, base))
    model = load_adapter(model, Path(adapter)).merge_and_unload().eval()
    target = Path(out)
    model.save_pretrained(target)
    tokenizer = _tokenizer_if_any(base)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    return target


def adapter_base(adapter: Path) -> str | None:
    """The base model an adapter folder records (peft's ``base_model_name_or_path``), if any."""
    config = adapter / "adapter_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("base_model_name_or_path") or None


def _tokenizer_if_any(source: str):
    """The tokenizer of `source`, or None (with a warning) for a model folder without one: a merged
    folder written without it still loads as a model."""
    from ..assets import load_tokenizer

    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as err:
        logger.warning("no tokenizer saved with the model (%s has none: %s)", source, str(err).splitlines()[0])
        return None


def export_checkpoint(checkpoint: str | Path, out: str | Path, merge: bool = False,
                      dtype: str | torch.dtype | None = None) -> Path:
    """Re-save a training checkpoint (or any streamed checkpoint) as a streamed checkpoint in
    `out`, optionally merged and self-contained, in `dtype` (None or ``auto``: the base's own, see
    `streamspec.devices.base_dtype`). The result is loaded back and checked."""
    from ..devices import dtype_or_base

    folder = checkpoint_folder(checkpoint)
    meta = read_checkpoint_meta(folder)
    precision = dtype_or_base(dtype, recorded_base(folder, meta))
    model = load_streamed(folder, dtype=precision)
    tokenizer = None
    if merge:
        tokenizer = _tokenizer_if_any(recorded_base(folder, meta))
    target = save_streamed(model, out, merge=merge, tokenizer=tokenizer)
    load_streamed(target, dtype=precision)  # refuse to report success for a folder that does not load
    return target


def check_trainable_checkpoint(model: nn.Module, folder: Path) -> None:
    """Refuse to resume from a DeepSpeed checkpoint whose weights are not exactly the model's
    trainable ones (missing, unexpected or mis-shaped), as a streamed checkpoint is refused."""

    latest = folder / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{folder} holds no DeepSpeed checkpoint ('latest' is missing)")
    tag = folder / latest.read_text().strip()
    # ZeRO-0/1/2 write one model-states file, ZeRO-3 one per process (the same names in each)
    candidates = [tag / "mp_rank_00_model_states.pt", tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    states = next((c for c in candidates if c.is_file()), None)
    if states is None:
        raise CheckpointError(f"{tag} holds no DeepSpeed model states ({candidates[0].name} or {candidates[1].name})")
    saved = torch.load(states, map_location="cpu", weights_only=False)
    buffers = set(saved.get("buffer_names") or [])
    saved_shapes = {}
    for group in saved.get("param_shapes") or []:  # ZeRO: the true shapes (ZeRO-3 saves empty tensors)
        saved_shapes.update(group)
    weights = {k for k in saved["module"] if k not in buffers}
    expected = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(expected) - weights)
    unexpected = sorted(weights - set(expected))
    shapes = sorted(
        name for name in set(expected) & set(saved_shapes)
        if tuple(saved_shapes[name]) != tuple(getattr(expected[name], "ds_shape", expected[name].shape))
    )
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{states} does not hold the model's trainable weights: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, mis-shaped {shapes[:5]} ({len(missing)}, {len(unexpected)}, {len(shapes)})"
        )


def checkpoint_tokenizer(checkpoint: str | Path):
    """The tokenizer of a streamed checkpoint: its own files when merged, else its base's."""
    from ..assets import load_tokenizer

    meta = read_checkpoint_meta(checkpoint)
    base = recorded_base(checkpoint, meta)
    if not base:
        raise CheckpointError(f"{checkpoint} records no base model, so no tokenizer either; load it with base_model=")
    return load_tokenizer(base)


def check_stream_config(model: StreamedModel, folder: Path) -> dict:
    """The checkpoint's metadata, refused when it was trained with another stream config."""
    meta = read_checkpoint_meta(folder)
    # through StreamConfig: a field added since the checkpoint was written takes its default
    if StreamConfig.from_dict(meta["stream_config"]).to_dict() != model.stream_config.to_dict():
        raise ValueError(f"{folder} was trained with another stream config: {meta['stream_config']}")
    return meta


def load_training_checkpoint(model: StreamedModel, folder: Path) -> None:
    """Load a streamed checkpoint's weights into an already built model (for resume), strictly."""
    meta = check_stream_config(model, folder)
    if meta.get("merged"):
        from transformers.modeling_utils import load_state_dict

        state = load_state_dict(str(folder / "model.safetensors"))
        result = model.hf_model.load_state_dict(state, strict=False)
        # A tied LM head is not stored separately: loading the input embeddings sets it.
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise ValueError(f"{folder}: base weights do not match (missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    if meta.get("adapter"):
        if not model.has_lora:
            raise ValueError(f"{folder} holds a LoRA adapter but the model has none")
        load_adapter_weights(model.base, folder / ADAPTER_DIR)
    load_stream_weights(model, folder / WEIGHTS_FILE)


def file_parameters(path: str | Path, skip=lambda name: False) -> int:
    """The parameters in a safetensors file (read from its header), less the tensors `skip` names."""
    total = 0
    with safe_open(str(path), framework="pt") as weights:
        for name in weights.keys():
            if not skip(name):
                total += math.prod(weights.get_slice(name).get_shape())
    return total
