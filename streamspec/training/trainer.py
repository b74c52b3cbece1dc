"""Fine-tuning with the transformers `Trainer`: one recipe in, a streamed checkpoint out.

The Trainer brings DeepSpeed, gradient accumulation, schedules, checkpointing, resume and wandb.
What streamspec adds:

- `build_model` (streams, LoRA, lossless freezing from the recipe) and `build_datasets`
  (`streamspec.training.build`);
- `StreamTrainer`: logs each loss part and tokens/s; validation reports the main loss and the
  top-1 accuracy of every stream (how often stream j's argmax is the token t+1+j) and of the
  chain (``chain_j``: streams 1..j all right, the share of passes a chain's draft j is accepted
  in when decoding this text, which predicts decoding speed); checkpoints are streamed checkpoints (only the new weights and the LoRA
  adapter), which `streamspec export` and `load_streamed` read and resume reloads strictly;
- `run_training`: the whole job, ending with ``<output_dir>/final`` and ``training_summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from ..patch.checkpoint import check_trainable_checkpoint
from ..data.build import PadCollator
from ..patch.checkpoint import check_stream_config, load_training_checkpoint  # noqa: F401 (part of this API)
from ..patch.resume import init_draft_from, load_draft_checkpoint
from ..patch.decoder import DecoderParts
from ..patch.model import StreamedModel
from .build import build_datasets, build_model, fraction_indices, keep_float32_masters, task_rows  # noqa: F401 (re-exported)
from .recipe import Recipe
from ..patch.zero import (  # noqa: F401  (check_deepspeed_config: part of this module's API)
    check_deepspeed_config,
    check_partitioned,
    gathered,
    init_deepspeed_comm,
    save_trainable,
)

logger = logging.getLogger(__name__)

SUMMARY_FILE = "training_summary.json"
RECIPE_FILE = "recipe.yaml"
LENGTH_COLUMN = "length"  # the rows' token counts, with training.group_by_length


class StreamTrainer(Trainer):
    """`Trainer` that logs loss parts and tokens/s, validates stream accuracy, and checkpoints in
    the streamed format."""

    def __init__(self, *args, stream_learning_rate: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stream_learning_rate = stream_learning_rate
        self._parts: dict[str, float] = {}
        self._parts_batches = 0
        self._tokens = 0
        self._since = time.perf_counter()

    # -- training ------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        """The Trainer's optimizer, with the stream identifiers (and low-rank init map) in their
        own parameter group at `stream_learning_rate` when one is set (no weight decay)."""
        optimizer = super().create_optimizer(model)
        unwrapped = self.accelerator.unwrap_model(self.model)
        if self.stream_learning_rate is None or not isinstance(unwrapped, DecoderParts):
            return optimizer
        chosen = {id(p) for p in unwrapped.own_rate_parameters()}
        moved = []
        for group in optimizer.param_groups:
            moved += [p for p in group["params"] if id(p) in chosen]
            group["params"] = [p for p in group["params"] if id(p) not in chosen]
        if moved:
            optimizer.add_param_group({"params": moved, "lr": self.stream_learning_rate, "weight_decay": 0.0})
        return optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        parts = getattr(outputs, "loss_parts", None) or {}
        for name, value in parts.items():
            self._parts[name] = self._parts.get(name, 0.0) + float(value)
        self._parts_batches += 1
        tokens = int(inputs["attention_mask"].sum())
        self._tokens += tokens
        if model.training:  # the run's total, kept in its checkpoints (a resumed run goes on counting)
            self.state.num_input_tokens_seen += tokens
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: add the loss parts and throughput since the last one
            n = max(self._parts_batches, 1)
            logs.update({f"loss_{name}": round(total / n, 4) for name, total in self._parts.items()})
            elapsed = time.perf_counter() - self._since
            tokens = self._tokens * self.args.world_size
            logs["tokens_per_second"] = round(tokens / elapsed, 1) if elapsed > 0 else 0.0
            if torch.cuda.is_available():
                logs["peak_gpu_memory_mib"] = peak_gpu_memory_mib()
            self._parts, self._parts_batches, self._tokens, self._since = {}, 0, 0, time.perf_counter()
        super().log(logs, start_time)

    # -- validation ----------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        dataloader = self.get_eval_dataloader(eval_dataset)
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        sums: dict[str, float] = {}
        for batch in dataloader:
            batch = self._prepare_inputs(batch)
            for key, value in evaluation_counts(model, batch).items():
                sums[key] = sums.get(key, 0.0) + value
        if self.args.world_size > 1:
            keys = sorted(sums)
            total = self.accelerator.reduce(torch.tensor([sums[k] for k in keys], device=self.args.device), "sum")
            sums = dict(zip(keys, total.tolist()))
        model.train(was_training)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in summarize_counts(sums).items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if not isinstance(model, DecoderParts):
            return super()._save(output_dir, state_dict)  # the next-token baseline: a peft model
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        model.save_training_checkpoint(output_dir, tokenizer=self.processing_class)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = self.accelerator.unwrap_model(model or self.model)
        if not isinstance(model, DecoderParts):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_draft_checkpoint(model, resume_from_checkpoint)

    # -- checkpoints under DeepSpeed -----------------------------------------------------------
    def _streamed_deepspeed(self) -> bool:
        return self.is_deepspeed_enabled and isinstance(self.accelerator.unwrap_model(self.model), StreamedModel)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._streamed_deepspeed():
            return super().save_model(output_dir, _internal_call)
        # Not the Trainer's way under ZeRO-3 (the whole model gathered into one state dict): only
        # the trainable weights and the embedding (its fingerprint) are gathered, on every process.
        model = self.accelerator.unwrap_model(self.model)
        wanted = [p for p in model.parameters() if p.requires_grad] + [model.hf_model.get_input_embeddings().weight]
        with gathered(wanted):
            self._save(output_dir or self.args.output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._streamed_deepspeed():
            return super()._save_optimizer_and_scheduler(output_dir)
        save_trainable(self.model_wrapped, output_dir)  # not a second copy of the frozen base
        from accelerate.utils import DeepSpeedSchedulerWrapper

        if self.args.should_save and not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))  # as the Trainer does

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if resume_from_checkpoint is None or not self._streamed_deepspeed():
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        # The Trainer would load the DeepSpeed checkpoint strictly, expecting the frozen base in it:
        # check it holds exactly the trainable weights, then load it (the base is already in place).
        folder = Path(resume_from_checkpoint)
        check_stream_config(self.accelerator.unwrap_model(self.model), folder)
        check_trainable_checkpoint(self.accelerator.unwrap_model(self.model), folder)
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        load_path, _ = self.model_wrapped.load_checkpoint(
            str(folder), load_module_strict=False, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {folder}")
        self._load_optimizer_and_scheduler(str(folder))
        self._load_scaler(str(folder))
        return model, train_dataloader


def offline_datasets(model, train_set, validation_set, pad_id: int, path: str | None, batch_size: int):
    """Offline training (``data.cache_activations``): the store of the train and validation
    examples' activations (built on first use, in one store), the sets with each row's index in
    it, and the collator that reads it."""
    from .activations import ActivationCollator, INDEX_COLUMN, build_activation_store

    train_rows = train_set.to_list()
    validation_rows = validation_set.to_list() if validation_set is not None else []
    store = build_activation_store(model, train_rows + validation_rows, path=path, batch_size=batch_size)
    logger.warning("offline training: activations of %d examples in %s (%.1f MB)", len(store), store.folder,
                   store.bytes() / 1e6)
    train_set = train_set.add_column(INDEX_COLUMN, list(range(len(train_rows))))
    if validation_set is not None:
        validation_set = validation_set.add_column(INDEX_COLUMN, list(range(len(train_rows), len(store))))
    return train_set, validation_set, ActivationCollator(pad_id, store)


def evaluation_counts(model, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Validation sums for one batch; a next-token model has only the ``main`` term."""
    if isinstance(model, DecoderParts):
        return model.evaluate_counts(batch["input_ids"], batch["attention_mask"], batch["labels"],
                                     activations=batch.get("activations"))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    loss = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
    correct = (logits[keep].argmax(-1) == targets[keep]).sum()
    return {"main_loss_sum": loss.item(), "main_correct": int(correct), "main_count": int(keep.sum())}


def summarize_counts(sums: dict[str, float]) -> dict[str, float]:
    """``loss`` (main), ``{term}_loss`` and ``{term}_top1`` from `evaluation_counts` sums (a term
    without a loss, ``chain_j``, has its top-1 only)."""
    metrics: dict[str, float] = {}
    terms = sorted({k.rsplit("_", 2)[0] if k.endswith("_loss_sum") else k.rsplit("_", 1)[0] for k in sums})
    for term in terms:
        count = max(sums.get(f"{term}_count", 0), 1)
        if f"{term}_loss_sum" in sums:
            metrics[f"{term}_loss"] = round(sums[f"{term}_loss_sum"] / count, 4)
        metrics[f"{term}_top1"] = round(sums[f"{term}_correct"] / count, 4)
    metrics["loss"] = metrics["main_loss"]
    return metrics


def with_lengths(dataset):
    """The rows' token counts as a `LENGTH_COLUMN` column (what `training.group_by_length` sorts by)."""
    return dataset.map(lambda rows: {LENGTH_COLUMN: [len(ids) for ids in rows["input_ids"]]}, batched=True,
                       desc="row lengths")


def training_arguments(recipe: Recipe) -> TrainingArguments:
    t = recipe.training
    return TrainingArguments(
        output_dir=t.output_dir,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=t.eval_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        eval_strategy=("steps" if t.eval_steps else "epoch") if recipe.data.has_validation else "no",
        eval_steps=t.eval_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        seed=t.seed,
        data_seed=t.seed,
        bf16=t.bf16,
        fp16=t.fp16,
        # StreamedModel turns it on itself (run_training); the Trainer handles the baseline.
        activation_checkpointing=t.gradient_checkpointing and recipe.streams is None,
        report_to=[] if t.report_to == "none" else [t.report_to],
        run_name=t.run_name,
        deepspeed=t.deepspeed,
        remove_unused_columns=False,
        label_names=["labels"],
        train_sampling_strategy="group_by_length" if t.group_by_length else "random",
        length_column_name=LENGTH_COLUMN,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        # Several CPU processes (torchrun/deepspeed without GPUs) talk over gloo.
        ddp_backend="gloo" if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )


def _configure_wandb(recipe: Recipe) -> None:
    if recipe.training.report_to != "wandb":
        return
    os.environ.setdefault("WANDB_PROJECT", recipe.training.wandb_project)
    os.environ.setdefault("WANDB_DIR", recipe.training.output_dir)
    if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"
        logger.warning("wandb: no WANDB_API_KEY set, logging offline under %s/wandb", recipe.training.output_dir)


class TimeBudget(TrainerCallback):
    """Stops training after the first step that ends `minutes` after training began (the model is
    then saved and exported as at the end of a run; the summary's ``stopped_by_time`` says so)."""

    def __init__(self, minutes: float) -> None:
        self.seconds, self.start, self.stopped_at = minutes * 60.0, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None and time.perf_counter() - self.start >= self.seconds and state.global_step < state.max_steps:
            control.should_training_stop = control.should_save = True
            self.stopped_at = state.global_step
            logger.warning("training.max_minutes: stopping at step %d of %d (%.1f min spent)", state.global_step,
                           state.max_steps, (time.perf_counter() - self.start) / 60)


def run_training(recipe: Recipe, resume: bool = False) -> dict[str, Any]:
    """Train a recipe end to end; returns the training summary (also written to disk).

    Args:
        recipe: what to train.
        resume: continue from the latest complete checkpoint in the output folder (same data order).
    """
    check_deepspeed_config(recipe)
    out = Path(recipe.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RECIPE_FILE).write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    _configure_wandb(recipe)
    # The arguments first: with a ZeRO-3 config they register it globally, and `from_pretrained`
    # then loads the base already partitioned across the processes (never whole on one).
    args = training_arguments(recipe)
    init_deepspeed_comm(args)
    set_seed(recipe.training.seed)  # before the model: stream vectors and LoRA are initialised randomly
    model, tokenizer = build_model(recipe)
    check_partitioned(model)
    if recipe.training.init_from:
        if recipe.streams is None and recipe.medusa is None:
            raise ValueError("training.init_from starts from trained streams or Medusa heads; this recipe trains neither")
        folder = init_draft_from(model, recipe.training.init_from)
        logger.warning("starting from the trained %s in %s", "heads" if recipe.medusa is not None else "streams", folder)
    train_set, validation_set = build_datasets(recipe, tokenizer)
    if validation_set is None:
        args.eval_strategy = "no"
    collator = PadCollator(tokenizer.pad_token_id)
    if recipe.data.cache_activations:
        train_set, validation_set, collator = offline_datasets(model, train_set, validation_set, tokenizer.pad_token_id,
                                                               recipe.data.activations_path, recipe.training.eval_batch_size)
    if recipe.data.train_fraction < 1:
        keep = fraction_indices(len(train_set), recipe.data.train_fraction)
        logger.warning("training on %d of %d examples (data.train_fraction=%s)", len(keep), len(train_set),
                       recipe.data.train_fraction)
        train_set = train_set.select(keep)
    if recipe.training.group_by_length:  # transformers orders the validation rows by length too
        train_set = with_lengths(train_set)
        validation_set = None if validation_set is None else with_lengths(validation_set)
    if recipe.training.gradient_checkpointing and isinstance(model, StreamedModel):
        model.hf_model.gradient_checkpointing_enable()
    trainer = StreamTrainer(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=validation_set,
        data_collator=collator,
        processing_class=tokenizer,
        stream_learning_rate=recipe.training.stream_learning_rate,
    )
    if recipe.training.max_minutes is not None:
        trainer.add_callback(TimeBudget(recipe.training.max_minutes))
    checkpoint = None
    if resume:
        # Only complete checkpoints: the Trainer writes trainer_state.json last.
        checkpoints = sorted(
            (p for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file()),
            key=lambda p: int(p.name.split("-")[1]),
        )
        if not checkpoints:
            raise FileNotFoundError(f"--resume: no complete checkpoint-* folder in {out}")
        checkpoint = str(checkpoints[-1])
        logger.warning("resuming from %s", checkpoint)
    first_step = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"] if checkpoint else 0
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=checkpoint)
    wall = time.perf_counter() - start
    summary = _summary(trainer, result, wall, first_step)
    budget = next((c for c in trainer.callback_handler.callbacks if isinstance(c, TimeBudget)), None)
    summary["stopped_by_time"] = budget is not None and budget.stopped_at is not None
    final = out / "final"
    trainer.save_model(str(final))  # every rank: gathering sharded weights is collective
    summary["export"] = str(final)
    if trainer.is_world_process_zero():
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if recipe.training.report_to == "wandb":
        import wandb

        if wandb.run is not None:
            wandb.finish()  # flush the run files now, not at interpreter exit
    return summary


def peak_gpu_memory_mib() -> int | None:
    """The most GPU memory this process's tensors have held (torch's allocator; MiB), or None
    without CUDA. The training summary reports the largest over the processes (one per GPU)."""
    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**20)


def _largest_over_processes(trainer: Trainer, value: int | None) -> int | None:
    """The largest of every process's `value` (a collective: every process calls it)."""
    if value is None or trainer.args.world_size == 1:
        return value
    return int(trainer.accelerator.gather(torch.tensor([value], device=trainer.args.device)).max())


def _summary(trainer: Trainer, result, wall: float, first_step: int = 0) -> dict[str, Any]:
    """What a call of `run_training` did: ``steps`` the run's steps in all, ``steps_run`` those
    of this call (after the checkpoint it resumed from), which ``wall_seconds`` and
    ``seconds_per_step`` time."""
    history = trainer.state.log_history
    train_logs = [h for h in history if "loss" in h and "eval_loss" not in h]
    evals = [h for h in history if "eval_loss" in h]
    peak = None
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = round(int(line.split()[1]) / 1024)
    steps = trainer.state.global_step
    steps_run = steps - first_step
    return {
        "steps": steps,
        "steps_run": steps_run,
        "epochs": trainer.state.epoch,
        "wall_seconds": round(wall, 1),
        "seconds_per_step": round(wall / steps_run, 3) if steps_run else None,
        # the tokens of every training batch (padding not counted) over every call: this process's
        # count times the processes (with several, their batches' padding differs a little)
        "tokens_seen": int(trainer.state.num_input_tokens_seen) * trainer.args.world_size,
        "peak_rss_mib": peak,
        "peak_gpu_memory_mib": _largest_over_processes(trainer, peak_gpu_memory_mib()),
        "train_loss": result.training_loss,
        "final_losses": {k: v for k, v in (train_logs[-1] if train_logs else {}).items() if k.startswith("loss")},
        "validation": [
            {k: v for k, v in e.items() if k.startswith("eval_") or k in ("epoch", "step")} for e in evals
        ],
    }
