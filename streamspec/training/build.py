"""What a recipe trains: the model (`build_model`: streams, Medusa heads or a LoRA next-token
baseline, float32 masters on a reduced-precision base) and its data (`task_rows`,
`build_datasets`). `streamspec.training.trainer` re-exports these names."""

from __future__ import annotations

import torch

from ..arch import arch_spec
from ..assets import load_base_model, load_tokenizer
from ..data.build import load_rows, log_stats, tokenize_rows
from ..data.distill import labelled_rows
from ..patch.medusa import add_medusa_heads
from ..patch.model import StreamedModel, add_streams
from .recipe import Recipe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REDUCED = (torch.bfloat16, torch.float16)


def build_model(recipe: Recipe):
    """The model a recipe trains (a `StreamedModel`, or a peft model for the next-token baseline)
    and its tokenizer."""
    base = load_base_model(
        recipe.model.name_or_path, dtype=DTYPES[recipe.model.dtype], attn_implementation=recipe.model.attn_implementation
    )
    tokenizer = load_tokenizer(recipe.model.name_or_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = None
    if recipe.lora.enabled:
        from peft import LoraConfig

        lora = LoraConfig(
            r=recipe.lora.r,
            lora_alpha=recipe.lora.alpha,
            lora_dropout=recipe.lora.dropout,
            target_modules=recipe.lora.peft_targets(
                base.config.num_hidden_layers, arch_spec(base.config).layers if recipe.lora.top_modules else "",
                recipe.streams.stream_layers if recipe.streams is not None else None,
            ),
            task_type="CAUSAL_LM",
        )
    if recipe.medusa is not None:
        heads = add_medusa_heads(base, recipe.medusa)
        if next(heads.heads.parameters()).dtype in _REDUCED:
            heads.heads.float()  # float32 masters, as for streams (keep_float32_masters)
        return heads, tokenizer
    if recipe.streams is None:
        from peft import get_peft_model

        return get_peft_model(base, lora), tokenizer
    model = add_streams(base, recipe.streams)
    if lora is not None:
        model.add_lora(lora)
    keep_float32_masters(model)
    return model, tokenizer


def keep_float32_masters(model: StreamedModel) -> None:
    """On a bfloat16 or float16 base, keep the parameters that train on top of it (the stream
    parameters, stream adapters and LoRA weights) in float32, so that their optimizer state is
    float32 too and an update smaller than a reduced-precision weight's rounding step is not lost.
    They are cast to the base's dtype where they are used (peft does so for LoRA). A full
    fine-tune's base weights keep the base's dtype. Under DeepSpeed with ``bf16``/``fp16`` enabled,
    DeepSpeed casts every parameter to that dtype and keeps float32 masters in its optimizer."""
    if model.streams.dtype in _REDUCED:
        model.streams.float()
    for name, param in model.base.named_parameters():
        if param.requires_grad and "lora_" in name and param.dtype in _REDUCED:
            param.data = param.data.float()  # peft upcasts adapters itself; older versions did not


def task_rows(recipe: Recipe, split: str) -> list[dict]:
    """The recipe's rows of one split ("train" or "validation")."""
    data = recipe.data
    if data.distill.enabled:
        from .distill import distilled_rows

        return distilled_rows(recipe.model.name_or_path, data.task, data.distill, split)
    if data.task != "custom":
        return labelled_rows(data.task, split)
    if split != "train" and not data.has_validation:
        return []
    common = dict(prompt_field=data.prompt_field, completion_field=data.completion_field, messages_field=data.messages_field)
    if data.path is not None:
        return load_rows(path=data.path if split == "train" else data.validation_path, **common)
    return load_rows(dataset=data.dataset, split=data.train_split if split == "train" else data.validation_split, **common)


def fraction_indices(count: int, fraction: float, seed: int = 0) -> list[int]:
    """Which of `count` examples a share keeps (at least one), in order: chosen by one fixed
    permutation, so that every smaller share is inside every larger one."""
    import random

    order = list(range(count))
    random.Random(seed).shuffle(order)
    return sorted(order[:max(1, round(count * fraction))])


def build_datasets(recipe: Recipe, tokenizer):
    """Tokenised train and validation `datasets.Dataset`s (validation may be None); the whole
    training set (the trainer takes ``data.train_fraction`` of it, after an activation store of
    the whole set, so that every share reads the same store)."""
    import datasets

    out = []
    for split, limit in (("train", recipe.data.max_train_examples), ("validation", recipe.data.max_validation_examples)):
        rows = task_rows(recipe, split)
        if limit is not None:
            rows = rows[:limit]
        if not rows:
            out.append(None)
            continue
        examples, stats = tokenize_rows(rows, tokenizer, recipe.data.max_length, recipe.data.overflow)
        log_stats(f"{recipe.data.task} {split}", stats, recipe.data.max_length)
        if not examples:
            raise ValueError(f"no {split} example is left after tokenisation (max_length={recipe.data.max_length})")
        out.append(datasets.Dataset.from_list(examples))
    return out[0], out[1]
