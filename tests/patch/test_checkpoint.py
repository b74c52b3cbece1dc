"""Streamed checkpoints: round trips give identical outputs; anything that does not match is refused."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import ARCHS, LORA_TARGETS, make_config, make_model, random_ids
from streamspec import CheckpointError, StreamConfig, add_streams, load_streamed


def _saved_base(arch, tmp_path, seed=0):
    """A tiny base saved to disk and loaded back, so the checkpoint can record its path."""
    path = tmp_path / f"base-{arch}-{seed}"
    make_model(arch, seed=seed).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def _outputs(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits, out.stream_logits, out.early_exit_logits


def _assert_same(a, b, exact=True):
    for x, y in zip(a, b):
        if exact:
            assert torch.equal(x.nan_to_num(), y.nan_to_num())
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, equal_nan=True)


def _perturb_streams(model):
    # Make sure the saved stream weights are not their initial values.
    with torch.no_grad():
        for p in model.streams.parameters():
            p.add_(torch.randn_like(p) * 0.1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_round_trip_without_adapter(arch, mode, tmp_path):
    model = add_streams(_saved_base(arch, tmp_path), StreamConfig(stream_layers=2, mode=mode)).eval()
    _perturb_streams(model)
    ids = random_ids(2, 9, seed=1)
    model.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["stream_config.json", "streams.safetensors"]
    loaded = load_streamed(tmp_path / "ckpt")
    assert loaded.stream_config == model.stream_config
    _assert_same(_outputs(model, ids), _outputs(loaded, ids))


def test_round_trip_of_streams_that_read_the_next_token(tmp_path):
    """`next_token_input` streams save their map and load it back; a folder without it is refused."""
    config = StreamConfig(stream_layers=2, mode="lossless", next_token_input=True)
    model = add_streams(_saved_base("llama", tmp_path), config).eval()
    _perturb_streams(model)
    ids = random_ids(2, 9, seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_streamed(tmp_path / "ckpt")
    assert loaded.stream_config.next_token_input
    _assert_same(_outputs(model, ids), _outputs(loaded, ids))
    without = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2, mode="lossless"))
    without.save_pretrained(tmp_path / "plain")
    meta = json.loads((tmp_path / "plain" / "stream_config.json").read_text())
    meta["stream_config"]["next_token_input"] = True
    (tmp_path / "plain" / "stream_config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="missing .*next_token_map"):
        load_streamed(tmp_path / "plain")


def test_a_checkpoint_written_before_a_config_field_existed_resumes(tmp_path):
    """A stream_config.json without a field added since (here `next_token_input`) reads as its
    default: such a checkpoint resumes and starts runs; one with another value is refused."""
    from streamspec.patch.checkpoint import load_training_checkpoint

    base = _saved_base("llama", tmp_path)
    model = add_streams(base, StreamConfig(stream_layers=2, mode="lossless")).eval()
    _perturb_streams(model)
    model.save_pretrained(tmp_path / "old")
    meta_path = tmp_path / "old" / "stream_config.json"
    meta = json.loads(meta_path.read_text())
    del meta["stream_config"]["next_token_input"]
    meta_path.write_text(json.dumps(meta))
    fresh = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2, mode="lossless"))
    load_training_checkpoint(fresh, tmp_path / "old")
    for (name, a), b in zip(model.streams.state_dict().items(), fresh.streams.state_dict().values()):
        assert torch.equal(a, b), name
    other = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2, mode="lossless", num_streams=2))
    with pytest.raises(ValueError, match="another stream config"):
        load_training_checkpoint(other, tmp_path / "old")


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_with_lora_and_merged(arch, tmp_path):
    model = add_streams(_saved_base(arch, tmp_path), StreamConfig(stream_layers=2, stream_init="lowrank", init_rank=4))
    model.add_lora(LoraConfig(r=4, target_modules=LORA_TARGETS[arch], init_lora_weights=False))
    model.eval()
    _perturb_streams(model)
    ids = random_ids(2, 9, seed=2)
    expected = _outputs(model, ids)

    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()
    loaded = load_streamed(tmp_path / "ckpt")
    assert loaded.has_lora
    _assert_same(expected, _outputs(loaded, ids))

    model.save_pretrained(tmp_path / "merged", merge=True)
    assert model.has_lora, "merging for the export must not unload the live model's adapter"
    merged = load_streamed(tmp_path / "merged")  # no other input
    assert not merged.has_lora
    _assert_same(expected, _outputs(merged, ids), exact=False)


def test_explicit_base_instance(tmp_path):
    base = _saved_base("llama", tmp_path)
    model = add_streams(base, StreamConfig(stream_layers=2)).eval()
    _perturb_streams(model)
    model.save_pretrained(tmp_path / "ckpt")
    ids = random_ids(1, 7, seed=3)
    loaded = load_streamed(tmp_path / "ckpt", base_model=make_model("llama", seed=0))
    _assert_same(_outputs(model, ids), _outputs(loaded, ids))


def _rewrite_weights(path, change):
    state = load_file(path)
    change(state)
    save_file(state, path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("stream_embeddings"), "missing"),
        (lambda s: s.__setitem__("extra", torch.zeros(2)), "unexpected"),
        (lambda s: s.__setitem__("stream_embeddings", torch.zeros(5, 32)), "mis-shaped"),
    ],
)
def test_refuses_mismatched_stream_weights(tmp_path, change, message):
    model = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2))
    model.save_pretrained(tmp_path / "ckpt")
    _rewrite_weights(tmp_path / "ckpt" / "streams.safetensors", change)
    with pytest.raises(CheckpointError, match=message):
        load_streamed(tmp_path / "ckpt")


def test_refuses_config_that_does_not_fit_weights(tmp_path):
    model = add_streams(_saved_base("llama", tmp_path), StreamConfig(num_streams=3, stream_layers=2))
    model.save_pretrained(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "stream_config.json"
    meta = json.loads(meta_path.read_text())
    meta["stream_config"]["num_streams"] = 2
    meta["stream_config"]["stream_weights"] = [0.1, 0.1]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="mis-shaped"):
        load_streamed(tmp_path / "ckpt")


def test_refuses_other_base(tmp_path):
    model = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2))
    model.save_pretrained(tmp_path / "ckpt")
    config = make_config("llama")
    config.hidden_size = 48
    other = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_streamed(tmp_path / "ckpt", base_model=other)
    with pytest.raises(CheckpointError, match="model_type"):
        load_streamed(tmp_path / "ckpt", base_model=make_model("gpt2"))


def test_refuses_mismatched_adapter(tmp_path):
    model = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2))
    model.add_lora(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors"
    _rewrite_weights(path, lambda s: s.pop(next(k for k in sorted(s) if "lora_A" in k)))
    with pytest.raises(CheckpointError, match="adapter"):
        load_streamed(tmp_path / "ckpt")


def test_refuses_non_checkpoints_and_unknown_versions(tmp_path):
    with pytest.raises(CheckpointError, match="stream_config.json"):
        load_streamed(tmp_path)
    model = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2))
    model.save_pretrained(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "stream_config.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format_version"):
        load_streamed(tmp_path / "ckpt")


def test_unnamed_base_saves_adapters_only_or_merged(tmp_path):
    model = add_streams(make_model("llama"), StreamConfig(stream_layers=2))  # built from a config: no path
    model.save_pretrained(tmp_path / "ckpt")  # streams only: loading needs the base (test_checkpoint_identity)
    with pytest.raises(CheckpointError, match="base_model="):
        load_streamed(tmp_path / "ckpt")
    model.save_pretrained(tmp_path / "merged", merge=True)
    ids = random_ids(1, 6, seed=4)
    _assert_same(_outputs(model.eval(), ids), _outputs(load_streamed(tmp_path / "merged"), ids), exact=False)


def test_merge_adapter_gives_the_adapted_model_and_refuses_a_broken_adapter(tmp_path):
    """`merge_adapter` (the `streamspec merge` command): the saved folder is the LoRA model merged,
    loadable as a plain base for lossless streams; a missing or incomplete adapter is refused."""
    from peft import get_peft_model

    from streamspec.patch.checkpoint import merge_adapter

    base_path = tmp_path / "base"
    make_model("llama", seed=3).save_pretrained(base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path, attn_implementation="sdpa")
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = random_ids(2, 9, seed=3)
    with torch.no_grad():
        expected = peft_model(ids).logits
    merge_adapter(tmp_path / "adapter", tmp_path / "merged", base=str(base_path))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa").eval()
    with torch.no_grad():
        got = merged(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(base_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert not torch.allclose(original(ids).logits, expected, atol=1e-3)  # the adapter did something
    with pytest.raises(CheckpointError, match="does not exist"):
        merge_adapter(tmp_path / "nowhere", tmp_path / "x", base=str(base_path))
    _rewrite_weights(tmp_path / "adapter" / "adapter_model.safetensors",
                     lambda s: s.pop(next(k for k in sorted(s) if "lora_A" in k)))
    with pytest.raises(CheckpointError, match="adapter"):
        merge_adapter(tmp_path / "adapter", tmp_path / "y", base=str(base_path))


def test_init_from_plain_streams_into_streams_that_read_the_next_token(tmp_path):
    """`training.init_from` a lossless checkpoint into the same streams with `next_token_input`:
    every saved weight loaded, the map at zero, so the drafts start as the checkpoint's; any other
    difference in the config is still refused."""
    from streamspec.patch.resume import init_draft_from

    plain = add_streams(_saved_base("llama", tmp_path), StreamConfig(stream_layers=2, mode="lossless")).eval()
    _perturb_streams(plain)
    plain.save_pretrained(tmp_path / "plain")
    reads = add_streams(_saved_base("llama", tmp_path),
                        StreamConfig(stream_layers=2, mode="lossless", next_token_input=True)).eval()
    with torch.no_grad():
        reads.streams.next_token_map.weight.fill_(1.0)
    init_draft_from(reads, tmp_path / "plain")
    assert not reads.streams.next_token_map.weight.any()
    ids = random_ids(2, 9, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(reads(ids).stream_logits, plain(ids).stream_logits, equal_nan=True)
    other = add_streams(_saved_base("llama", tmp_path),
                        StreamConfig(stream_layers=2, mode="lossless", next_token_input=True, num_streams=2))
    with pytest.raises(ValueError, match="another stream config"):
        init_draft_from(other, tmp_path / "plain")
