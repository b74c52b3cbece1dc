"""Medusa heads: the draft method users compare speculative streaming with first, built here as
a peer so both can be measured on the same model, data and verifier.

`add_medusa_heads(model, MedusaConfig(num_heads=γ))` returns a `MedusaModel`: the causal LM,
frozen, plus γ heads on its last hidden state (before the final norm). Head k is one residual
block, ``x + SiLU(W_k x + b_k)``, followed by the model's own final norm and LM head (shared, not
copied), and predicts the token k+1 places after the next one: the job of stream k. ``W_k`` and
``b_k`` start at zero, so each head starts as the model's next-token prediction.

The model decodes through streamspec's tree verifier unchanged (`streamspec.decoding.generate`):
`run_lower` runs every layer, and `run_upper` returns the main hidden states with the heads'
outputs at the given positions as the "stream" rows. Unlike streams, the heads add no rows to the
attention of any layer: a pass costs the tree's nodes only, and the draft quality comes from
γ·h·(h+1) parameters (10⁵–10⁶ for small models, 10⁷–10⁸ at 8B) against the streams' ~10⁴.

A Medusa checkpoint folder holds ``medusa_config.json`` (format, version, the config and the base
model's facts, as a streamed checkpoint records them) and ``heads.safetensors``; loading refuses
a folder whose weights, shapes or base model do not match, like `streamspec.patch.checkpoint`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..arch import arch_spec
from ..fingerprint import same_fingerprint
from .decoder import DecoderParts, _is_peft
from .layout import causal, main_allowed, position_ids_from_mask
from .loss import cross_entropy_and_top1, frozen
from .objective import _term_losses, check_activations, main_predictions, stored_main_counts
from .saving import CheckpointError, _base_facts, base_fingerprint

if TYPE_CHECKING:
    from .cache import MainStreamCache

MEDUSA_FORMAT = "streamspec-medusa-heads"
MEDUSA_FORMAT_VERSION = 1
MEDUSA_CONFIG_FILE = "medusa_config.json"
MEDUSA_WEIGHTS_FILE = "heads.safetensors"


@dataclass
class MedusaConfig:
    """γ draft heads (a recipe's ``medusa`` section)."""

    num_heads: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool) or self.num_heads < 1:
            raise ValueError(f"medusa.num_heads must be an int >= 1, got {self.num_heads!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DraftShape:
    """What the tree verifier reads of a draft model's config (`StreamConfig` has the same
    fields): γ drafts per position; no stream layers; the base's outputs unchanged."""

    num_streams: int
    stream_layers: int = 0
    mode: str = "lossless"


class ResidualBlock(nn.Module):
    """``x + SiLU(W x + b)``, W and b zero at the start."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x.to(self.linear.weight.dtype)).to(x.dtype))


class MedusaModel(DecoderParts):
    """A frozen causal LM with γ Medusa heads. Build with `add_medusa_heads`."""

    def __init__(self, base: nn.Module, config: MedusaConfig) -> None:
        super().__init__()
        if not isinstance(config, MedusaConfig):
            raise TypeError(f"config must be a MedusaConfig, got {type(config).__name__}")
        if _is_peft(base):
            raise ValueError("Medusa heads sit on a frozen model: merge its LoRA adapter first (streamspec merge)")
        self.base = base
        self.medusa_config = config
        self.arch = arch_spec(self.config)
        self.stream_config = DraftShape(num_streams=config.num_heads)
        param = next(base.parameters())
        self.heads = nn.ModuleList(ResidualBlock(self.config.hidden_size) for _ in range(config.num_heads))
        self.heads.to(device=param.device, dtype=param.dtype)
        for p in self.base.parameters():
            p.requires_grad_(False)

    @property
    def num_lower_layers(self) -> int:
        return len(self.layers)  # every layer runs on main positions only

    @property
    def num_drafts(self) -> int:
        return self.medusa_config.num_heads

    def save_training_checkpoint(self, directory, tokenizer=None) -> None:
        """The heads only: the base is frozen and named."""
        self.save_pretrained(directory)

    def num_draft_parameters(self) -> int:
        """Parameters the heads add (the LM head is shared, not counted)."""
        return sum(p.numel() for p in self.heads.parameters())

    def early_exit_head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("Medusa heads have no early-exit estimator: tree pruning (prune_threshold) needs streams")

    def run_upper(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        main_ok: torch.Tensor,
        index: torch.Tensor,
        valid: torch.Tensor,
        cache: MainStreamCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """No layers left to run: the main hidden states [B, T, h] and, for the positions in
        `index` [B, S], the heads' outputs [B, S, γ, h] (before the shared final norm)."""
        batch, _, width = hidden.shape
        origin = hidden.gather(1, index[:, :, None].expand(batch, index.shape[1], width))
        return hidden, torch.stack([head(origin) for head in self.heads], dim=2)

    # -- training ------------------------------------------------------------------------------
    def _final_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The frozen model's last hidden states (before the final norm), without gradients."""
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        positions = position_ids_from_mask(mask)
        with torch.no_grad():
            return self.run_lower(input_ids, positions, main_allowed(causal(input_ids.shape[1], input_ids.device), mask))

    def _terms(self, hidden: torch.Tensor, labels: torch.Tensor, own: torch.Tensor | None = None):
        """Loss terms ``(name, hidden, targets, weight, transform)``: head k at position t learns
        the model's own top-1 prediction for the token at t+1+k (the targets lossless streams
        learn with ``stream_targets: main``), where the data has a token there."""
        batch = labels.shape[0]
        norm = frozen(getattr(self.decoder, self.arch.norm))
        if own is None:
            own = main_predictions(self, hidden, labels, norm)
        terms = []
        for k, head in enumerate(self.heads, start=1):
            targets = torch.cat([own[:, 1 + k:], own.new_full((batch, 1 + k), -100)], dim=1)
            terms.append((f"head_{k}", hidden, targets, 1.0, lambda rows, head=head: norm(head(rows))))
        return terms

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_chunk_size: int = 256,
                activations: dict[str, torch.Tensor] | None = None):
        """The heads' loss (the mean over heads of each head's mean cross-entropy) and its parts.
        With `activations` (offline training, `streamspec.training.activations`) the frozen model's
        last hidden states and predictions are the stored ones; nothing of the base runs."""
        from .model import StreamedOutput

        if labels is None:
            raise ValueError("MedusaModel.forward trains the heads: it needs labels (decode with streamspec's generate)")
        hidden, own = self._stored_or_final(input_ids, attention_mask, activations)
        loss, means = _term_losses(self.hf_model.get_output_embeddings(), self._terms(hidden, labels, own),
                                   loss_chunk_size, freeze_head=True)
        parts = {f"head_{k}": value for k, value in enumerate(means, start=1)}
        return StreamedOutput(loss=loss / len(self.heads), loss_parts=parts)

    def _stored_or_final(self, input_ids, attention_mask, activations):
        """(last hidden states, stored main predictions or None): from `activations` when given."""
        if activations is None:
            return self._final_hidden(input_ids, attention_mask), None
        stored = check_activations(activations, tuple(input_ids.shape), None)
        return stored["hidden"], stored["own"]

    @torch.no_grad()
    def evaluate_counts(self, input_ids, attention_mask=None, labels=None, chunk_size: int = 256,
                        activations: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Validation sums like `StreamedModel.evaluate_counts`: ``main`` and ``head_k`` terms."""
        if labels is None:
            raise ValueError("evaluate_counts needs labels")
        hidden, own = self._stored_or_final(input_ids, attention_mask, activations)
        norm = getattr(self.decoder, self.arch.norm)
        lm_head = self.hf_model.get_output_embeddings()
        next_labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        sums: dict[str, float] = {}
        if activations is None:
            terms = [("main", hidden, next_labels, 1.0, norm)] + self._terms(hidden, labels)
        else:
            sums.update(stored_main_counts(labels, activations))
            terms = self._terms(hidden, labels, own)
        for name, rows, target, _, transform in terms:
            keep = target != -100
            loss_sum, correct = cross_entropy_and_top1(lm_head, transform(rows[keep]), target[keep], chunk_size)
            sums.update({f"{name}_loss_sum": loss_sum, f"{name}_correct": correct, f"{name}_count": int(keep.sum())})
        return sums

    # -- checkpoints ---------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the heads as a Medusa checkpoint folder (see the module docstring)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        name = getattr(self.config, "_name_or_path", None)
        base = {"name_or_path": name, **_base_facts(self.config), "fingerprint": base_fingerprint(self.hf_model)}
        if name and Path(name).is_dir():
            base["relative_path"] = os.path.relpath(Path(name).resolve(), out.resolve())
        meta = {"format": MEDUSA_FORMAT, "format_version": MEDUSA_FORMAT_VERSION,
                "medusa_config": self.medusa_config.to_dict(), "base_model": base}
        save_file({k: v.detach().contiguous().cpu() for k, v in self.heads.state_dict().items()},
                  str(out / MEDUSA_WEIGHTS_FILE))
        (out / MEDUSA_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return out


def add_medusa_heads(model: nn.Module, config: MedusaConfig | None = None) -> MedusaModel:
    """Freeze a transformers causal LM and give it Medusa heads (see the module docstring)."""
    if isinstance(model, DecoderParts):
        raise ValueError("this model already has draft streams or heads")
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"add_medusa_heads needs a transformers causal-LM model, got {type(model).__name__}")
    return MedusaModel(model, config if config is not None else MedusaConfig())


def is_medusa_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / MEDUSA_CONFIG_FILE).is_file()


def read_medusa_meta(folder: str | Path) -> dict[str, Any]:
    """A Medusa checkpoint's metadata, checked for format and version."""
    path = Path(folder) / MEDUSA_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a Medusa checkpoint (no {MEDUSA_CONFIG_FILE})")
    meta = json.loads(path.read_text())
    if meta.get("format") != MEDUSA_FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {MEDUSA_FORMAT!r}")
    if meta.get("format_version") != MEDUSA_FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')!r}; this streamspec reads "
                              f"{MEDUSA_FORMAT_VERSION}")
    return meta


def medusa_base(folder: str | Path, meta: dict[str, Any] | None = None) -> str:
    """The base model a Medusa checkpoint names (found relative to the folder when it moved), as
    `streamspec.patch.checkpoint.recorded_base` finds a streamed checkpoint's."""
    from .checkpoint import recorded_base

    name = recorded_base(folder, meta or read_medusa_meta(folder))
    if not name:
        raise CheckpointError(f"{folder}: the checkpoint does not name its base model")
    return name


def load_medusa_heads(model: MedusaModel, folder: str | Path) -> None:
    """Load a checkpoint's heads into `model`, strictly: same config, same base, same keys and
    shapes, or `CheckpointError` and nothing loaded."""
    folder = Path(folder)
    meta = read_medusa_meta(folder)
    if meta["medusa_config"] != model.medusa_config.to_dict():
        raise CheckpointError(f"{folder} holds heads {meta['medusa_config']}, the model has {model.medusa_config.to_dict()}")
    recorded = meta["base_model"]
    actual = _base_facts(model.config)
    wrong = {k: (recorded.get(k), v) for k, v in actual.items() if recorded.get(k) != v}
    if wrong:
        raise CheckpointError(f"{folder} was trained on another base model: (recorded, actual) {wrong}")
    if recorded.get("fingerprint") and not same_fingerprint(recorded["fingerprint"], base_fingerprint(model.hf_model)):
        raise CheckpointError(f"{folder} was trained on another base model of the same shape (weights differ)")
    weights = folder / MEDUSA_WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{folder} has no {MEDUSA_WEIGHTS_FILE}")
    state = load_file(str(weights))
    expected = model.heads.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        raise CheckpointError(f"{weights} does not match the heads: missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}, wrong shapes {shapes[:4]}")
    model.heads.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def load_medusa(folder: str | Path, base_model: nn.Module | None = None, dtype: torch.dtype | None = None) -> MedusaModel:
    """A `MedusaModel` from a checkpoint folder: its base (given, or loaded from the name it
    records) with the heads loaded strictly."""
    meta = read_medusa_meta(folder)
    if base_model is None:
        from ..assets import load_base_model

        base_model = load_base_model(medusa_base(folder, meta), dtype=dtype or torch.float32)
    model = MedusaModel(base_model, MedusaConfig(**meta["medusa_config"]))
    load_medusa_heads(model, folder)
    return model.eval()
