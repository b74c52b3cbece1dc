"""The training pipeline end to end, on a tiny Llama with the real SmolLM2 tokenizer and real
Spider data: a run exports a loadable streamed checkpoint, metrics reach wandb's run files, a
killed run resumes onto the same loss curve, and 2-process DeepSpeed ZeRO-2 works on CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from streamspec import load_streamed
from streamspec.training.recipe import load_recipe
from streamspec.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2-135m" / "sql.yaml"


def _overrides(tiny_dir, out, **extra):
    values = {
        "model.name_or_path": str(tiny_dir),
        "training.output_dir": str(out),
        "training.max_steps": 6,
        "training.save_steps": 2,
        "training.logging_steps": 1,
        "training.eval_steps": 3,
        "training.batch_size": 2,
        "training.learning_rate": 1e-3,
        "data.max_train_examples": 16,
        "data.max_validation_examples": 4,
        "data.max_length": 512,
        "lora.r": 4,
        "training.report_to": "none",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def _cli(args, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "DS_ACCELERATOR": "cpu"}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def _losses(state_file):
    history = json.loads(Path(state_file).read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def test_run_exports_checkpoint_and_logs_to_wandb(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "run", **{"training.report_to": "wandb"}))
    summary = run_training(recipe)

    assert summary["steps"] == 6
    assert summary["peak_gpu_memory_mib"] is None and summary["peak_rss_mib"] > 0  # on CUDA: the largest GPU's peak
    assert set(summary["final_losses"]) >= {"loss", "loss_main", "loss_stream_1", "loss_stream_3", "loss_early_exit"}
    assert summary["validation"] and "eval_stream_3_top1" in summary["validation"][-1]
    on_disk = json.loads((tmp_path / "run" / "training_summary.json").read_text())
    assert on_disk["steps"] == 6 and on_disk["export"] == summary["export"]

    # The export is a streamed checkpoint with the trained LoRA and streams.
    model = load_streamed(summary["export"])
    assert model.has_lora and model.stream_config == recipe.streams
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "LoRA B starts at zero: training must have moved it"

    # Logged metrics reach the wandb run file (protobuf records hold the metric names verbatim).
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    for name in (b"loss_stream_1", b"loss_early_exit", b"tokens_per_second", b"eval_stream_2_top1", b"learning_rate"):
        assert name in data, name


def test_killed_run_resumes_on_the_same_curve(tiny_dir, tmp_path):
    straight = tmp_path / "straight"
    killed = tmp_path / "killed"
    cmd = [sys.executable, "train/finetune.py", "--recipe", str(RECIPE)]
    proc = _cli(cmd + _overrides(tiny_dir, straight, **{"training.max_steps": 8}))
    assert proc.wait(timeout=300) == 0, proc.stdout.read()

    proc = _cli(cmd + _overrides(tiny_dir, killed, **{"training.max_steps": 8}), start_new_session=True)
    deadline = time.time() + 300
    while not (killed / "checkpoint-4" / "trainer_state.json").is_file():
        assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists(), "the run was meant to die before finishing"

    resumed = _cli(cmd + _overrides(tiny_dir, killed, **{"training.max_steps": 8}) + ["--resume"])
    output = resumed.stdout.read()
    assert resumed.wait(timeout=300) == 0, output
    assert "resuming from" in output

    expected = _losses(straight / "checkpoint-8" / "trainer_state.json")
    got = _losses(killed / "checkpoint-8" / "trainer_state.json")
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-5), (step, got, expected)
    # the tokens trained on count the killed call's steps once: the checkpoint carries the count
    summaries = [json.loads((run / "training_summary.json").read_text()) for run in (straight, killed)]
    assert summaries[0]["tokens_seen"] > 0 and summaries[1]["tokens_seen"] == summaries[0]["tokens_seen"]
    # the resumed call times its own steps, those after checkpoint-4 (or later, were it saved later)
    resumed_from = int(re.search(r"resuming from \S*checkpoint-(\d+)", output).group(1))
    assert summaries[0]["steps_run"] == summaries[0]["steps"] == 8
    assert summaries[1]["steps"] == 8 and summaries[1]["steps_run"] == 8 - resumed_from
    if resumed_from < 8:
        assert summaries[1]["seconds_per_step"] == pytest.approx(summaries[1]["wall_seconds"] / (8 - resumed_from), abs=0.05)


def test_export_command_merges_into_a_self_contained_folder(tiny_dir, tmp_path):
    run = tmp_path / "run"
    summary = run_training(load_recipe(RECIPE, _overrides(tiny_dir, run, **{"training.max_steps": 2})))
    proc = _cli([sys.executable, "-m", "streamspec.cli", "export", "--checkpoint", str(run / "checkpoint-2"),
                 "--out", str(tmp_path / "merged"), "--merge"])
    output = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, output
    merged = load_streamed(tmp_path / "merged")  # needs nothing else
    trained = load_streamed(summary["export"])
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        a, b = merged(ids), trained(ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.stream_logits, b.stream_logits, rtol=1e-4, atol=1e-4)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _short_sql_rows(folder: Path) -> dict[str, str]:
    """Real Spider questions and queries without their schemas: short rows, quick steps."""
    from streamspec.data import load_spider

    paths = {}
    for split, name, count in (("train", "data.path", 16), ("validation", "data.validation_path", 4)):
        path = folder / f"{split}.jsonl"
        rows = load_spider(split)[:count]
        path.write_text("".join(json.dumps({"prompt": r["question"], "completion": r["query"]}) + "\n" for r in rows))
        paths[name] = str(path)
    return paths


def _deepspeed_run(out, stage, data, resume=False, steps=4):
    overrides = [
        f"training.output_dir={out}", f"training.max_steps={steps}", "training.save_steps=2", "training.eval_steps=4",
        "training.logging_steps=1", "training.batch_size=1", "training.learning_rate=1e-3", "training.warmup_ratio=0",
        "training.report_to=none", f"training.deepspeed={ROOT / 'recipes' / 'deepspeed' / f'zero{stage}.json'}",
        "data.task=custom", "data.max_length=128", "lora.r=4", *(f"{k}={v}" for k, v in data.items()),
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "train/finetune.py", "--recipe", str(RECIPE), *overrides, *(["--resume"] if resume else [])]
    proc = _cli(cmd)
    output = proc.stdout.read()
    assert proc.wait(timeout=600) == 0, output[-5000:]
    return output


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_two_processes_train_and_resume_smollm2(stage, tmp_path):
    """SmolLM2-135M with streams and LoRA under DeepSpeed ZeRO-2 / ZeRO-3, 2 CPU processes (gloo):
    checkpoints hold the trainable weights and their optimizer state, not the frozen base; the export
    loads strictly and holds exactly DeepSpeed's float32 master weights; a checkpoint of other
    trainable weights is refused. Under ZeRO-3 (the base loaded partitioned, its checkpoints the
    harder case) a run resumed from a checkpoint continues at its step on the uninterrupted run's
    losses; ZeRO-2 trains two steps and is checked on the state they leave (each launch of two
    processes costs most of a minute on two cores)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from streamspec.assets import default_model_path
    from streamspec.patch.checkpoint import CheckpointError
    from streamspec.training.trainer import build_model
    from streamspec.patch.checkpoint import check_trainable_checkpoint

    data = _short_sql_rows(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    output = _deepspeed_run(straight, stage, data, steps=4 if stage == 3 else 2)
    if stage == 3:
        assert "ZeRO-3: the base is loaded partitioned" in output

    # (a) Trainable weights and optimizer state only: a small fraction of the base's weights.
    checkpoint = straight / "checkpoint-2"
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    base_size = (Path(default_model_path()) / "model.safetensors").stat().st_size
    assert size < base_size / 20, (size, base_size)

    # Resume refuses a checkpoint whose weights are not exactly the model's trainable ones.
    other, _ = build_model(load_recipe(RECIPE, ["lora.r=8"]))
    with pytest.raises(CheckpointError, match="mis-shaped"):
        check_trainable_checkpoint(other, checkpoint)

    if stage == 2:  # the export: exactly DeepSpeed's float32 masters of the last step
        masters = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
        exported = load_streamed(straight / "final").state_dict()
        assert set(masters) == {n for n, p in load_streamed(straight / "final").named_parameters()
                                if "lora_" in n or n.startswith("streams.")}
        for name, value in masters.items():
            assert torch.equal(exported[name], value), name
        assert json.loads((straight / "training_summary.json").read_text())["steps"] == 2
        return

    # (b) Resume from a copy of checkpoint-2 (as after a preemption): steps 3 and 4 and the
    # validation at step 4 are those of the uninterrupted run.
    shutil.copytree(checkpoint, resumed / "checkpoint-2")
    output = _deepspeed_run(resumed, stage, data, resume=True)
    assert "resuming from" in output
    expected = json.loads((straight / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    got = json.loads((resumed / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    for key in ("loss", "eval_loss", "eval_stream_3_top1"):
        a = {h["step"]: h[key] for h in expected if key in h}
        b = {h["step"]: h[key] for h in got if key in h}
        assert a and a == pytest.approx(b, rel=1e-5), (key, a, b)
    assert 4 in {h["step"] for h in got if "eval_loss" in h}

    # (c) The export loads with streamspec's strict loading, is the same for both runs, and holds
    # exactly the float32 masters DeepSpeed trained (the trainable weights, nothing else).
    masters = get_fp32_state_dict_from_zero_checkpoint(str(resumed / "checkpoint-4"))
    exported = load_streamed(resumed / "final").state_dict()
    uninterrupted = load_streamed(straight / "final").state_dict()
    trainable = {n for n, p in load_streamed(resumed / "final").named_parameters() if "lora_" in n or n.startswith("streams.")}
    assert set(masters) == trainable
    for name, value in masters.items():
        assert torch.equal(exported[name], value), name
        torch.testing.assert_close(uninterrupted[name], value, rtol=1e-5, atol=1e-7)
    assert json.loads((resumed / "training_summary.json").read_text())["steps"] == 4


def test_a_time_budget_stops_after_the_step_that_crosses_it_and_still_exports(tiny_dir, tmp_path):
    """training.max_minutes: a budget spent by the first step stops the run there, saved and
    exported as at the end of a run; the summary says the time stopped it."""
    from streamspec.training.trainer import load_training_checkpoint, build_model

    recipe = load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "run", **{"training.max_minutes": 1e-6,
                                                                             "training.save_steps": 100}))
    summary = run_training(recipe)
    assert summary["steps"] == 1 and summary["stopped_by_time"]
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert (checkpoint / "trainer_state.json").is_file()  # saved where it stopped: --resume goes on from here
    exported = load_streamed(summary["export"]).state_dict()
    fresh, _ = build_model(recipe)
    load_training_checkpoint(fresh, checkpoint)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, exported[name]), name
    with pytest.raises(ValueError, match="training.max_minutes must be > 0 or null"):
        load_recipe(RECIPE, ["training.max_minutes=0"])


def test_gradient_checkpointing_gives_the_same_gradients():
    from peft import LoraConfig

    from conftest import make_model
    from streamspec import StreamConfig, add_streams

    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = add_streams(make_model("llama"), StreamConfig(stream_layers=2))
        model.add_lora(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        if checkpointing:
            model.hf_model.gradient_checkpointing_enable()
        model.train()
        ids = torch.randint(3, 101, (2, 9))
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and any("lora_A" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6)


def test_full_fine_tune_checkpoints_carry_the_base_and_reload_strictly(tiny_dir, tmp_path):
    from streamspec.training.trainer import build_model, load_training_checkpoint

    recipe = load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "full", **{"training.max_steps": 2, "lora.enabled": "false"}))
    summary = run_training(recipe)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file(), "a full fine-tune must save the base weights"
    fresh, _ = build_model(recipe)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    load_training_checkpoint(fresh, checkpoint)
    trained = load_streamed(summary["export"])
    changed = 0
    for name, param in fresh.named_parameters():
        assert torch.equal(param, trained.state_dict()[name]), name
        changed += not torch.equal(param, before[name])
    assert changed > 10, "the reload must replace the freshly initialised weights"


def test_top_modules_adapt_the_mlp_of_the_stream_layers_only(tiny_dir, tmp_path):
    """lora.top_modules puts LoRA on the MLP projections of the top Ns layers only (attention in
    every layer), for the streamed model and for the next-token baseline alike; the checkpoint
    round-trips through the regex target."""
    from streamspec.training.trainer import build_model

    overrides = _overrides(tiny_dir, tmp_path / "run", **{
        "lora.top_modules": "[gate_proj, up_proj, down_proj]", "streams.stream_layers": 2,
    })
    model, _ = build_model(load_recipe(RECIPE, overrides))
    adapted = {name.rsplit(".lora_A", 1)[0].split("layers.")[1] for name, _ in model.named_parameters() if ".lora_A" in name}
    mlp = {name for name in adapted if ".mlp." in name}
    assert mlp == {f"{i}.mlp.{m}" for i in (2, 3) for m in ("gate_proj", "up_proj", "down_proj")}
    assert {name for name in adapted if ".self_attn." in name} == {
        f"{i}.self_attn.{m}" for i in range(4) for m in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    next_token = load_recipe(ROOT / "recipes" / "smollm2-135m" / "sql_next_token.yaml", [
        f"model.name_or_path={tiny_dir}", "lora.top_modules=[gate_proj]", "lora.top_layers=1",
    ])
    baseline, _ = build_model(next_token)
    assert {n.split("layers.")[1].split(".lora_A")[0] for n, _ in baseline.named_parameters()
            if ".lora_A" in n and ".mlp." in n} == {"3.mlp.gate_proj"}

    summary = run_training(load_recipe(RECIPE, overrides + ["training.max_steps=2"]))
    reloaded = load_streamed(summary["export"])
    ids = torch.randint(0, 1000, (1, 12))
    trained_state = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    assert any(".mlp." in k for k in trained_state)
    with torch.no_grad():
        merged = load_streamed(summary["export"], merge_lora=True)
        assert not merged.has_lora
        torch.testing.assert_close(merged(ids).logits, reloaded(ids).logits, atol=1e-4, rtol=1e-4)


def test_top_modules_errors():
    from streamspec.training.recipe import LoraArgs

    with pytest.raises(ValueError, match="already in lora.target_modules"):
        LoraArgs(top_modules=["q_proj"])
    with pytest.raises(ValueError, match="needs lora.top_layers"):
        LoraArgs(top_modules=["gate_proj"]).peft_targets(4, "layers", None)
    with pytest.raises(ValueError, match="has 4 layers"):
        LoraArgs(top_modules=["gate_proj"], top_layers=5).peft_targets(4, "layers", None)


def test_stream_learning_rate_gets_its_own_group_and_follows_the_schedule(tiny_dir, tmp_path):
    from streamspec.training.trainer import StreamTrainer, build_model, training_arguments

    recipe = load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "run", **{"training.stream_learning_rate": 0.02}))
    model, _ = build_model(recipe)
    args = training_arguments(recipe)
    args.eval_strategy = "no"
    trainer = StreamTrainer(model=model, args=args, stream_learning_rate=0.02)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    groups = trainer.optimizer.param_groups
    stream_group = [g for g in groups if any(p is model.streams.stream_embeddings for p in g["params"])]
    assert len(stream_group) == 1 and stream_group[0]["initial_lr"] == 0.02
    assert stream_group[0]["params"] == [model.streams.stream_embeddings]
    assert all(p is not model.streams.exit_up.weight for p in stream_group[0]["params"])
    trained = {id(p) for g in groups for p in g["params"]}
    assert trained == {id(p) for p in model.parameters() if p.requires_grad}  # nothing lost, nothing twice
    assert sum(len(g["params"]) for g in groups) == len(trained)
    trainer.lr_scheduler.step()
    others = [g for g in groups if g is not stream_group[0] and g["params"]]
    assert stream_group[0]["lr"] / others[0]["lr"] == pytest.approx(0.02 / recipe.training.learning_rate)
    with pytest.raises(ValueError, match="stream_learning_rate"):
        load_recipe(RECIPE, ["training.stream_learning_rate=0"])


@pytest.mark.parametrize("dtype, precision", [("bfloat16", "bf16"), ("float16", "fp16")])
def test_reduced_precision_base_trains_float32_master_weights(tiny_dir, tmp_path, dtype, precision):
    """A bfloat16 (float16) base trains stream parameters, stream adapters and LoRA kept in
    float32: a step with a learning rate far below the reduced dtype's rounding step of those
    weights still moves them (AdamW's first step moves each weight with a gradient by about the
    learning rate). fp16 runs with the Trainer's loss scaling."""
    from transformers import set_seed

    from streamspec.training.trainer import build_model

    lr, reduced = 1e-6, getattr(torch, dtype)
    recipe = load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "run", **{
        "model.dtype": dtype, f"training.{precision}": "true", "training.max_steps": 1, "training.learning_rate": lr,
        "streams.stream_adapter_rank": 4, "training.max_grad_norm": 0.0, "training.warmup_ratio": 0.0,
    }))
    set_seed(recipe.training.seed)  # as run_training does: the same initial weights
    model, _ = build_model(recipe)
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any(".adapters." in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {reduced}
    with torch.no_grad():  # the forward pass runs in the base's dtype
        out = model(torch.randint(0, 1000, (1, 8)))
    assert out.logits.dtype == out.stream_logits.dtype == reduced

    summary = run_training(recipe)
    assert summary["steps"] == 1 and torch.isfinite(torch.tensor(summary["train_loss"]))
    trained = load_streamed(summary["export"]).state_dict()
    for name, before in trainable.items():
        after = trained[name]
        assert after.dtype == torch.float32, name
        delta = after - before
        assert delta.abs().max() <= lr * 1.1, name  # a tiny step: Adam moves by at most ~lr (+ float32 rounding)
    # Every P_j entry has a gradient and sits far from 0 (std 0.3), where the reduced dtype's
    # rounding step is 1e-4..1e-3: a master weight in that dtype would have rounded this update away.
    before = trainable["streams.stream_embeddings"]
    delta = trained["streams.stream_embeddings"] - before
    lost_in_reduced = (before.to(reduced) + delta.to(reduced)) == before.to(reduced)
    assert (delta != 0).all() and lost_in_reduced.float().mean() > 0.9
    # (LoRA B and the adapters' up-projections start at 0, where a step of lr survives in either dtype.)
    assert all((trained[n] != trainable[n]).any() for n in trainable if "lora_B" in n or n.endswith("up.weight"))


def test_init_from_starts_a_run_from_trained_streams_and_refuses_a_mismatch(tiny_dir, tmp_path, single_thread):
    """``training.init_from`` loads a finished run's streams and LoRA before the first step (with a
    vanishing learning rate the new run ends where the old one did, not at a fresh init), and a
    checkpoint of another stream config or another base is refused before anything trains."""
    from streamspec.patch.saving import CheckpointError
    from streamspec.training.trainer import build_model

    first = run_training(load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "first", **{"training.max_steps": 3})))
    trained = load_streamed(first["export"]).state_dict()

    def run(out, **extra):
        values = {"training.max_steps": 1, "training.learning_rate": 1e-12, "training.stream_learning_rate": 1e-12,
                  "training.init_from": first["export"], **extra}
        return load_streamed(run_training(load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / out, **values)))["export"])

    started = run("started").state_dict()
    fresh = run("fresh", **{"training.init_from": "null"}).state_dict()
    moved = [k for k in trained if k.startswith("streams.") or "lora_B" in k]
    assert moved, "the run must have stream and LoRA weights to carry over"
    for key in moved:
        torch.testing.assert_close(started[key].float(), trained[key].float(), atol=1e-6, rtol=0)
    assert any(not torch.allclose(fresh[k].float(), trained[k].float(), atol=1e-4) for k in moved), \
        "without init_from the streams start fresh: this test must be able to tell the two apart"

    other_streams = load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "x", **{"streams.num_streams": 2,
                                                                                    "training.init_from": first["export"]}))
    with pytest.raises(ValueError, match="another stream config"):
        run_training(other_streams)

    other_base = tmp_path / "other-base"
    shutil.copytree(tiny_dir, other_base)
    model, _ = build_model(load_recipe(RECIPE, _overrides(other_base, tmp_path / "y")))
    with torch.no_grad():
        model.hf_model.get_input_embeddings().weight.mul_(1.5)
    model.hf_model.save_pretrained(other_base)
    with pytest.raises(CheckpointError, match="fingerprint"):
        run_training(load_recipe(RECIPE, _overrides(other_base, tmp_path / "z", **{"training.init_from": first["export"]})))
    assert not (tmp_path / "z" / "final").exists()

    with pytest.raises(FileNotFoundError, match="init_from"):
        run_training(load_recipe(RECIPE, _overrides(tiny_dir, tmp_path / "w", **{"training.init_from": str(tmp_path / "nowhere")})))
