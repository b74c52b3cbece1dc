"""Recipes, DeepSpeed config checks and validation counts.

Everything here runs offline on a CPU in a few seconds: the real SmolLM2 tokenizer (cached
conversion), the Spider / ACLSum data shipped in packages, and tiny random models from conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from streamspec import StreamConfig, add_streams, load_default_tokenizer
from streamspec.data.build import PadCollator
from streamspec.training.recipe import Recipe, load_recipe, recipe_from_dict
from streamspec.training.trainer import (
    check_deepspeed_config,
    evaluation_counts,
    summarize_counts,
    training_arguments,
)

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
SMOLLM2 = ROOT / "recipes" / "smollm2-135m"
SQL = SMOLLM2 / "sql.yaml"
NEXT_TOKEN = SMOLLM2 / "sql_next_token.yaml"
ZERO2 = ROOT / "recipes" / "deepspeed" / "zero2.json"
ZERO3 = ROOT / "recipes" / "deepspeed" / "zero3.json"


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def _write_recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# 1. Shipped recipes
# ---------------------------------------------------------------------------------------------


def test_smollm2_recipes_are_shipped():
    names = {p.name for p in RECIPES if p.parent == SMOLLM2}
    assert {"sql.yaml", "sql_lossless.yaml", "sql_next_token.yaml", "summarize.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT)) for p in RECIPES])
def test_every_recipe_loads_and_names_its_own_command(path, monkeypatch):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("#"), f"{path}: the first line must be a comment with the command to run it"
    rel = path.relative_to(ROOT).as_posix()
    words = first.lstrip("#").split()
    assert "--recipe" in words, first
    assert words[words.index("--recipe") + 1] == rel, f"{path}: first line names another recipe: {first}"
    # The command runs a script that exists in the repository.
    scripts = [w for w in words if w.endswith(".py")]
    assert scripts and all((ROOT / s).is_file() for s in scripts), first
    # Shipped recipes stay consistent with what training accepts.
    assert recipe.data.has_validation
    assert recipe.training.output_dir.startswith("runs/")
    # Its DeepSpeed config (a path relative to the repository root) exists and suits the recipe.
    monkeypatch.chdir(ROOT)
    config = check_deepspeed_config(recipe)
    assert (config is None) == (recipe.training.deepspeed is None)


def test_shipped_recipe_contents():
    sql = load_recipe(SQL)
    assert sql.streams is not None and sql.streams.mode == "shared" and sql.lora.enabled
    assert sql.data.task == "sql" and sql.data.overflow == "drop"
    assert isinstance(sql.training.learning_rate, float) and sql.training.learning_rate == pytest.approx(5e-4)

    lossless = load_recipe(SMOLLM2 / "sql_lossless.yaml")
    assert lossless.streams is not None and lossless.streams.mode == "lossless"
    assert lossless.lora.enabled is False

    next_token = load_recipe(NEXT_TOKEN)
    assert next_token.streams is None and next_token.lora.enabled

    summarize = load_recipe(SMOLLM2 / "summarize.yaml")
    assert summarize.data.task == "summarize" and summarize.streams is not None

    # to_dict round-trips through recipe_from_dict (what run_training writes as recipe.yaml).
    for recipe in (sql, lossless, next_token, summarize):
        assert recipe_from_dict(recipe.to_dict()) == recipe


# ---------------------------------------------------------------------------------------------
# 2. Recipe errors and overrides
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("training.lr=1.0e-3", "training.lr"),
        ("lora.rank=8", "lora.rank"),
        ("training.batch_size=four", "training.batch_size"),
        ("lora.target_modules=5", "lora.target_modules"),
        ("lora.target_modules=[q_proj, 3]", "lora.target_modules"),
        ("streams.num_streams=1.5", "streams.num_streams"),
        ("lora.enabled=yes please", "lora.enabled"),
        ("data.max_length=1.0e3", "data.max_length"),
        ("data.overflow=cut", "data.overflow"),
        ("training.report_to=tensorboard", "training.report_to"),
        ("model.dtype=int8", "model.dtype"),
        ("data.path=rows.jsonl", "data.path"),
        ("optim.lr=1", "optim"),
        ("training=5", "section.key=value"),
        ("training.batch_size", "section.key=value"),
        ("batch_size=4", "section.key=value"),
    ],
)
def test_override_errors_name_the_key(override, key):
    with pytest.raises(ValueError) as err:
        load_recipe(SQL, [override])
    assert key in str(err.value)


def test_one_mixed_precision_at_a_time():
    with pytest.raises(ValueError, match="training.bf16 and training.fp16 are exclusive"):
        load_recipe(SQL, ["training.bf16=true", "training.fp16=true"])
    assert load_recipe(SQL, ["training.fp16=true"]).training.fp16


def test_unknown_section_in_file(tmp_path):
    path = _write_recipe(tmp_path, "optimizer:\n  lr: 0.1\n")
    with pytest.raises(ValueError, match="optimizer"):
        load_recipe(path)


def test_unknown_key_in_file(tmp_path):
    path = _write_recipe(tmp_path, "training:\n  lr: 0.1\n")
    with pytest.raises(ValueError, match=r"training\.lr"):
        load_recipe(path)


def test_wrong_types_in_file(tmp_path):
    path = _write_recipe(tmp_path, 'training:\n  batch_size: "four"\n')
    with pytest.raises(ValueError, match=r"training\.batch_size"):
        load_recipe(path)
    path = _write_recipe(tmp_path, "lora: 5\n")
    with pytest.raises(ValueError, match="lora"):
        load_recipe(path)
    path = _write_recipe(tmp_path, "- model\n- data\n")
    with pytest.raises(ValueError, match="mapping"):
        load_recipe(path)


def test_lossless_with_lora_is_refused():
    with pytest.raises(ValueError) as err:
        load_recipe(SQL, ["streams.mode=lossless"])
    assert "lossless" in str(err.value) and "lora.enabled" in str(err.value)
    # ... and is fine once LoRA is off.
    recipe = load_recipe(SQL, ["streams.mode=lossless", "lora.enabled=false"])
    assert recipe.streams.mode == "lossless" and not recipe.lora.enabled


def test_next_token_without_lora_is_refused(tmp_path):
    with pytest.raises(ValueError, match="lora.enabled"):
        load_recipe(NEXT_TOKEN, ["lora.enabled=false"])
    path = _write_recipe(tmp_path, "streams: null\nlora:\n  enabled: false\n")
    with pytest.raises(ValueError, match="lora.enabled"):
        load_recipe(path)


def test_data_path_needs_custom_task(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path"):
        load_recipe(SQL, [f"data.path={tmp_path / 'rows.jsonl'}"])
    with pytest.raises(ValueError, match=r"data\.dataset"):
        load_recipe(SQL, ["data.task=custom"])  # custom without a path or dataset
    recipe = load_recipe(SQL, ["data.task=custom", f"data.path={tmp_path / 'rows.jsonl'}"])
    assert recipe.data.task == "custom" and recipe.data.path == str(tmp_path / "rows.jsonl")
    assert recipe.data.has_validation is False


def test_data_path_takes_a_list_and_a_train_fraction(tmp_path):
    folders = [str(tmp_path / "set-a"), str(tmp_path / "set-b")]
    recipe = load_recipe(SQL, ["data.task=custom", f"data.path=[{folders[0]}, {folders[1]}]", "data.train_fraction=0.3"])
    assert recipe.data.path == folders and recipe.data.train_fraction == 0.3
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match=r"train_fraction must be in \(0, 1\]"):
            load_recipe(SQL, [f"data.train_fraction={bad}"])
    with pytest.raises(ValueError, match=r"data\.path must be str or a list of str"):
        load_recipe(SQL, ["data.task=custom", "data.path=[1, 2]"])


def test_a_train_fraction_is_nested_in_every_larger_one():
    from streamspec.training.build import fraction_indices

    shares = {f: fraction_indices(200, f) for f in (0.1, 0.3, 1.0)}
    assert [len(v) for v in shares.values()] == [20, 60, 200]
    assert set(shares[0.1]) < set(shares[0.3]) < set(shares[1.0]) == set(range(200))
    assert shares[0.3] == sorted(shares[0.3]) and shares[0.1] != list(range(20))  # in order, not the first rows
    assert fraction_indices(200, 0.1) == shares[0.1] and fraction_indices(3, 0.01) == [fraction_indices(3, 0.01)[0]]


def test_overrides_parse_yaml_values():
    recipe = load_recipe(
        SQL,
        [
            "training.learning_rate=2.5e-4",
            "training.batch_size=2",
            "lora.enabled=true",
            "lora.target_modules=[q_proj, v_proj]",
            "streams.stream_weights=[0.2, 0.1, 0.05]",
            "training.run_name=my run",
            "training.eval_steps=null",
            "data.max_train_examples=8",
        ],
    )
    assert recipe.training.learning_rate == 2.5e-4 and isinstance(recipe.training.learning_rate, float)
    assert recipe.training.batch_size == 2
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.streams.stream_weights == [0.2, 0.1, 0.05]
    assert recipe.training.run_name == "my run"
    assert recipe.training.eval_steps is None
    assert recipe.data.max_train_examples == 8
    # An override only touches its own key.
    assert recipe.training.eval_batch_size == load_recipe(SQL).training.eval_batch_size


def test_learning_rate_override_in_exponent_notation():
    """`training.learning_rate=1e-4` is the example the library's own error message gives."""
    recipe = load_recipe(SQL, ["training.learning_rate=1e-4"])
    assert isinstance(recipe.training.learning_rate, float)
    assert recipe.training.learning_rate == pytest.approx(1e-4)


def test_training_arguments_follow_the_recipe(tmp_path):
    recipe = load_recipe(SQL, [f"training.output_dir={tmp_path}", "training.report_to=none", "training.batch_size=3"])
    args = training_arguments(recipe)
    assert args.per_device_train_batch_size == 3
    assert args.learning_rate == pytest.approx(recipe.training.learning_rate)
    assert args.num_train_epochs == recipe.training.epochs
    assert args.report_to in ([], ["none"], "none")
    assert training_arguments(load_recipe(SQL, [f"training.output_dir={tmp_path}"])).report_to == ["wandb"]


# ---------------------------------------------------------------------------------------------
# 4. DeepSpeed configs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, stage", [(ZERO2, 2), (ZERO3, 3)])
def test_deepspeed_configs_are_valid(path, stage):
    config = json.loads(path.read_text())
    assert config["zero_optimization"]["stage"] == stage
    # Streamed recipes and the next-token baseline accept both.
    for recipe in (NEXT_TOKEN, SQL):
        assert check_deepspeed_config(load_recipe(recipe, [f"training.deepspeed={path}"])) == config


@pytest.mark.parametrize("path, stage", [(ZERO2, 2), (ZERO3, 3)])
def test_deepspeed_configs_parse_in_transformers(path, stage, tmp_path):
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        HfTrainerDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    recipe = load_recipe(NEXT_TOKEN, [f"training.output_dir={tmp_path}", "training.report_to=none"])
    args = training_arguments(recipe)  # without deepspeed: no global DeepSpeed state is made here
    try:
        ds = HfDeepSpeedConfig(str(path))
        assert ds.get_value("zero_optimization.stage") == stage
        assert ds.is_zero3() == (stage == 3)
        assert is_deepspeed_zero3_enabled() == (stage == 3)
        trainer_ds = HfTrainerDeepSpeedConfig(str(path))
        trainer_ds.trainer_config_process(args)
        assert trainer_ds.mismatches == []
        filled = trainer_ds.config
        assert filled["train_micro_batch_size_per_gpu"] == recipe.training.batch_size
        assert filled["gradient_accumulation_steps"] == recipe.training.gradient_accumulation_steps
        assert filled["gradient_clipping"] == recipe.training.max_grad_norm
        assert filled["bf16"]["enabled"] == recipe.training.bf16
    finally:
        unset_hf_deepspeed_config()  # the config registers itself globally: later models must not see ZeRO-3
    assert not is_deepspeed_zero3_enabled()


def test_zero3_takes_streamed_recipes_except_a_full_fine_tune():
    # LoRA (shared mode) and lossless streams train under ZeRO-3 (tests/training/test_training.py runs it).
    for name in ("sql.yaml", "sql_lossless.yaml", "sql_lossless_adapters.yaml", "summarize.yaml"):
        assert check_deepspeed_config(load_recipe(SMOLLM2 / name, [f"training.deepspeed={ZERO3}"])) is not None
    # A full fine-tune with streams saves merged checkpoints (the whole base) and uses the
    # base's norm and head with detached weights: ZeRO-2 only.
    full = load_recipe(SQL, [f"training.deepspeed={ZERO3}", "lora.enabled=false"])
    with pytest.raises(ValueError, match="ZeRO-3 trains streamed models with LoRA.*ZeRO-2"):
        check_deepspeed_config(full)
    assert check_deepspeed_config(load_recipe(SQL, [f"training.deepspeed={ZERO2}", "lora.enabled=false"])) is not None


def test_deepspeed_config_errors(tmp_path):
    assert check_deepspeed_config(load_recipe(SQL)) is None
    missing = load_recipe(SQL, [f"training.deepspeed={tmp_path / 'absent.json'}"])
    with pytest.raises(FileNotFoundError, match=r"training\.deepspeed.*absent\.json"):
        check_deepspeed_config(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="JSON"):
        check_deepspeed_config(load_recipe(SQL, [f"training.deepspeed={broken}"]))
    stage4 = tmp_path / "stage4.json"
    stage4.write_text(json.dumps({"zero_optimization": {"stage": 4}}), encoding="utf-8")
    with pytest.raises(ValueError, match="stage"):
        check_deepspeed_config(load_recipe(SQL, [f"training.deepspeed={stage4}"]))


# ---------------------------------------------------------------------------------------------
# 5. Validation counts
# ---------------------------------------------------------------------------------------------


def _batch():
    """Two right-padded rows (PadCollator) with a prompt (-100) and a completion."""
    gen = torch.Generator().manual_seed(7)
    examples = []
    for prompt_len, completion_len in ((5, 9), (7, 4)):
        ids = torch.randint(3, 101, (prompt_len + completion_len,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": [-100] * prompt_len + ids[prompt_len:]})
    return PadCollator(pad_id=0)(examples)


def _naive_counts(out, labels, num_streams):
    """Sums from the full logits of `forward(..., return_logits=True)`."""
    batch, length = labels.shape
    sums = {}

    def add(name, logits, targets):
        sums[f"{name}_loss_sum"] = F.cross_entropy(logits, targets, reduction="sum").item() if len(targets) else 0.0
        sums[f"{name}_correct"] = int((logits.argmax(-1) == targets).sum())
        sums[f"{name}_count"] = len(targets)

    for name, logits in (("main", out.logits), ("early_exit", out.early_exit_logits)):
        rows, targets = [], []
        for b in range(batch):
            for t in range(length - 1):
                if labels[b, t + 1] != -100:
                    rows.append(logits[b, t])
                    targets.append(int(labels[b, t + 1]))
        add(name, torch.stack(rows).float(), torch.tensor(targets))
    right = {}  # (b, t, j): stream j's top-1 at t is the token at t+1+j
    for j in range(1, num_streams + 1):
        rows, targets = [], []
        for b in range(batch):
            for t in range(length):
                if not out.stream_mask[b, t]:
                    continue
                assert not out.stream_logits[b, t, j - 1].isnan().any()
                if t + 1 + j < length and labels[b, t + 1 + j] != -100:
                    rows.append(out.stream_logits[b, t, j - 1])
                    targets.append(int(labels[b, t + 1 + j]))
                    right[b, t, j] = int(out.stream_logits[b, t, j - 1].argmax()) == targets[-1]
        add(f"stream_{j}", torch.stack(rows).float(), torch.tensor(targets))
    for j in range(2, num_streams + 1):
        slots = [(b, t) for b in range(batch) for t in range(length) if all((b, t, i) in right for i in range(1, j + 1))]
        sums[f"chain_{j}"] = (sum(all(right[b, t, i] for i in range(1, j + 1)) for b, t in slots), len(slots))
    return sums


def _streamed_model():
    model = add_streams(make_model("llama"), StreamConfig(stream_layers=2)).eval()
    with torch.no_grad():
        model.streams.stream_embeddings.normal_()
        model.streams.exit_up.weight.normal_(std=0.5)
    return model


def test_evaluate_counts_matches_naive_computation(single_thread):
    model = _streamed_model()
    batch = _batch()
    with torch.no_grad():
        out = model(batch["input_ids"], batch["attention_mask"], batch["labels"], return_logits=True)
    counts = model.evaluate_counts(batch["input_ids"], batch["attention_mask"], batch["labels"], chunk_size=5)
    naive = _naive_counts(out, batch["labels"], model.stream_config.num_streams)

    names = ["main", "stream_1", "stream_2", "stream_3", "early_exit"]
    assert set(counts) == {f"{n}_{k}" for n in names for k in ("loss_sum", "correct", "count")} | {
        f"chain_{j}_{k}" for j in (2, 3) for k in ("correct", "count")}
    for name in names:
        assert counts[f"{name}_count"] == naive[f"{name}_count"], name
        assert counts[f"{name}_correct"] == naive[f"{name}_correct"], name
        assert counts[f"{name}_loss_sum"] == pytest.approx(naive[f"{name}_loss_sum"], rel=1e-4), name
    for j in (2, 3):  # the chain: streams 1..j all right at one position, counted naively
        assert (counts[f"chain_{j}_correct"], counts[f"chain_{j}_count"]) == naive[f"chain_{j}"], j
        assert counts[f"chain_{j}_correct"] <= min(counts[f"stream_{i}_correct"] for i in range(1, j + 1))
    # The counts are what the layout implies: every completion token (9 + 4) is a main target
    # (the last prompt position predicts the first one); stream j loses the last j per row.
    assert counts["main_count"] == 9 + 4
    assert [counts[f"stream_{j}_count"] for j in (1, 2, 3)] == [counts["main_count"] - 2 * j for j in (1, 2, 3)]
    assert counts["early_exit_count"] == counts["main_count"]
    # The per-term means agree with the training loss parts.
    for name in names:
        assert counts[f"{name}_loss_sum"] / counts[f"{name}_count"] == pytest.approx(float(out.loss_parts[name]), rel=1e-4)
    # evaluation_counts dispatches to it for a streamed model.
    assert evaluation_counts(model, batch) == pytest.approx(counts, rel=1e-5)


def test_chain_counts_need_every_stream_up_to_j():
    """chain_j: of the positions where streams 1..j all have a target, those where all are right."""
    from streamspec.patch.forward import chain_counts

    mask = lambda *bits: torch.tensor([bits], dtype=torch.bool)  # noqa: E731
    streams = [(mask(1, 1, 0, 1, 1), mask(1, 1, 1, 1, 1)),   # stream 1: right, has a target
               (mask(1, 0, 1, 1, 1), mask(1, 1, 1, 1, 0)),
               (mask(0, 0, 1, 1, 0), mask(1, 1, 1, 0, 0))]
    assert chain_counts(streams) == {"chain_2_correct": 2, "chain_2_count": 4, "chain_3_correct": 0, "chain_3_count": 3}
    assert chain_counts(streams[:1]) == {} and chain_counts([]) == {}


def test_evaluation_counts_for_a_next_token_model(single_thread):
    model = make_model("llama")
    batch = _batch()
    counts = evaluation_counts(model, batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    rows = [(b, t) for b in range(labels.shape[0]) for t in range(labels.shape[1] - 1) if labels[b, t + 1] != -100]
    x = torch.stack([logits[b, t] for b, t in rows])
    y = torch.tensor([int(labels[b, t + 1]) for b, t in rows])
    assert set(counts) == {"main_loss_sum", "main_correct", "main_count"}
    assert counts["main_count"] == len(rows) == 13
    assert counts["main_correct"] == int((x.argmax(-1) == y).sum())
    assert counts["main_loss_sum"] == pytest.approx(F.cross_entropy(x, y, reduction="sum").item(), rel=1e-4)
    assert summarize_counts(counts) == {
        "main_loss": round(counts["main_loss_sum"] / 13, 4),
        "main_top1": round(counts["main_correct"] / 13, 4),
        "loss": round(counts["main_loss_sum"] / 13, 4),
    }


def test_summarize_counts():
    sums = {
        "main_loss_sum": 20.0, "main_correct": 5, "main_count": 10,
        "stream_1_loss_sum": 24.0, "stream_1_correct": 2, "stream_1_count": 8,
        "stream_2_loss_sum": 0.0, "stream_2_correct": 0, "stream_2_count": 0,
        "early_exit_loss_sum": 33.0, "early_exit_correct": 1, "early_exit_count": 10,
    }
    metrics = summarize_counts(sums)
    assert metrics == {
        "main_loss": 2.0, "main_top1": 0.5,
        "stream_1_loss": 3.0, "stream_1_top1": 0.25,
        "stream_2_loss": 0.0, "stream_2_top1": 0.0,
        "early_exit_loss": 3.3, "early_exit_top1": 0.1,
        "loss": 2.0,
    }


def test_summarize_real_counts(single_thread):
    model = _streamed_model()
    batch = _batch()
    counts = model.evaluate_counts(batch["input_ids"], batch["attention_mask"], batch["labels"])
    metrics = summarize_counts(counts)
    assert metrics["loss"] == metrics["main_loss"] == round(counts["main_loss_sum"] / counts["main_count"], 4)
    for term in ("main", "stream_1", "stream_2", "stream_3", "early_exit"):
        assert metrics[f"{term}_loss"] == round(counts[f"{term}_loss_sum"] / counts[f"{term}_count"], 4)
        assert metrics[f"{term}_top1"] == round(counts[f"{term}_correct"] / counts[f"{term}_count"], 4)
        assert 0.0 <= metrics[f"{term}_top1"] <= 1.0
    for term in ("chain_2", "chain_3"):  # no loss of their own
        assert metrics[f"{term}_top1"] == round(counts[f"{term}_correct"] / counts[f"{term}_count"], 4)
        assert f"{term}_loss" not in metrics


# ---------------------------------------------------------------------------------------------
# 6. The SLURM template
# ---------------------------------------------------------------------------------------------

SBATCH = ROOT / "recipes" / "llama-3.1-8b" / "slurm.sbatch"


def _run_sbatch(tmp_path, *args):
    """The template run by bash as sbatch would, with stand-ins for srun (runs its command),
    scontrol (two nodes) and torchrun (records its arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_ins = {
        "srun": 'while [[ "$1" == --* ]]; do shift; done\nexec "$@"',
        "scontrol": 'echo node-a\necho node-b',
        "torchrun": f'printf "%s\\n" "$@" > {tmp_path / "torchrun.args"}',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "8"}
    (tmp_path / "torchrun.args").unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(SBATCH), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    recorded = tmp_path / "torchrun.args"
    return proc, recorded.read_text().splitlines() if recorded.is_file() else None


def test_slurm_template_launches_torchrun_on_every_node_and_resumes_on_requeue(tmp_path):
    out = tmp_path / "run"
    recipe = "recipes/llama-3.1-8b/sql_zero2.yaml"
    proc, args = _run_sbatch(tmp_path, recipe, f"training.output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert args[:10] == ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv_id", "4242", "--rdzv_backend", "c10d",
                         "--rdzv_endpoint", "node-a:29500"]
    assert args[10:] == ["train/finetune.py", "--recipe", recipe, f"training.output_dir={out}"]
    assert all((ROOT / a).is_file() for a in args if a.endswith((".py", ".yaml")))

    (out / "checkpoint-10").mkdir(parents=True)  # cut short while saving: not complete
    assert _run_sbatch(tmp_path, recipe, f"training.output_dir={out}")[1][-1] != "--resume"
    (out / "checkpoint-10" / "trainer_state.json").write_text("{}")
    proc, args = _run_sbatch(tmp_path, recipe, f"training.output_dir={out}")  # the requeued job
    assert args[-1] == "--resume" and "resuming from the latest checkpoint" in proc.stdout

    proc, args = _run_sbatch(tmp_path)
    assert proc.returncode == 2 and "usage" in proc.stderr and args is None
    proc, args = _run_sbatch(tmp_path, recipe, "training.no_such_key=1")  # a recipe error stops the job
    assert proc.returncode != 0 and "no_such_key" in proc.stderr and args is None
