"""Medusa heads as a peer of streams: heads that start as the model's next-token prediction and
see no future, decoding through the tree verifier exactly like one token per pass (greedy and
seeded sampling), training that moves the heads only, strict checkpoints, recipes, and a
training run end to end. Tiny random models from conftest throughout."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import ARCHS, HIDDEN, hf_greedy, make_model, random_ids, reference_logits
from streamspec import CheckpointError, StreamConfig, add_streams
from streamspec.decoding.generate import generate
from streamspec.loading import load_for_inference
from streamspec.patch.layout import causal, main_allowed, position_ids_from_mask
from streamspec.patch.medusa import (
    MEDUSA_CONFIG_FILE,
    MEDUSA_WEIGHTS_FILE,
    MedusaConfig,
    MedusaModel,
    add_medusa_heads,
    load_medusa,
    load_medusa_heads,
    read_medusa_meta,
)
from streamspec.training.recipe import load_recipe, recipe_from_dict
from streamspec.training.trainer import RECIPE_FILE, evaluation_counts, run_training

ROOT = Path(__file__).resolve().parents[2]
MEDUSA_RECIPE = ROOT / "recipes" / "smollm2-135m" / "sql_medusa.yaml"

pytestmark = pytest.mark.usefixtures("single_thread")

TREES = [dict(tree_top_k=1), dict(tree_top_k=(2, 1, 1)), dict(tree_top_k=3, verify="device"),
         dict(tree_top_k=3, verify="host"), dict(tree_top_k=(3, 2))]


def _randomize(model: MedusaModel, seed: int, std: float = 0.5) -> MedusaModel:
    """Non-zero head weights (the heads start at zero, which drafts the main token again)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def _medusa(arch: str, seed: int = 0, heads: int = 3, head_seed: int | None = 0) -> MedusaModel:
    model = add_medusa_heads(make_model(arch, seed), MedusaConfig(num_heads=heads)).eval()
    return model if head_seed is None else _randomize(model, head_seed)


def _heads_state(model: MedusaModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.heads.state_dict().items()}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _all_positions(model: MedusaModel, ids: torch.Tensor, mask: torch.Tensor | None = None):
    """The main hidden states and every head's output at every position."""
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    positions = position_ids_from_mask(mask)
    main_ok = main_allowed(causal(ids.shape[1], ids.device), mask)
    index = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        lower = model.run_lower(ids, positions, main_ok)
        return model.run_upper(lower, positions, main_ok, index, torch.ones_like(index, dtype=torch.bool))


def _own_greedy_batch(base, count: int = 8, prompt: int = 4, new: int = 24, seed: int = 5):
    """The model's own greedy continuations of random prompts, labelled past the prompt."""
    prompts = random_ids(count, prompt, seed)
    ids = torch.cat([torch.cat([p[None], hf_greedy(base, p[None], new)], dim=1) for p in prompts])
    labels = ids.clone()
    labels[:, :prompt] = -100
    return ids, labels


@functools.lru_cache(maxsize=None)
def _trained(arch: str, peaked: bool = False) -> MedusaModel:
    """Heads trained for a moment on the model's own greedy text, so that drafts get accepted
    (random heads on a random model accept next to nothing) and whole paths are verified.
    `peaked`: the LM head scaled up first, so that sampled text often follows the greedy text
    the heads learned (a random model's distributions are nearly flat)."""
    torch.manual_seed(0)
    base = make_model(arch, 0)
    if peaked:
        with torch.no_grad():
            base.get_output_embeddings().weight.mul_(8.0 if arch == "gpt2" else 40.0)  # llama-likes init at std 0.02
    model = add_medusa_heads(base, MedusaConfig(num_heads=3))
    ids, labels = _own_greedy_batch(model.base)
    optimizer = torch.optim.Adam(model.heads.parameters(), lr=3e-2)
    model.train()
    for _ in range(40):
        loss = model(ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", None])
def test_medusa_config_refuses_bad_head_counts(bad):
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(num_heads=bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_start_at_zero_on_a_frozen_base(arch):
    model = add_medusa_heads(make_model(arch), MedusaConfig(num_heads=4))
    assert all(not p.requires_grad for p in model.base.parameters())
    assert all(p.requires_grad and not p.any() for p in model.heads.parameters())
    assert model.num_draft_parameters() == 4 * (HIDDEN * HIDDEN + HIDDEN)
    assert model.stream_config.num_streams == 4 and model.stream_config.stream_layers == 0
    assert model.num_lower_layers == len(model.layers) == model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_heads_predict_what_the_main_head_predicts(arch):
    model = add_medusa_heads(make_model(arch), MedusaConfig(num_heads=3)).eval()
    ids = random_ids(2, 9, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    main, heads = _all_positions(model, ids, mask)
    assert heads.shape == (2, 9, 3, HIDDEN)
    with torch.no_grad():
        main_logits = model.head(main)
        for k in range(3):
            assert torch.equal(model.head(heads[:, :, k]), main_logits)
    reference = reference_logits(model.base, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(main_logits[keep], reference[keep], rtol=1e-4, atol=1e-4)
    # heads with weights predict something else: the comparison above can fail
    _randomize(model, 3)
    _, moved = _all_positions(model, ids, mask)
    with torch.no_grad():
        assert not torch.allclose(model.head(moved[:, :, 0]), main_logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_see_no_token_after_their_position(arch):
    model = _medusa(arch)
    ids = random_ids(1, 12, seed=2)
    t = 6
    changed = ids.clone()
    changed[:, t + 1:] = random_ids(1, 12 - t - 1, seed=9)
    assert not torch.equal(changed, ids)
    main_a, heads_a = _all_positions(model, ids)
    main_b, heads_b = _all_positions(model, changed)
    torch.testing.assert_close(heads_a[:, : t + 1], heads_b[:, : t + 1], rtol=0, atol=1e-6)
    torch.testing.assert_close(main_a[:, : t + 1], main_b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(heads_a[:, t + 1:], heads_b[:, t + 1:]), "later positions do see the change"


def test_misuse_is_refused():
    model = _medusa("llama")
    with pytest.raises(ValueError, match="prune_threshold"):
        generate(model, random_ids(1, 4, 0), 4, prune_threshold=0.1)
    with pytest.raises(ValueError, match="labels"):
        model(random_ids(1, 4, 0))
    with pytest.raises(ValueError, match="labels"):
        model.evaluate_counts(random_ids(1, 4, 0))
    with pytest.raises(ValueError, match="early-exit"):
        model.early_exit_head(torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match="already has"):
        add_medusa_heads(model)
    with pytest.raises(ValueError, match="already has"):
        add_medusa_heads(add_streams(make_model("llama"), StreamConfig(stream_layers=2)))
    with pytest.raises(ValueError, match="already has"):
        add_streams(model, StreamConfig(stream_layers=2))
    with pytest.raises(ValueError, match="LoRA"):
        add_medusa_heads(get_peft_model(make_model("llama"), LoraConfig(r=2, target_modules=["q_proj"])))
    with pytest.raises(TypeError):
        add_medusa_heads(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="MedusaConfig"):
        MedusaModel(make_model("llama"), {"num_heads": 2})


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_equals_one_token_per_pass(arch):
    models = [_medusa(arch, seed=s, head_seed=s) for s in (0, 1)] + [_trained(arch)]
    accepted = 0
    for i, model in enumerate(models):
        for seed in range(2):
            prompt = random_ids(1, 3 + 2 * seed, 10 * i + seed)
            reference = generate(model, prompt, 16, speculative=False).tokens
            assert torch.equal(reference, hf_greedy(model.base, prompt, 16))
            for kwargs in TREES:
                out = generate(model, prompt, 16, **kwargs)
                assert torch.equal(out.tokens, reference), (i, seed, kwargs)
                assert sum(out.accepted_per_pass) >= 16 and out.forward_passes == len(out.accepted_per_pass)
                if i == 2:
                    accepted += 16 - out.forward_passes
    assert accepted > 10, "the trained heads' drafts must be accepted, or whole paths were not verified"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_seeded_sampling_equals_one_token_per_pass(arch):
    model = _trained(arch, peaked=True)
    prompt = random_ids(1, 5, 3)
    accepted, outputs = 0, set()
    for seed in range(6):
        kwargs = dict(temperature=0.8, seed=seed)
        reference = generate(model, prompt, 14, speculative=False, **kwargs).tokens
        outputs.add(tuple(reference[0].tolist()))
        for tree in (1, (2, 1, 1), 3):
            out = generate(model, prompt, 14, tree_top_k=tree, **kwargs)
            assert torch.equal(out.tokens, reference), (seed, tree)
            accepted += 14 - out.forward_passes
    assert len(outputs) > 1, "different seeds must draw different texts, or sampling was not exercised"
    assert accepted > 15, "drafts must be accepted, or the property was not exercised"


def test_a_padded_batch_decodes_each_row_as_alone():
    model = _trained("llama")
    a, b = random_ids(1, 6, 20), random_ids(1, 3, 21)
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = a[0], 1
    ids[1, 3:], mask[1, 3:] = b[0], 1
    out = generate(model, ids, 12, attention_mask=mask)
    for row, prompt in enumerate((a, b)):
        alone = generate(model, prompt, 12, speculative=False).tokens[0]
        assert out.tokens[row, : out.lengths[row]].tolist() == alone.tolist()


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_training_moves_the_heads_only_and_lowers_the_loss(arch):
    model = add_medusa_heads(make_model(arch), MedusaConfig(num_heads=3))
    ids, labels = _own_greedy_batch(model.base, count=4, new=12)
    base_before = {k: v.clone() for k, v in model.base.state_dict().items()}
    heads_before = _heads_state(model)
    # every parameter to the optimizer, with weight decay: a frozen weight must still not move
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.train()
    losses = []
    for step in range(6):
        out = model(ids, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if step == 0:
            assert all(p.grad is None for p in model.base.parameters())
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.heads.parameters())
        optimizer.step()
        losses.append(out.loss.item())
        assert sorted(out.loss_parts) == ["head_1", "head_2", "head_3"]
        assert out.loss.item() == pytest.approx(sum(float(v) for v in out.loss_parts.values()) / 3, rel=1e-5)
    assert losses[-1] < losses[0] - 0.05, losses
    state = model.base.state_dict()
    assert state.keys() == base_before.keys() and all(torch.equal(state[k], base_before[k]) for k in state)
    assert not _same_state(_heads_state(model), heads_before)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_head_k_learns_the_models_own_token_k_places_further(arch):
    """The loss parts and validation counts, computed naively: head k at position t is scored
    against the main head's own argmax for the token at t+1+k, wherever the data has that token."""
    model = _medusa(arch, head_seed=4)
    ids = random_ids(2, 10, seed=6)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, :5] = -100
    main, heads = _all_positions(model, ids)
    with torch.no_grad():
        own = model.head(main).argmax(-1)  # own[t]: the prediction for token t+1
        expected = {}
        for k in range(1, 4):
            logits = model.head(heads[:, :, k - 1])
            rows, targets = [], []
            for b in range(2):
                for t in range(10 - 1 - k):
                    if labels[b, t + 1 + k] != -100:
                        rows.append(logits[b, t])
                        targets.append(own[b, t + k])
            rows, targets = torch.stack(rows), torch.stack(targets)
            expected[k] = (F.cross_entropy(rows, targets, reduction="sum").item(),
                           int((rows.argmax(-1) == targets).sum()), len(targets))
        out = model(ids, labels=labels)
    for k, (loss_sum, _, count) in expected.items():
        assert float(out.loss_parts[f"head_{k}"]) == pytest.approx(loss_sum / count, rel=1e-4)
    counts = evaluation_counts(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    for k, (loss_sum, correct, count) in expected.items():
        assert counts[f"head_{k}_count"] == count and counts[f"head_{k}_correct"] == correct
        assert counts[f"head_{k}_loss_sum"] == pytest.approx(loss_sum, rel=1e-4)
    keep = labels[:, 1:] != -100
    with torch.no_grad():
        main_logits = model.head(main)[:, :-1][keep]
    assert counts["main_count"] == int(keep.sum())
    assert counts["main_loss_sum"] == pytest.approx(F.cross_entropy(main_logits, labels[:, 1:][keep], reduction="sum").item(),
                                                    rel=1e-4)


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


def _saved_base(arch: str, folder: Path, seed: int = 0):
    """A tiny base saved to disk and loaded back, so the checkpoint can record its path."""
    make_model(arch, seed=seed).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_gives_identical_heads_and_outputs(arch, tmp_path):
    model = _randomize(add_medusa_heads(_saved_base(arch, tmp_path / "base"), MedusaConfig(num_heads=3)).eval(), 7)
    model.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [MEDUSA_WEIGHTS_FILE, MEDUSA_CONFIG_FILE]
    meta = read_medusa_meta(tmp_path / "ckpt")
    assert meta["medusa_config"] == {"num_heads": 3} and meta["base_model"]["name_or_path"] == str(tmp_path / "base")
    loaded = load_medusa(tmp_path / "ckpt")
    assert isinstance(loaded, MedusaModel) and not loaded.training
    assert _same_state(_heads_state(loaded), _heads_state(model))
    prompt = random_ids(1, 5, 4)
    for kwargs in (dict(speculative=False), dict(tree_top_k=3), dict(tree_top_k=(2, 1, 1))):
        assert torch.equal(generate(loaded, prompt, 10, **kwargs).tokens, generate(model, prompt, 10, **kwargs).tokens)
    # onto a given base instance
    again = load_medusa(tmp_path / "ckpt", base_model=_saved_base(arch, tmp_path / "base2"))
    assert _same_state(_heads_state(again), _heads_state(model))


def test_a_moved_checkpoint_finds_its_base_beside_it(tmp_path):
    model = _randomize(add_medusa_heads(_saved_base("qwen2", tmp_path / "a" / "base")), 2)
    model.save_pretrained(tmp_path / "a" / "ckpt")
    (tmp_path / "a").rename(tmp_path / "b")
    loaded = load_medusa(tmp_path / "b" / "ckpt")
    assert loaded.config._name_or_path == str((tmp_path / "b" / "base").resolve())
    assert _same_state(_heads_state(loaded), _heads_state(model))


@pytest.fixture
def saved(tmp_path):
    """A llama base on disk, a checkpoint of random heads on it, and another model on the same
    base whose (other) heads a refused load must leave alone."""
    base = _saved_base("llama", tmp_path / "base")
    _randomize(add_medusa_heads(base, MedusaConfig(num_heads=3)), 1).save_pretrained(tmp_path / "ckpt")
    target = _randomize(add_medusa_heads(_saved_base("llama", tmp_path / "base-copy"), MedusaConfig(num_heads=3)), 2)
    # untouched, the checkpoint loads into such a model: a refusal comes from what a test changes
    clean = _randomize(add_medusa_heads(_saved_base("llama", tmp_path / "base-other-copy")), 5)
    load_medusa_heads(clean, tmp_path / "ckpt")
    assert _same_state(_heads_state(clean), dict(load_file(str(tmp_path / "ckpt" / MEDUSA_WEIGHTS_FILE))))
    return tmp_path / "ckpt", target


def _edit_weights(folder: Path, edit) -> None:
    state = load_file(str(folder / MEDUSA_WEIGHTS_FILE))
    edit(state)
    save_file(state, str(folder / MEDUSA_WEIGHTS_FILE))


def _edit_meta(folder: Path, edit) -> None:
    meta = json.loads((folder / MEDUSA_CONFIG_FILE).read_text())
    edit(meta)
    (folder / MEDUSA_CONFIG_FILE).write_text(json.dumps(meta))


CORRUPTIONS = {
    "missing key": lambda f: _edit_weights(f, lambda s: s.pop("0.linear.bias")),
    "renamed key": lambda f: _edit_weights(f, lambda s: s.update({"3.linear.weight": s.pop("2.linear.weight")})),
    "extra key": lambda f: _edit_weights(f, lambda s: s.update({"extra": torch.zeros(2)})),
    "wrong shape": lambda f: _edit_weights(f, lambda s: s.update({"1.linear.weight": torch.zeros(HIDDEN, HIDDEN - 1)})),
    "no weights": lambda f: (f / MEDUSA_WEIGHTS_FILE).unlink(),
    "other format": lambda f: _edit_meta(f, lambda m: m.update(format="streamspec-streams")),
    "newer version": lambda f: _edit_meta(f, lambda m: m.update(format_version=2)),
    "version as text": lambda f: _edit_meta(f, lambda m: m.update(format_version="1")),
    "no config": lambda f: (f / MEDUSA_CONFIG_FILE).unlink(),
    "other head count": lambda f: _edit_meta(f, lambda m: m.update(medusa_config={"num_heads": 2})),
    "other hidden size": lambda f: _edit_meta(f, lambda m: m["base_model"].update(hidden_size=HIDDEN * 2)),
    "other fingerprint": lambda f: _edit_meta(f, lambda m: m["base_model"].update(
        fingerprint=[v + 1.0 for v in m["base_model"]["fingerprint"]])),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_refused_and_nothing_is_loaded(saved, corruption):
    folder, target = saved
    CORRUPTIONS[corruption](folder)
    before = _heads_state(target)
    with pytest.raises(CheckpointError):
        load_medusa_heads(target, folder)
    assert _same_state(_heads_state(target), before)


@pytest.mark.parametrize("corruption", ["other format", "newer version", "missing key", "other fingerprint"])
def test_loading_a_corrupt_folder_is_refused(saved, corruption):
    folder, _ = saved
    CORRUPTIONS[corruption](folder)
    with pytest.raises(CheckpointError):
        load_medusa(folder)


def test_other_head_counts_and_other_bases_are_refused(saved, tmp_path):
    folder, _ = saved
    refusals = {
        "holds heads": _randomize(add_medusa_heads(_saved_base("llama", tmp_path / "x"), MedusaConfig(num_heads=2)), 3),
        "another base model of the same shape": _randomize(add_medusa_heads(_saved_base("llama", tmp_path / "y", seed=1)), 3),
        "another base model:": _randomize(add_medusa_heads(_saved_base("gpt2", tmp_path / "z")), 3),
    }
    for words, model in refusals.items():
        before = _heads_state(model)
        with pytest.raises(CheckpointError) as err:
            load_medusa_heads(model, folder)
        assert words in str(err.value), (words, err.value)
        assert _same_state(_heads_state(model), before), words
    with pytest.raises(CheckpointError, match="same shape"):
        load_medusa(folder, base_model=_saved_base("llama", tmp_path / "w", seed=1))


# ---------------------------------------------------------------------------------------------
# recipes and training runs
# ---------------------------------------------------------------------------------------------


def test_a_medusa_recipe_parses_and_round_trips():
    recipe = recipe_from_dict({"streams": None, "lora": {"enabled": False}, "medusa": {"num_heads": 2}})
    assert recipe.medusa == MedusaConfig(num_heads=2) and recipe.streams is None
    assert recipe_from_dict(recipe.to_dict()) == recipe
    assert recipe_from_dict({}).medusa is None  # no section: no heads
    shipped = load_recipe(MEDUSA_RECIPE)
    assert shipped.medusa == MedusaConfig(num_heads=3) and shipped.streams is None and not shipped.lora.enabled
    assert shipped.data.distill.enabled  # heads learn the model's own text, like the lossless streams
    assert recipe_from_dict(shipped.to_dict()) == shipped


@pytest.mark.parametrize("raw, words", [
    ({"lora": {"enabled": False}, "medusa": {"num_heads": 3}}, "streams: null"),  # streams left at their default
    ({"streams": {"mode": "lossless"}, "lora": {"enabled": False}, "medusa": {}}, "streams: null"),
    ({"streams": None, "medusa": {"num_heads": 3}}, "lora.enabled=false"),
    ({"streams": None, "lora": {"enabled": False}, "medusa": {"num_heads": 0}}, "medusa.num_heads"),
    ({"streams": None, "lora": {"enabled": False}, "medusa": {"num_heads": "three"}}, "medusa.num_heads"),
    ({"streams": None, "lora": {"enabled": False}, "medusa": {"heads": 3}}, "medusa.heads"),
    ({"streams": None, "lora": {"enabled": False}, "medusa": 3}, "medusa"),
    ({"streams": None, "lora": {"enabled": False}, "medusa": {}, "training": {"deepspeed": "z.json"}}, "DeepSpeed"),
])
def test_bad_medusa_recipes_are_refused(raw, words):
    with pytest.raises(ValueError) as err:
        recipe_from_dict(raw)
    assert words in str(err.value)


@pytest.mark.parametrize("override, words", [
    ("medusa.num_heads=0", "medusa.num_heads"),
    ("lora.enabled=true", "lora.enabled=false"),
    ("medusa.foo=1", "medusa.foo"),
])
def test_bad_medusa_overrides_are_refused(override, words):
    with pytest.raises(ValueError) as err:
        load_recipe(MEDUSA_RECIPE, [override])
    assert words in str(err.value)


def _overrides(tiny_dir, out, **extra):
    values = {
        "model.name_or_path": str(tiny_dir),
        "training.output_dir": str(out),
        "training.max_steps": 3,
        "training.save_steps": 2,
        "training.logging_steps": 1,
        "training.eval_steps": 3,
        "training.batch_size": 2,
        "training.eval_batch_size": 2,
        "training.learning_rate": 1e-2,
        "training.lr_scheduler": "constant",
        "training.warmup_ratio": 0,
        "training.report_to": "none",
        "data.max_train_examples": 8,
        "data.max_validation_examples": 4,
        "data.max_length": 512,
        "data.distill.enabled": "false",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def test_a_medusa_run_exports_heads_that_decode_exactly(tiny_dir, tmp_path):
    from streamspec.assets import load_base_model
    from streamspec.data.build import prompt_ids
    from streamspec.data.spider import load_spider

    recipe = load_recipe(MEDUSA_RECIPE, _overrides(tiny_dir, tmp_path / "run"))
    summary = run_training(recipe)
    assert summary["steps"] == 3
    assert set(summary["final_losses"]) == {"loss", "loss_head_1", "loss_head_2", "loss_head_3"}
    assert {"eval_main_top1", "eval_head_1_top1", "eval_head_3_loss"} <= set(summary["validation"][-1])
    final = tmp_path / "run" / "final"
    assert summary["export"] == str(final)
    assert sorted(p.name for p in final.iterdir()) == sorted([MEDUSA_CONFIG_FILE, MEDUSA_WEIGHTS_FILE, "training_args.bin"])
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / MEDUSA_CONFIG_FILE).is_file() and not list(checkpoint.glob("model*.safetensors"))
    assert load_recipe(tmp_path / "run" / RECIPE_FILE) == recipe  # the run's recipe.yaml reads back

    loaded = load_for_inference(final, device="cpu")
    model = loaded.model
    assert loaded.streamed and isinstance(model, MedusaModel) and model.medusa_config == MedusaConfig(num_heads=3)
    assert all(p.any() for p in model.heads.parameters()), "training moves the heads from zero"
    base = load_base_model(str(tiny_dir)).state_dict()  # the base was frozen: the one on disk
    state = model.base.state_dict()
    assert all(torch.equal(state[k], base[k]) for k in base)
    prompt = prompt_ids(loaded.tokenizer, load_spider("validation")[0])
    reference = generate(model, prompt, 12, speculative=False).tokens
    assert torch.equal(reference, hf_greedy(model.base, prompt, 12))
    for kwargs in (dict(tree_top_k=3), dict(tree_top_k=(2, 1, 1), verify="host")):
        assert torch.equal(generate(model, prompt, 12, **kwargs).tokens, reference), kwargs


def test_a_medusa_run_resumes_on_the_same_curve(tiny_dir, tmp_path):
    def losses(folder):
        history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        return {h["step"]: h["loss"] for h in history if "loss" in h}

    run_training(load_recipe(MEDUSA_RECIPE, _overrides(tiny_dir, tmp_path / "straight", **{"training.max_steps": 4})))
    run_training(load_recipe(MEDUSA_RECIPE, _overrides(tiny_dir, tmp_path / "resumed", **{"training.max_steps": 2})))
    run_training(load_recipe(MEDUSA_RECIPE, _overrides(tiny_dir, tmp_path / "resumed", **{"training.max_steps": 4})),
                 resume=True)
    expected = losses(tmp_path / "straight" / "checkpoint-4")
    got = losses(tmp_path / "resumed" / "checkpoint-4")
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)
    heads = [load_file(str(tmp_path / name / "final" / MEDUSA_WEIGHTS_FILE)) for name in ("straight", "resumed")]
    for key in heads[0]:
        torch.testing.assert_close(heads[0][key], heads[1][key], rtol=1e-5, atol=1e-6)
