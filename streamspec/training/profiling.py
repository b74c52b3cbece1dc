"""Measurements of training cost: peak memory and time of one forward+backward step.

Peak memory is the process's resident-set high-water mark (Linux VmHWM), reset just before the
step, so model loading does not count. Run each variant in its own process (`eval/train_memory.py`
does) so that allocator caches from one variant do not flatter the next.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..assets import load_default_model
from ..config import StreamConfig
from ..patch.model import add_streams

VARIANTS = ("plain", "streams")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (peak memory is measured on Linux only)")


def train_step_memory(variant: str, batch: int = 4, length: int = 512, labelled: int | None = None, seed: int = 0) -> dict:
    """Peak memory and wall time of one forward+backward training step of the default model.

    Args:
        variant: ``"plain"`` (the HF model's own forward with labels) or ``"streams"``
            (shared-mode streams, γ=3, Ns=4, through `StreamedModel.forward`).
        batch, length: the batch shape (random real token ids).
        labelled: how many trailing tokens per row carry labels (the completion); the rest are
            prompt (-100). Default: all of them.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    torch.manual_seed(seed)
    base = load_default_model().train()
    model = add_streams(base, StreamConfig()).train() if variant == "streams" else base
    ids = torch.randint(0, base.config.vocab_size, (batch, length))
    labels = ids.clone()
    if labelled is not None:
        labels[:, : length - labelled] = -100
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    before = _rss_kib("VmRSS")
    start = time.perf_counter()
    out = model(ids, labels=labels)
    out.loss.backward()
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM")
    return {
        "variant": variant,
        "batch": batch,
        "length": length,
        "labelled": labelled if labelled is not None else length,
        "step_seconds": round(seconds, 2),
        "peak_step_mib": round((peak - before) / 1024),
        "peak_rss_mib": round(peak / 1024),
    }


def train_step_time_ratio(steps: int = 6, batch: int = 4, seed: int = 0) -> dict:
    """Seconds per LoRA training step (forward + backward) with streams vs the next-token baseline
    with the same LoRA, on the same real Spider training batches, measured alternately in one
    process so that machine noise hits both alike. Returns medians and their ratio."""
    import statistics

    from peft import LoraConfig, get_peft_model

    from ..assets import load_default_tokenizer
    from ..data.build import PadCollator, tokenize_rows
    from ..data.spider import load_spider

    torch.manual_seed(seed)
    tokenizer = load_default_tokenizer()
    examples, _ = tokenize_rows(load_spider("train")[: steps * batch], tokenizer, max_length=768)
    collate = PadCollator(tokenizer.pad_token_id)
    batches = [collate(examples[i : i + batch]) for i in range(0, len(examples) - batch + 1, batch)]

    def lora():
        return LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])

    baseline = get_peft_model(load_default_model(), lora()).train()
    streamed = add_streams(load_default_model(), StreamConfig()).add_lora(lora()).train()
    times: dict[str, list[float]] = {"next_token": [], "streams": []}
    for i, b in enumerate([batches[0]] + batches):  # the first batch warms both up, untimed
        for name, model in (("next_token", baseline), ("streams", streamed)):
            start = time.perf_counter()
            model(**b).loss.backward()
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if i > 0:
                times[name].append(elapsed)
    for m, _, _ in variants.values():
        if hasattr(m, "main_apart"):
            m.main_apart = True
    medians = {name: statistics.median(values) for name, values in times.items()}
    tokens = [int(b["attention_mask"].sum()) for b in batches]
    targets = [int((b["labels"] != -100).sum()) for b in batches]
    return {
        "steps": len(batches),
        "batch": batch,
        "mean_tokens_per_batch": round(sum(tokens) / len(tokens)),
        "mean_completion_tokens_per_batch": round(sum(targets) / len(targets)),
        "next_token_seconds": round(medians["next_token"], 3),
        "streams_seconds": round(medians["streams"], 3),
        "ratio": round(medians["streams"] / medians["next_token"], 3),
    }


def offline_step_time(recipe_path: str, overrides: list[str] | None = None, steps: int = 6, store: str | None = None,
                      dtypes: tuple[str, ...] = ("float32",)) -> dict:
    """Seconds per training step (forward + backward) of a recipe online and offline
    (``data.cache_activations``), on the same batches of the recipe's own training examples,
    measured alternately in one process (for lossless streams online both ways: the main stream
    apart, the default, and ``online_rows_together``, main and stream rows through the MSA
    layers together); also the loss of each path on each batch (they must
    agree), the store's size and build time, and the seconds an epoch would take each way.

    With ``dtypes=("float32", "bfloat16")`` the offline step is also timed on a bfloat16 copy of
    the base (stored activations in bfloat16, float32 stream masters): mixed precision on CPUs
    with native bf16 dot products.
    """
    import statistics
    import tempfile

    from ..data.build import PadCollator
    from .activations import ActivationCollator, build_activation_store, with_activation_index
    from .recipe import load_recipe
    from .trainer import build_datasets, build_model

    recipe = load_recipe(recipe_path, overrides)
    batch = recipe.training.batch_size
    torch.manual_seed(recipe.training.seed)
    model, tokenizer = build_model(recipe)
    model.train()
    train_set, _ = build_datasets(recipe, tokenizer)
    epoch_examples = len(train_set)
    rows = train_set.to_list()[: (steps + 1) * batch]
    pad = PadCollator(tokenizer.pad_token_id)
    results: dict = {"recipe": str(recipe_path), "overrides": overrides or [], "batch": batch,
                     "epoch_examples": epoch_examples, "threads": torch.get_num_threads()}
    # online: lossless streams run the main stream apart (`runs_main_apart`); the earlier online
    # path, main and stream rows through the MSA layers together, is timed beside it
    variants = {"online": (model, None, True)}
    if getattr(model, "runs_main_apart", lambda: False)():
        variants["online_rows_together"] = (model, None, False)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(store) if store else Path(tmp)
        for dtype in dtypes:
            variant = model if dtype == "float32" else _reduced_copy(recipe, model, dtype)
            start = time.perf_counter()
            built = build_activation_store(variant, rows, path=folder / dtype, batch_size=batch)
            results[f"store_{dtype}"] = {"seconds": round(time.perf_counter() - start, 1), "bytes": built.bytes(),
                                         "bytes_per_example": round(built.bytes() / len(rows))}
            variants[f"offline_{dtype}"] = (variant, ActivationCollator(tokenizer.pad_token_id, built), True)
        indexed = with_activation_index(rows)
        batches = [indexed[i : i + batch] for i in range(0, len(indexed) - batch + 1, batch)]
        times: dict[str, list[float]] = {name: [] for name in variants}
        losses: dict[str, list[float]] = {name: [] for name in variants}
        for i, rows_of_batch in enumerate(batches):  # the first batch warms every variant up, untimed
            for name, (m, collate, apart) in variants.items():
                inputs = (collate or pad)(rows_of_batch)
                if hasattr(m, "main_apart"):
                    m.main_apart = apart
                start = time.perf_counter()
                loss = m(**inputs).loss
                loss.backward()
                elapsed = time.perf_counter() - start
                m.zero_grad(set_to_none=True)
                if i > 0:
                    times[name].append(elapsed)
                    losses[name].append(round(float(loss), 5))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, seconds in medians.items():
        results[name] = {"seconds_per_step": round(seconds, 3),
                         "seconds_per_epoch": round(seconds * epoch_examples / batch),
                         "speedup_over_online": round(medians["online"] / seconds, 2), "losses": losses[name]}
    return results


def _reduced_copy(recipe, model, dtype: str):
    """A copy of the recipe's model on a base of another dtype, with the same trainable weights."""
    import copy

    from .trainer import build_model

    other = copy.deepcopy(recipe)
    other.model.dtype = dtype
    reduced, _ = build_model(other)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in reduced.named_parameters():
            if p.requires_grad:
                p.copy_(own[name])
    return reduced.train()
