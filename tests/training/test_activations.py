"""Offline training (`data.cache_activations`): what the frozen base computes is stored once and
the streams (or Medusa heads) train from the store with the same losses and gradients as the
online path, on tiny random models of every architecture; a store built for another base or
other examples is refused, a killed build resumes, and a recipe trains end to end offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from conftest import ARCHS, make_model
from streamspec import StreamConfig, add_streams
from streamspec.data.build import PadCollator
from streamspec.patch.medusa import MedusaConfig, add_medusa_heads
from streamspec.training.activations import (
    INDEX_COLUMN,
    SHARD_SIZE,
    STORE_FILE,
    ActivationCollator,
    build_activation_store,
    compute_activations,
    length_batches,
    needed_positions,
    open_activation_store,
    with_activation_index,
)
from streamspec.training.recipe import load_recipe, recipe_from_dict
from streamspec.training.trainer import LENGTH_COLUMN, evaluation_counts, run_training, training_arguments, with_lengths

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("single_thread")


def _examples(count: int, seed: int, vocab: int = 96) -> list[dict]:
    """Rows of different lengths, a prompt (no labels) then a completion."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        prompt, completion = int(torch.randint(3, 9, (1,), generator=gen)), int(torch.randint(2, 8, (1,), generator=gen))
        ids = torch.randint(0, vocab, (prompt + completion,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def _sharp(model):
    """A random model whose attention is peaked (queries and keys scaled up): with the usual
    N(0, 0.02) init the softmax is near uniform and a wrong key would go unseen."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(k in name for k in ("q_proj", "k_proj", "c_attn")):
                p.mul_(8)
    return model


def _streamed(arch: str, **config):
    settings = dict(num_streams=3, stream_layers=2, mode="lossless", main_weight=0.3, stream_targets="main",
                    stream_adapter_rank=4)
    settings.update(config)
    model = add_streams(_sharp(make_model(arch)), StreamConfig(**settings))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking stream weights (the adapters' up projection starts at zero)
        for p in model.streams.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _offline_batch(model, rows):
    """The collated batch with its activations, as offline training sees it (no store on disk)."""
    batch = PadCollator(0)(rows)
    stored = compute_activations(model, **batch)

    class Store:
        folder = "memory"

        def __getitem__(self, i):
            return stored[i]

    collator = ActivationCollator(0, Store())
    return collator(with_activation_index(rows))


class _base_never_runs_below:
    """Offline, the embeddings and lower layers must not run (their output is stored)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        def refuse(*args, **kwargs):
            raise AssertionError("the lower layers ran offline")

        self.handles = [m.register_forward_pre_hook(refuse) for m in self.model.layers[: self.model.num_lower_layers]]
        self.handles.append(self.model.hf_model.get_input_embeddings().register_forward_pre_hook(refuse))

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class _main_rows_with_streams:
    """The reference path of lossless streams: main and stream rows through the MSA layers
    together (`run_upper`), instead of the main stream apart (`frozen_main`). Medusa heads have
    one path: nothing changes."""

    def __init__(self, model):
        self.model = model if hasattr(model, "main_apart") else None

    def __enter__(self):
        if self.model is not None:
            self.model.main_apart = False

    def __exit__(self, *exc):
        if self.model is not None:
            del self.model.main_apart
            assert self.model.runs_main_apart()


class _main_rows_apart:
    """Lossless streams train and validate with the main stream computed apart: `run_upper` (main
    and stream rows together) must not run."""

    def __init__(self, model):
        self.model = model if hasattr(model, "main_apart") else None

    def __enter__(self):
        def refuse(*args, **kwargs):
            raise AssertionError("run_upper ran: the main rows went through the MSA layers with the streams")

        if self.model is not None:
            self.model.run_upper = refuse

    def __exit__(self, *exc):
        if self.model is not None:
            del self.model.run_upper


def _trainable_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, _trainable_grads(model)


def _assert_offline_equals_online(model, rows, tol: float) -> None:
    """Loss (and its parts), gradients of every trainable weight and validation counts of the
    offline path and of the online one (for lossless streams: the main stream computed apart,
    `frozen_main`) equal the reference's on the same batch (main and stream rows through the MSA
    layers together); offline, the lower layers never run."""
    batch = _offline_batch(model, rows)
    plain = {k: v for k, v in batch.items() if k != "activations"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with _main_rows_with_streams(model):
        reference, reference_grads = _loss_and_grads(model, **plain)
        reference_counts = evaluation_counts(model, plain)
    reference_grads = {n: g for n, g in reference_grads.items() if n in trainable}
    with _main_rows_apart(model):
        online, online_grads = _loss_and_grads(model, **plain)
        online_counts = evaluation_counts(model, plain)
    with _base_never_runs_below(model):
        offline, offline_grads = _loss_and_grads(model, **batch)
    for run, grads, counts in ((online, online_grads, online_counts),
                               (offline, offline_grads, evaluation_counts(model, batch))):
        assert set(run.loss_parts) == set(reference.loss_parts)
        for name, value in reference.loss_parts.items():
            assert torch.allclose(run.loss_parts[name], value, atol=tol, rtol=tol), name
        assert torch.allclose(run.loss, reference.loss, atol=tol, rtol=tol)
        assert set(grads) == set(reference_grads) and reference_grads
        for name, grad in reference_grads.items():
            assert torch.allclose(grads[name], grad, atol=tol, rtol=10 * tol), name
        assert set(counts) == set(reference_counts)
        for key, value in reference_counts.items():
            assert counts[key] == pytest.approx(value, rel=1e-5, abs=1e-4), key
    assert not any(p.requires_grad for p in model.base.parameters())  # the base never trains


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", [dict(), dict(stream_targets="labels", stream_adapter_rank=None),
                                    dict(stream_init="value_rotation", stream_adapter_rank=None),
                                    dict(next_token_input=True)],
                         ids=["adapters-main-targets", "labels-targets", "value-rotation", "next-token-input"])
def test_offline_streams_give_the_online_losses_and_gradients(arch, config):
    _assert_offline_equals_online(_streamed(arch, **config), _examples(5, seed=3), tol=1e-5)


def _left_padded(batch: dict) -> dict:
    """The same rows with their padding moved to the front."""
    out = {k: v.clone() for k, v in batch.items()}
    for b, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        for key in out:
            out[key][b] = batch[key][b].roll(batch[key].shape[1] - n)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_main_stream_apart_is_masked_only_where_the_causal_rule_is_not_enough(arch):
    """Right-padded rows under sdpa need no mask in the main stream (the kernels' causal rule);
    left-padded rows, and eager attention, keep theirs; every way gives the reference's losses."""
    rows = _examples(4, seed=7)
    right = PadCollator(0)(rows)
    left = _left_padded(right)
    model = _streamed(arch)
    assert model.causal_alone(right["attention_mask"].bool())
    assert not model.causal_alone(left["attention_mask"].bool())
    for batch in (right, left):
        with _main_rows_with_streams(model):
            reference = model(**batch).loss_parts
        with _main_rows_apart(model):
            parts = model(**batch).loss_parts
        for name, value in reference.items():
            assert torch.allclose(parts[name], value, atol=1e-5, rtol=1e-5), name
    torch.manual_seed(0)
    eager = add_streams(make_model(arch, attn_implementation="eager"), StreamConfig(mode="lossless", stream_layers=2))
    assert not eager.causal_alone(right["attention_mask"].bool())


@pytest.mark.parametrize("arch", ARCHS)
def test_offline_medusa_heads_give_the_online_losses_and_gradients(arch):
    model = add_medusa_heads(_sharp(make_model(arch)), MedusaConfig(num_heads=3))
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    _assert_offline_equals_online(model, _examples(4, seed=5), tol=1e-6)


def test_stored_rows_are_only_those_a_loss_reads():
    labels = torch.tensor([-100, -100, -100, 5, 6, 7, -100])
    assert needed_positions(labels, 0).tolist() == [False, False, True, True, True, False, False]
    # Medusa head k at t learns the token at t+1+k: with 2 heads, two more prompt positions
    assert needed_positions(labels, 2).tolist() == [True, True, True, True, True, False, False]


def test_shared_mode_and_wrong_activations_are_refused():
    shared = add_streams(make_model("llama"), StreamConfig(num_streams=2, stream_layers=1, mode="shared"))
    rows = _examples(2, seed=0)
    with pytest.raises(ValueError, match="lossless"):
        build_activation_store(shared, rows, path="unused")
    model = _streamed("llama")
    batch = _offline_batch(model, rows)
    bad = dict(batch["activations"], keys=batch["activations"]["keys"][:, :1])
    with pytest.raises(ValueError, match="keys"):
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
              activations=bad)
    with pytest.raises(ValueError, match="lack"):
        model(input_ids=batch["input_ids"], labels=batch["labels"], activations={"hidden": bad["hidden"]})
    model.train().hf_model.gradient_checkpointing_enable()  # a checkpointed layer would drop the stored keys
    with pytest.raises(ValueError, match="gradient checkpointing off"):
        model(**batch)
    assert not model.runs_main_apart()  # online, the main and stream rows then run together
    model(**{k: v for k, v in batch.items() if k != "activations"}).loss.backward()


def test_length_batches_hold_every_row_once_longest_first():
    rows = _examples(21, seed=3)
    batches = length_batches(rows, 4)
    assert sorted(i for b in batches for i in b) == list(range(21)) and [len(b) for b in batches] == [4] * 5 + [1]
    lengths = [len(rows[i]["input_ids"]) for b in batches for i in b]
    assert lengths == sorted(lengths, reverse=True)


def test_store_round_trip_refusals_and_resume(tmp_path):
    model = _streamed("qwen2")
    rows = _examples(SHARD_SIZE + 5, seed=7)  # two shards
    folder = tmp_path / "store"
    store = build_activation_store(model, rows, path=folder, batch_size=8, progress=False)
    assert len(store) == len(rows) and store.bytes() > 0
    meta = json.loads((folder / STORE_FILE).read_text())
    assert meta["complete"] and meta["settings"]["examples"] == len(rows) and meta["command"]
    # rows run in batches of near length, each stored under its own index: every row holds what
    # it computes alone
    for index, row in enumerate(rows):
        expected = compute_activations(model, **PadCollator(0)([row]))[0]
        assert set(store[index]) == set(expected)
        for key, value in expected.items():
            assert torch.equal(store[index]["input_ids"], value) if key == "input_ids" else \
                torch.allclose(store[index][key].to(value.dtype), value, atol=1e-5), (index, key)

    # refused: another base of the same shape, other examples
    with pytest.raises(ValueError, match="weights_sha256"):
        open_activation_store(folder, add_streams(make_model("qwen2", seed=1), model.stream_config), rows)
    with pytest.raises(ValueError, match="examples"):
        open_activation_store(folder, model, rows[:-1])
    with pytest.raises(ValueError, match="other settings"):
        build_activation_store(model, rows[1:], path=folder, progress=False)

    # a killed build: the second shard missing, the first kept as it was
    (folder / "shard-00001.safetensors").unlink()
    meta["complete"] = False
    (folder / STORE_FILE).write_text(json.dumps(meta))
    first = (folder / "shard-00000.safetensors").stat().st_mtime_ns
    with pytest.raises(ValueError, match="incomplete"):
        open_activation_store(folder, model, rows)
    again = build_activation_store(model, rows, path=folder, batch_size=8, progress=False)
    assert (folder / "shard-00000.safetensors").stat().st_mtime_ns == first
    assert torch.equal(again[SHARD_SIZE + 2]["hidden"], store[SHARD_SIZE + 2]["hidden"])

    # a row whose text is not the stored one is refused by the collator
    collator = ActivationCollator(0, open_activation_store(folder, model, rows))
    wrong = {**rows[0], "input_ids": rows[1]["input_ids"], "labels": rows[1]["labels"], INDEX_COLUMN: 0}
    with pytest.raises(ValueError, match="other text"):
        collator([wrong])


def test_recipe_key_checks():
    with pytest.raises(ValueError, match="cache_activations"):
        recipe_from_dict({"streams": {"mode": "shared"}, "data": {"cache_activations": True}})
    with pytest.raises(ValueError, match="cache_activations"):
        recipe_from_dict({"streams": None, "data": {"cache_activations": True}})
    with pytest.raises(ValueError, match="activations_path"):
        recipe_from_dict({"data": {"activations_path": "x"}})
    with pytest.raises(ValueError, match="gradient_checkpointing=false"):
        recipe_from_dict({"streams": {"mode": "lossless"}, "lora": {"enabled": False},
                          "data": {"cache_activations": True}, "training": {"gradient_checkpointing": True}})
    ok = recipe_from_dict({"streams": {"mode": "lossless", "main_weight": 0.0}, "lora": {"enabled": False},
                           "data": {"cache_activations": True}})
    assert ok.data.cache_activations


def _offline_overrides(tiny_dir, out, **extra):
    values = {
        "model.name_or_path": str(tiny_dir), "training.output_dir": str(out), "training.max_steps": 4,
        "training.save_steps": 2, "training.logging_steps": 1, "training.eval_steps": 2, "training.batch_size": 2,
        "training.report_to": "none", "data.max_train_examples": 8, "data.max_validation_examples": 4,
        "data.max_length": 512, "data.distill.enabled": "false", "streams.stream_targets": "labels",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def _step_losses(run) -> dict[int, float]:
    """A run's logged training loss by step, from its checkpoint-4."""
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


def _online_and_offline_runs(recipe_path, tiny_dir, tmp_path, **extra):
    """The recipe trained 4 steps online and offline (`extra` overrides both): the two runs'
    summaries, after checking that their loss curves are the same."""
    online = run_training(load_recipe(recipe_path, _offline_overrides(tiny_dir, tmp_path / "online", **extra)))
    offline = run_training(load_recipe(recipe_path, _offline_overrides(
        tiny_dir, tmp_path / "offline", **extra, **{"data.cache_activations": "true",
                                                    "data.activations_path": str(tmp_path / "store")})))
    assert offline["steps"] == online["steps"] == 4
    assert _step_losses(tmp_path / "offline") == pytest.approx(_step_losses(tmp_path / "online"), rel=1e-4)
    return online, offline


def test_offline_recipe_trains_the_same_curve_as_online(tiny_dir, tmp_path):
    recipe_path = ROOT / "recipes" / "smollm2-135m" / "sql_streams_distilled.yaml"
    online, offline = _online_and_offline_runs(recipe_path, tiny_dir, tmp_path)
    assert offline["validation"][-1]["eval_stream_1_top1"] == pytest.approx(online["validation"][-1]["eval_stream_1_top1"])
    assert (tmp_path / "store" / STORE_FILE).is_file()


def test_a_train_fraction_trains_on_its_share_through_the_whole_sets_store(tiny_dir, tmp_path):
    recipe_path = ROOT / "recipes" / "smollm2-135m" / "sql_streams_distilled.yaml"
    half = {"data.train_fraction": 0.5, "training.max_steps": -1, "training.epochs": 1, "training.save_steps": 100}
    online = run_training(load_recipe(recipe_path, _offline_overrides(tiny_dir, tmp_path / "online", **half)))
    offline = run_training(load_recipe(recipe_path, _offline_overrides(
        tiny_dir, tmp_path / "offline", **half, **{"data.cache_activations": "true",
                                                   "data.activations_path": str(tmp_path / "store")})))
    assert online["steps"] == offline["steps"] == 2  # 4 of the 8 training examples, batch 2
    store = json.loads((tmp_path / "store" / STORE_FILE).read_text())
    assert store["complete"]
    assert store["settings"]["examples"] == 12  # the whole set's store (8 train + 4 validation), not the share's
    assert offline["validation"][-1]["eval_stream_1_top1"] == pytest.approx(online["validation"][-1]["eval_stream_1_top1"])


def test_length_grouped_batches_train_the_same_curve_online_and_offline(tiny_dir, tmp_path, monkeypatch):
    """`training.group_by_length`: transformers' length-grouped sampler orders the rows by their
    `length` column (added to the training set), and offline rows still find their own stored
    activations in that order."""
    import transformers.trainer

    seen = []

    class Recording(transformers.trainer.LengthGroupedSampler):
        def __init__(self, *args, lengths=None, **kwargs):
            seen.append(None if lengths is None else list(lengths))
            super().__init__(*args, lengths=lengths, **kwargs)

    monkeypatch.setattr(transformers.trainer, "LengthGroupedSampler", Recording)
    recipe_path = ROOT / "recipes" / "smollm2-135m" / "sql_streams_distilled.yaml"
    grouped = {"training.group_by_length": "true"}
    args = training_arguments(load_recipe(recipe_path, _offline_overrides(tiny_dir, tmp_path / "args", **grouped)))
    assert (args.train_sampling_strategy, args.length_column_name) == ("group_by_length", LENGTH_COLUMN)
    assert training_arguments(load_recipe(recipe_path, _offline_overrides(tiny_dir, tmp_path / "args"))
                              ).train_sampling_strategy == "random"
    assert with_lengths(Dataset.from_dict({"input_ids": [[5, 6, 7], [8]]}))[LENGTH_COLUMN] == [3, 1]
    _online_and_offline_runs(recipe_path, tiny_dir, tmp_path, **grouped)
    # the training rows (8, of different lengths) and the validation rows (4; transformers orders
    # them by length too) came with their token counts, in both runs
    assert seen and None not in seen and sorted({len(s) for s in seen}) == [4, 8]
    assert all(len(set(s)) > 1 for s in seen if len(s) == 8)


def test_a_length_grouped_offline_run_resumes_on_the_same_curve(tiny_dir, tmp_path):
    """Stopped after step 2 and resumed from that checkpoint, a `group_by_length` run draws the same
    batches as the run that went on (the sampler's order comes from the seeded generator)."""
    import shutil

    recipe_path = ROOT / "recipes" / "smollm2-135m" / "sql_streams_distilled.yaml"
    settings = {"training.group_by_length": "true", "data.cache_activations": "true",
                "data.activations_path": str(tmp_path / "store"), "data.max_train_examples": 32}
    run_training(load_recipe(recipe_path, _offline_overrides(tiny_dir, tmp_path / "straight", **settings)))
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    run_training(load_recipe(recipe_path, _offline_overrides(tiny_dir, tmp_path / "resumed", **settings)), resume=True)
    straight = {step: loss for step, loss in _step_losses(tmp_path / "straight").items() if step > 2}
    resumed = {step: loss for step, loss in _step_losses(tmp_path / "resumed").items() if step > 2}
    assert sorted(straight) == [3, 4]
    assert resumed == pytest.approx(straight, rel=1e-5)
