"""Offline training: what the frozen base computes on the training text, computed once and stored.

In lossless mode (and for Medusa heads) the base never trains, so everything it computes on an
example is a fixed function of the text. A training step re-running it spends most of its time
on work whose result never changes (the lower N−Ns layers, the main stream inside the MSA layers,
the LM head over the main rows). The recipe key ``data.cache_activations: true`` computes it once
per example and stores it; training then runs only the streams (or the heads) and the LM head
over their rows. EAGLE/SpecForge train their drafts this way ("offline" mode).

What one example stores (see `streamspec.patch.objective` for the batch shapes):

- ``hidden``: the hidden states at the input of layer N−Ns (streams) or after the last layer
  (Medusa heads), only at the positions a loss term reads (`needed_positions`);
- ``keys``/``values`` (streams): each MSA layer's main keys and values, what the stream rows
  attend to (`StreamedModel.capture_main`);
- ``own``: the main stream's top-1 predictions (the targets of ``stream_targets: main``);
- ``main_ce``: the main stream's cross-entropy per position (the frozen main term, reported);
- ``input_ids``: the text, checked against the training row it is used for.

The store is a folder of safetensors shards (``shard-00000.safetensors``, one per `SHARD_SIZE`
examples, each written whole under a temporary name, so a killed build resumes at the first
missing shard) and ``store.json`` with the settings it was built for. It lives in the cache
(``$STREAMSPEC_CACHE/activations/``), keyed by the model (name and weight fingerprint), what is
stored (layers, heads, dtype) and the examples themselves; a store whose settings differ from the
model's and data's is refused, never reused (`open_activation_store`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..data.build import PadCollator
from ..patch.layout import causal, main_allowed, position_ids_from_mask
from ..patch.objective import main_outputs

logger = logging.getLogger(__name__)

STORE_FORMAT = "streamspec-activations"
STORE_VERSION = 1
STORE_FILE = "store.json"
SHARD_SIZE = 64
INDEX_COLUMN = "activation_index"


# ----------------------------------------------------------------------------- settings and paths

def store_settings(model, examples: list[dict]) -> dict[str, Any]:
    """What decides a store's content: the model (name, weight fingerprint, dtype), what it
    stores for it, and a digest of the examples' tokens and labels."""
    from ..patch.medusa import MedusaModel
    from ..patch.model import StreamedModel

    if isinstance(model, StreamedModel):
        if model.stream_config.mode != "lossless":
            raise ValueError("data.cache_activations needs streams.mode 'lossless' (or a medusa section): in shared "
                             "mode the base trains, so what it computes changes every step")
        kind, extra = "streams", {"stream_layers": model.stream_config.stream_layers}
    elif isinstance(model, MedusaModel):
        kind, extra = "medusa", {"num_heads": model.medusa_config.num_heads}
    else:
        raise ValueError(f"data.cache_activations trains streams or Medusa heads on a frozen base, not a "
                         f"{type(model).__name__} (a next-token fine-tune trains the base)")
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps([example["input_ids"], example["labels"]]).encode())
    return {
        "kind": kind, **extra,
        "model": getattr(model.config, "_name_or_path", None),
        "weights_sha256": weights_digest(model.hf_model),
        "num_layers": len(model.layers),
        "num_lower_layers": model.num_lower_layers,
        "dtype": str(next(model.hf_model.parameters()).dtype).removeprefix("torch."),
        "examples": len(examples),
        "examples_sha256": digest.hexdigest(),
    }


@torch.no_grad()
def weights_digest(module: torch.nn.Module) -> str:
    """A digest of every weight of the base (each tensor's name, shape and float64 sum): what the
    stored activations are a function of, so a store of another base (or another fine-tune of the
    same base) is never taken for this one."""
    digest = hashlib.sha256()
    for name, param in module.state_dict().items():
        name = name.replace(".base_layer", "")  # a stream module's wrapped linear: the same weight
        digest.update(f"{name}:{tuple(param.shape)}:{float(param.double().sum())!r};".encode())
    return digest.hexdigest()


def activation_store_path(settings: dict[str, Any]) -> Path:
    """The cached store's folder for these settings."""
    from ..assets import cache_dir

    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(settings.get("model") or "model")).name).strip("-") or "model"
    return cache_dir() / "activations" / f"{name}-{settings['kind']}-{key}"


def needed_positions(labels: torch.Tensor, lookahead: int) -> torch.Tensor:
    """[T] bool: positions t whose stored hidden state some loss term reads: those with a target
    at t+1+k for some k in 0..lookahead (streams: 0, the carrying positions; Medusa heads: their
    number, since head k at t learns the token at t+1+k)."""
    has = labels != -100
    need = torch.zeros_like(has)
    for k in range(lookahead + 1):
        if labels.shape[0] > 1 + k:
            need[: labels.shape[0] - 1 - k] |= has[1 + k :]
    return need


# ----------------------------------------------------------------------------- building

@torch.no_grad()
def compute_activations(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
    """One batch's stored activations, per example (a list of dicts of CPU tensors, the padding cut off)."""
    from ..patch.model import StreamedModel

    real = attention_mask.bool()
    if isinstance(model, StreamedModel):
        batch = model.frozen_main(input_ids, attention_mask, labels)
        lower, own, main_ce, lookahead = batch["hidden"], batch["own"], batch["main_ce"], 0
        kv = batch["keys"], batch["values"]
    else:  # Medusa heads read the last layer's output
        positions = position_ids_from_mask(real)
        lower = model.run_lower(input_ids, positions, main_allowed(causal(input_ids.shape[1], input_ids.device), real))
        main_ce, own = main_outputs(model.head, lower, labels)
        kv, lookahead = None, model.medusa_config.num_heads
    out = []
    for b in range(input_ids.shape[0]):
        n = int(real[b].sum())
        if not bool(real[b, :n].all()):
            raise ValueError("compute_activations needs right-padded rows")
        need = needed_positions(labels[b, :n], lookahead)
        row = {"input_ids": input_ids[b, :n], "positions": need.nonzero()[:, 0], "hidden": lower[b, :n][need],
               "own": own[b, :n], "main_ce": main_ce[b, :n]}
        if kv is not None:
            row["keys"], row["values"] = kv[0][b, :, :, :n], kv[1][b, :, :, :n]
        out.append({k: v.detach().to("cpu").contiguous() for k, v in row.items()})
    return out


def length_batches(rows: list[dict], batch_size: int) -> list[list[int]]:
    """The rows' indices in batches of rows of near length (longest first). A batch is padded to
    its longest row: in the order of the set, batches of 8 of the chat set (10 to 1,024 tokens a
    row) would compute 2.05× the tokens they store; sorted within each shard, 1.19×."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"]))
    return [order[first:first + batch_size] for first in range(0, len(order), batch_size)]


def build_activation_store(model, examples: list[dict], path: str | Path | None = None, batch_size: int = 4,
                           progress: bool = True) -> "ActivationStore":
    """Compute and store the activations of `examples` (``input_ids``/``labels`` lists) for
    `model` (a lossless `StreamedModel` or a `MedusaModel`), or open the store already built for
    them; a partly built one is resumed at its first missing shard. Each shard's rows run in
    batches of near length (`length_batches`); each row is stored under its own index."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    settings = store_settings(model, examples)
    folder = Path(path) if path is not None else activation_store_path(settings)
    meta_path = folder / STORE_FILE
    if meta_path.is_file():
        meta = _read_meta(folder)
        _check_settings(folder, meta, settings)
        if meta.get("complete"):
            return ActivationStore(folder, settings)
    folder.mkdir(parents=True, exist_ok=True)
    command = " ".join(sys.argv)
    meta = {"format": STORE_FORMAT, "format_version": STORE_VERSION, "settings": settings, "complete": False,
            "shard_size": SHARD_SIZE, "command": command}
    _write_json(meta_path, meta)
    num_shards = (len(examples) + SHARD_SIZE - 1) // SHARD_SIZE
    todo = [s for s in range(num_shards) if not (folder / _shard_name(s)).is_file()]
    device = next(model.parameters()).device
    collate = PadCollator(0)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    bar = tqdm(total=sum(len(examples[s * SHARD_SIZE:(s + 1) * SHARD_SIZE]) for s in todo),
               desc="storing activations", unit="example", disable=not progress)
    try:
        for shard in todo:
            rows = examples[shard * SHARD_SIZE:(shard + 1) * SHARD_SIZE]
            tensors: dict[str, torch.Tensor] = {}
            for chunk in length_batches(rows, batch_size):
                batch = {k: v.to(device) for k, v in collate([rows[i] for i in chunk]).items()}
                for i, stored in zip(chunk, compute_activations(model, **batch)):
                    tensors.update({f"{shard * SHARD_SIZE + i}.{k}": v for k, v in stored.items()})
                bar.update(len(chunk))
            tmp = folder / (_shard_name(shard) + ".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, folder / _shard_name(shard))  # a shard is there whole or not at all
    finally:
        bar.close()
        model.train(was_training)
    size = sum(f.stat().st_size for f in folder.glob("shard-*.safetensors"))
    meta.update(complete=True, bytes=size, build_seconds=round(time.perf_counter() - start, 1))
    _write_json(meta_path, meta)
    logger.warning("activation store %s: %d examples, %.1f MB, %s s to build (this run); command: %s",
                   folder, len(examples), size / 1e6, meta["build_seconds"], command)
    return ActivationStore(folder, settings)


def open_activation_store(path: str | Path, model, examples: list[dict]) -> "ActivationStore":
    """A complete store, refused (ValueError) unless it was built for this model and these examples."""
    folder = Path(path)
    meta = _read_meta(folder)
    _check_settings(folder, meta, store_settings(model, examples))
    if not meta.get("complete"):
        raise ValueError(f"activation store {folder} is incomplete: build it (training does, on first use)")
    return ActivationStore(folder, meta["settings"])


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def _read_meta(folder: Path) -> dict:
    path = folder / STORE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not an activation store (no {STORE_FILE})")
    meta = json.loads(path.read_text())
    if meta.get("format") != STORE_FORMAT or meta.get("format_version") != STORE_VERSION:
        raise ValueError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; this "
                         f"streamspec reads {STORE_FORMAT!r} version {STORE_VERSION}")
    return meta


def _check_settings(folder: Path, meta: dict, settings: dict) -> None:
    recorded = meta.get("settings", {})
    wrong = {k: (recorded.get(k), v) for k, v in settings.items() if recorded.get(k) != v}
    if "weights_sha256" in wrong:
        wrong["weights_sha256"] = "another base's weights"
    if wrong:
        raise ValueError(f"activation store {folder} was built for other settings, refused: (stored, wanted) {wrong}")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- reading

class ActivationStore:
    """A complete store, read lazily (memory-mapped shards)."""

    def __init__(self, folder: Path, settings: dict) -> None:
        from safetensors import safe_open

        self.folder, self.settings = folder, settings
        self._open = safe_open
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.settings["examples"]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"activation store {self.folder} has {len(self)} examples, not {index}")
        shard = index // SHARD_SIZE
        if shard not in self._handles:
            self._handles[shard] = self._open(str(self.folder / _shard_name(shard)), framework="pt")
        handle = self._handles[shard]
        prefix = f"{index}."
        return {k[len(prefix):]: handle.get_tensor(k) for k in handle.keys() if k.startswith(prefix)}

    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.folder.glob("shard-*.safetensors"))


class ActivationCollator(PadCollator):
    """`PadCollator` plus each row's stored activations (``activations``, as the models'
    ``forward(activations=...)`` take them), found by the row's `INDEX_COLUMN`. A stored row
    whose text is not the row's is refused."""

    def __init__(self, pad_id: int, store: ActivationStore) -> None:
        super().__init__(pad_id)
        self.store = store

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().__call__(batch)
        rows = []
        for b in batch:
            if INDEX_COLUMN not in b:
                raise ValueError(f"offline training rows need an {INDEX_COLUMN!r} column (with_activation_index)")
            stored = self.store[int(b[INDEX_COLUMN])]
            if stored["input_ids"].tolist() != list(b["input_ids"]):
                raise ValueError(f"activation store {self.store.folder}: row {b[INDEX_COLUMN]} was built from other "
                                 "text; refused (rebuild the store)")
            rows.append(stored)
        out["activations"] = _pad_activations(rows, out["input_ids"].shape[1])
        return out


def _pad_activations(rows: list[dict[str, torch.Tensor]], width: int) -> dict[str, torch.Tensor]:
    first = rows[0]
    batch = len(rows)
    hidden = first["hidden"].new_zeros(batch, width, first["hidden"].shape[-1])
    own = torch.full((batch, width), -100, dtype=torch.long)
    main_ce = torch.zeros(batch, width, dtype=torch.float32)
    out = {"hidden": hidden, "own": own, "main_ce": main_ce}
    if "keys" in first:
        layers, heads, _, dim = first["keys"].shape
        out["keys"] = first["keys"].new_zeros(batch, layers, heads, width, dim)
        out["values"] = first["values"].new_zeros(batch, layers, heads, width, dim)
    for b, row in enumerate(rows):
        n = row["input_ids"].shape[0]
        hidden[b, row["positions"]] = row["hidden"]
        own[b, :n] = row["own"]
        main_ce[b, :n] = row["main_ce"]
        if "keys" in row:
            out["keys"][b, :, :, :n] = row["keys"]
            out["values"][b, :, :, :n] = row["values"]
    return out


def with_activation_index(examples: list[dict], offset: int = 0) -> list[dict]:
    """The examples with their row in the store (`INDEX_COLUMN`)."""
    return [{**e, INDEX_COLUMN: offset + i} for i, e in enumerate(examples)]
