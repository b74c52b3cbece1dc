"""Clear errors: bad configs, unsupported models and attention kernels, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel, OPTConfig

from conftest import ARCHS, HIDDEN, LAYERS, VOCAB, make_config, make_model, random_ids
from streamspec import StreamConfig, StreamedModel, add_streams


def streamed(arch: str, seed: int = 0, **cfg):
    base = make_model(arch, seed)
    cfg.setdefault("stream_layers", 2)
    return base, add_streams(base, StreamConfig(**cfg)).eval()


# ---------------------------------------------------------------------------------------------
# configuration validation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_streams=0), "num_streams"),
        (dict(num_streams=-2), "num_streams"),
        (dict(num_streams=1.5), "num_streams"),
        (dict(num_streams=True), "num_streams"),
        (dict(stream_layers=0), "stream_layers"),
        (dict(stream_init="rotation"), "stream_init"),
        (dict(mode="exact"), "mode"),
        (dict(init_rank=4), "init_rank"),
        (dict(stream_init="value_rotation", init_rank=4), "init_rank"),
        (dict(stream_init="lowrank", init_rank=0), "init_rank"),
        (dict(main_weight=-1.0), "main_weight"),
        (dict(main_weight=math.nan), "main_weight"),
        (dict(main_weight="1"), "main_weight"),
        (dict(stream_weights=-0.1), "stream_weights"),
        (dict(stream_weights=[0.1, -0.1, 0.1]), r"stream_weights\[1\]"),
        (dict(num_streams=3, stream_weights=[0.1, 0.1]), "stream_weights"),
        (dict(num_streams=2, stream_weights=[0.1, 0.1, 0.1]), "stream_weights"),
        (dict(prune_rank=0), "prune_rank"),
    ],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StreamConfig(**kwargs)


def test_config_normalises_and_round_trips():
    cfg = StreamConfig(num_streams=2, stream_weights=0.25, main_weight=1)
    assert cfg.stream_weights == [0.25, 0.25]
    assert isinstance(cfg.main_weight, float)
    again = StreamConfig.from_dict(cfg.to_dict())
    assert again == cfg
    import json

    assert StreamConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_from_dict_rejects_unknown_key():
    with pytest.raises(ValueError, match="num_heads"):
        StreamConfig.from_dict({"num_streams": 2, "num_heads": 3})


def test_stream_layers_checked_against_model(arch):
    base = make_model(arch)
    with pytest.raises(ValueError, match="stream_layers"):
        add_streams(base, StreamConfig(stream_layers=LAYERS + 1))
    # all layers is allowed (no lower layers at all)
    model = add_streams(base, StreamConfig(stream_layers=LAYERS, num_streams=2)).eval()
    with torch.no_grad():
        out = model(random_ids(1, 4, 0))
    assert out.stream_logits.shape == (1, 4, 2, VOCAB)
    assert torch.isfinite(out.stream_logits).all()


def _opt_model():
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        word_embed_proj_dim=HIDDEN,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config)


def _bert_model():
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        is_decoder=True,
    )
    return BertLMHeadModel(config)


@pytest.mark.parametrize("factory", [_opt_model, _bert_model], ids=["opt", "bert"])
def test_unsupported_architecture(factory):
    model = factory()
    with pytest.raises(ValueError, match="not supported") as info:
        add_streams(model, StreamConfig(stream_layers=1))
    for name in ARCHS:
        assert name in str(info.value)


def test_flash_attention_refused(arch):
    base = make_model(arch)
    base.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        add_streams(base, StreamConfig(stream_layers=2))


def test_add_streams_type_errors():
    _, model = streamed("llama")
    with pytest.raises(ValueError, match="already has streams"):
        add_streams(model, StreamConfig(stream_layers=2))
    with pytest.raises(TypeError):
        add_streams(torch.nn.Linear(2, 2), StreamConfig(stream_layers=2))
    with pytest.raises(TypeError):
        StreamedModel(make_model("llama"), {"num_streams": 2})


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------
def test_bad_inputs_raise():
    _, model = streamed("llama", seed=71)
    ids = random_ids(2, 6, 71)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    with torch.no_grad():
        model(ids, attention_mask=mask, labels=labels)  # the good call works
        bad = labels.clone()
        bad[0, 0] = 5
        with pytest.raises(ValueError, match="-100"):
            model(ids, attention_mask=mask, labels=bad)
        with pytest.raises(ValueError, match="attention_mask"):
            model(ids, attention_mask=mask[:, :5])
        with pytest.raises(ValueError, match="labels"):
            model(ids, attention_mask=mask, labels=labels[:1])
        with pytest.raises(ValueError, match="input_ids"):
            model(ids[0])
        with pytest.raises(ValueError, match="input_ids"):
            model(ids.float())
        with pytest.raises(ValueError, match="empty"):
            model(ids[:, :0])
        with pytest.raises(TypeError, match="past_key_values"):
            model(ids, past_key_values=None)


def test_sliding_window_length_checked():
    config = make_config("mistral")
    config.sliding_window = 4
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = add_streams(base, StreamConfig(stream_layers=2)).eval()
    with torch.no_grad():
        model(random_ids(1, 4, 0))
        with pytest.raises(ValueError, match="sliding window"):
            model(random_ids(1, 5, 0))
