"""Checkpoints that travel: a base of the same shape but other weights is refused, a
checkpoint moved together with its base still loads, and a base without a name saves
adapters-only and then needs base_model=."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_model, random_ids
from streamspec import CheckpointError, StreamConfig, add_streams, load_streamed
from streamspec.patch.checkpoint import base_fingerprint


def _saved_base(tmp_path, name="base", seed=0):
    folder = tmp_path / name
    make_model("llama", seed).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval(), folder


def test_a_different_base_of_the_same_shape_is_refused(tmp_path):
    base, _ = _saved_base(tmp_path)
    add_streams(base, StreamConfig(stream_layers=2)).save_pretrained(tmp_path / "ckpt")
    other = make_model("llama", seed=1)  # same config, other weights
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_streamed(tmp_path / "ckpt", base_model=other)
    # the same base in another dtype is the same base
    same = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa", dtype=torch.bfloat16)
    assert load_streamed(tmp_path / "ckpt", base_model=same) is not None


def test_a_moved_checkpoint_finds_its_base_relative_to_it(tmp_path):
    home = tmp_path / "machine-a"
    home.mkdir()
    base, _ = _saved_base(home)
    model = add_streams(base, StreamConfig(stream_layers=2)).eval()
    model.save_pretrained(home / "ckpt")
    ids = random_ids(1, 6, 3)
    with torch.no_grad():
        before = model(ids).logits
    moved = tmp_path / "machine-b"
    shutil.move(str(home), str(moved))  # the recorded absolute path no longer exists
    meta = json.loads((moved / "ckpt" / "stream_config.json").read_text())
    assert not (home / "base").exists() and meta["base_model"]["relative_path"] == "../base"
    loaded = load_streamed(moved / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, before)


def test_a_base_without_a_name_saves_adapters_only(tmp_path):
    base = make_model("llama", seed=2)  # built from a config: no name or path
    base.config._name_or_path = ""
    model = add_streams(base, StreamConfig(stream_layers=2)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    with pytest.raises(CheckpointError, match="base_model="):
        load_streamed(tmp_path / "ckpt")
    ids = random_ids(1, 6, 4)
    loaded = load_streamed(tmp_path / "ckpt", base_model=make_model("llama", seed=2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_fingerprint_tells_seeds_apart():
    assert base_fingerprint(make_model("llama", 0)) == base_fingerprint(make_model("llama", 0))
    assert base_fingerprint(make_model("llama", 0)) != base_fingerprint(make_model("llama", 1))
