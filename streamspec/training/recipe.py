"""Fine-tuning recipes: YAML files parsed into typed dataclasses, with ``key=value`` overrides.

A recipe has five sections, each a dataclass below: ``model``, ``streams`` (a `StreamConfig`, or
``null`` for the plain next-token baseline), ``lora``, ``data`` and ``training``. An unknown key
or a value of the wrong type is an error naming it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..assets import DEFAULT_MODEL_ID
from ..config import StreamConfig
from ..data.build import OVERFLOW
from ..data.distill import DistillArgs
from ..patch.medusa import MedusaConfig
from ..config import build_section

TASKS = ("sql", "summarize", "gsm8k_solutions", "custom")
DTYPES = ("float32", "bfloat16", "float16")
REPORT_TO = ("wandb", "none")


@dataclass
class ModelArgs:
    """The base model: a hub id, a local folder, or the built-in default."""

    name_or_path: str = DEFAULT_MODEL_ID
    dtype: str = "float32"
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        _choice("model.dtype", self.dtype, DTYPES)
        _choice("model.attn_implementation", self.attn_implementation, ("sdpa", "eager"))


@dataclass
class LoraArgs:
    """peft LoRA on the base (shared mode and the next-token baseline)."""

    enabled: bool = True
    r: int = 32
    alpha: int = 64
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # Modules adapted only in the top `top_layers` layers (default: the streams' Ns), e.g. the MLP
    # projections: capacity where the streams are, without reshaping the lower layers.
    top_modules: list[str] = field(default_factory=list)
    top_layers: int | None = None

    def __post_init__(self) -> None:
        _positive("lora.r", self.r)
        _positive("lora.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module")
        if self.top_layers is not None:
            _positive("lora.top_layers", self.top_layers)
        overlap = sorted(set(self.top_modules) & set(self.target_modules))
        if overlap:
            raise ValueError(f"lora.top_modules {overlap} are already in lora.target_modules (adapted in every layer)")

    def peft_targets(self, num_layers: int, layers_attr: str, default_top_layers: int | None) -> list[str] | str:
        """`target_modules` for peft: the plain list, or with `top_modules` a regex (peft matches a
        string against whole module names) adding those modules in the top layers only."""
        if not self.top_modules:
            return list(self.target_modules)
        top = self.top_layers or default_top_layers
        if top is None:
            raise ValueError("lora.top_modules needs lora.top_layers when the recipe has no streams")
        if top > num_layers:
            raise ValueError(f"lora.top_layers is {top} but the model has {num_layers} layers")
        every = "|".join(re.escape(m) for m in self.target_modules)
        extra = "|".join(re.escape(m) for m in self.top_modules)
        layers = "|".join(str(i) for i in range(num_layers - top, num_layers))
        return rf"(.*\.({every}))|(.*\.{re.escape(layers_attr)}\.({layers})\..*\.({extra}))"


@dataclass
class DataArgs:
    """Training data: a built-in task or your own file / `datasets` name."""

    task: str = "sql"
    # a file or a distilled set's shard folder, or a list of them (read in order, e.g. several
    # `streamspec distill --engine vllm` folders)
    path: str | list[str] | None = None
    validation_path: str | list[str] | None = None
    dataset: str | None = None
    train_split: str = "train"
    validation_split: str | None = "validation"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str | None = None
    max_length: int = 1024
    overflow: str = "drop"
    max_train_examples: int | None = None
    max_validation_examples: int | None = None
    # train on a share of the training rows (0 < f <= 1): a fixed random subset (seed 0), each
    # smaller share inside every larger one, for data-scaling studies
    train_fraction: float = 1.0
    # train on the model's own completions of the task's prompts (lossless streams): see
    # `streamspec.data.distill`; the set is built (and cached) before training starts
    distill: DistillArgs = field(default_factory=DistillArgs)
    # offline training (lossless streams, Medusa heads): what the frozen base computes on the
    # examples is computed once and stored (`streamspec.training.activations`), in the cache or
    # in `activations_path`; steps then run only the streams or heads
    cache_activations: bool = False
    activations_path: str | None = None

    def __post_init__(self) -> None:
        _choice("data.task", self.task, TASKS)
        if self.activations_path and not self.cache_activations:
            raise ValueError("data.activations_path goes with data.cache_activations=true")
        _choice("data.overflow", self.overflow, OVERFLOW)
        _positive("data.max_length", self.max_length)
        if not 0 < self.train_fraction <= 1:
            raise ValueError(f"data.train_fraction must be in (0, 1], got {self.train_fraction!r}")
        if self.task == "custom" and (self.path is None) == (self.dataset is None):
            raise ValueError("data.task 'custom' needs exactly one of data.path or data.dataset")
        if self.task != "custom" and (self.path or self.dataset or self.validation_path):
            raise ValueError(f"data.path / data.validation_path / data.dataset are for data.task 'custom', not {self.task!r}")
        if self.distill.enabled:
            self.distill.check_task(self.task)
        if self.validation_path and not self.path:
            raise ValueError("data.validation_path goes with data.path (for a datasets name use data.validation_split)")

    @property
    def has_validation(self) -> bool:
        if self.task != "custom":
            return True
        return bool(self.validation_path) if self.path else self.validation_split is not None


@dataclass
class TrainingArgs:
    """The optimisation and its bookkeeping (mapped onto transformers `TrainingArguments`)."""

    output_dir: str = "runs/streamspec"
    epochs: float = 1.0
    max_steps: int = -1
    batch_size: int = 4
    eval_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-4
    # Learning rate of the stream identifiers P_j (and the low-rank init map); None: learning_rate.
    # They are few and in units of the hidden state's RMS, so the LoRA rate barely moves them.
    stream_learning_rate: float | None = None
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    logging_steps: int = 10
    eval_steps: int | None = None
    save_steps: int = 200
    save_total_limit: int | None = 2
    seed: int = 42
    bf16: bool = False
    # float16 mixed precision with loss scaling (GPUs without bfloat16); trainable weights float32
    fp16: bool = False
    gradient_checkpointing: bool = False
    report_to: str = "wandb"
    wandb_project: str = "streamspec"
    run_name: str | None = None
    deepspeed: str | None = None
    # trained streams (or Medusa heads) to start from instead of fresh ones: a checkpoint folder
    # or shipped weights by name; the same base and stream config as this recipe, or refused
    init_from: str | None = None
    # batches of examples of near length (transformers' length-grouped sampler: a shuffled group
    # of up to 50 batches' examples, sorted), so a batch of a set of mixed lengths pads little
    group_by_length: bool = False
    # a wall-clock budget: training stops after the first step that ends past it (then saves and
    # exports as at the end of a run); null: no budget. `--resume` goes on from the last checkpoint.
    max_minutes: float | None = None

    def __post_init__(self) -> None:
        _positive("training.batch_size", self.batch_size)
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"training.max_minutes must be > 0 or null (no budget), got {self.max_minutes!r}")
        _positive("training.eval_batch_size", self.eval_batch_size)
        _positive("training.gradient_accumulation_steps", self.gradient_accumulation_steps)
        _positive("training.logging_steps", self.logging_steps)
        _positive("training.save_steps", self.save_steps)
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"training.warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.learning_rate <= 0:
            raise ValueError(f"training.learning_rate must be > 0, got {self.learning_rate!r}")
        if self.stream_learning_rate is not None and self.stream_learning_rate <= 0:
            raise ValueError(f"training.stream_learning_rate must be > 0 or null, got {self.stream_learning_rate!r}")
        if self.epochs <= 0 and self.max_steps <= 0:
            raise ValueError("training.epochs must be > 0 unless training.max_steps is set")
        _choice("training.report_to", self.report_to, REPORT_TO)
        if self.bf16 and self.fp16:
            raise ValueError("training.bf16 and training.fp16 are exclusive: pick one mixed precision")


@dataclass
class Recipe:
    model: ModelArgs = field(default_factory=ModelArgs)
    streams: StreamConfig | None = field(default_factory=StreamConfig)
    lora: LoraArgs = field(default_factory=LoraArgs)
    data: DataArgs = field(default_factory=DataArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    # Medusa heads on the frozen model instead of streams (`streamspec.patch.medusa`): the peer
    # method, trained on the same data; needs `streams: null` and `lora.enabled: false`
    medusa: MedusaConfig | None = None

    def __post_init__(self) -> None:
        if self.medusa is not None:
            if self.streams is not None or self.lora.enabled:
                raise ValueError("a medusa recipe trains heads on the frozen model: set 'streams: null' and "
                                 "lora.enabled=false")
            if self.training.deepspeed:
                raise ValueError("medusa recipes run without DeepSpeed (the heads are small): remove training.deepspeed")
            return
        if self.streams is not None and self.streams.mode == "lossless" and self.lora.enabled:
            raise ValueError("streams.mode 'lossless' keeps the base frozen: set lora.enabled=false")
        if self.data.cache_activations and (self.streams is None or self.streams.mode != "lossless"):
            raise ValueError("data.cache_activations stores what the frozen base computes: it needs streams.mode "
                             "'lossless' or a medusa section (in shared mode and next-token training the base trains)")
        if self.data.cache_activations and self.training.gradient_checkpointing:
            raise ValueError("data.cache_activations runs only the stream rows, which read the stored main keys that a "
                             "checkpointed layer drops: set training.gradient_checkpointing=false (offline training "
                             "keeps the activations of the stream rows alone)")
        if self.data.cache_activations and self.training.deepspeed:
            raise ValueError("data.cache_activations trains only the streams on one process: remove training.deepspeed")
        if self.data.distill.enabled and (self.streams is None or self.streams.mode != "lossless"):
            raise ValueError("data.distill trains drafts on the model's own outputs: it needs streams.mode 'lossless' "
                             "or a medusa section (a fine-tune on its own outputs would learn nothing new)")
        if self.streams is None and not self.lora.enabled:
            raise ValueError("a next-token recipe (streams: null) needs lora.enabled=true: nothing would train")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {"model": ModelArgs, "streams": StreamConfig, "lora": LoraArgs, "data": DataArgs, "training": TrainingArgs,
             "medusa": MedusaConfig}
_NULLABLE = ("streams", "medusa")


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe and apply ``section.key=value`` overrides (values parsed as YAML)."""
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe must be a mapping of sections {sorted(_SECTIONS)}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. training.learning_rate=1e-4)")
        section, name = key.split(".", 1)
        if section not in _SECTIONS:
            raise ValueError(f"override {item!r}: unknown section {section!r}; allowed: {sorted(_SECTIONS)}")
        if section in raw and raw[section] is None:
            raise ValueError(
                f"override {item!r}: this recipe has '{section}: null' (next-token training); write a "
                f"'{section}:' section in the recipe to train with streams"
            )
        target = raw.setdefault(section, {})
        *parents, leaf = name.split(".")  # data.distill.enabled=true: a key of a nested section
        for parent in parents:
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                raise ValueError(f"override {item!r}: {section}.{parent} is not a section")
        target[leaf] = yaml.safe_load(value)
    return recipe_from_dict(raw, source=str(path))


def recipe_from_dict(raw: dict[str, Any], source: str = "recipe") -> Recipe:
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ValueError(f"{source}: unknown section(s) {unknown}; allowed: {sorted(_SECTIONS)}")
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name, {})
        if name == "medusa" and name not in raw:
            sections[name] = None  # no Medusa heads unless the recipe has the section
            continue
        if values is None and name in _NULLABLE:
            sections[name] = None
            continue
        if not isinstance(values, dict):
            raise ValueError(f"{source}: section {name!r} must be a mapping")
        sections[name] = build_section(cls, values, name, source)
    return Recipe(**sections)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
