"""Stream-only adapters (`StreamConfig.stream_adapter_rank`): they change the streams and nothing
else. Lossless mode stays exactly the base model, no future token leaks in, decoding stays exact,
checkpoints round-trip and a checkpoint of another rank is refused."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from conftest import ARCHS, LORA_TARGETS, hf_greedy, make_model, random_ids, reference_logits
from streamspec import CheckpointError, StreamConfig, add_streams, load_streamed
from streamspec.decoding import generate, generate_autoregressive
from streamspec.patch.parameters import linear_targets

pytestmark = pytest.mark.usefixtures("single_thread")

RANK = 4


def _adapted(arch, seed=0, mode="lossless", **cfg):
    """A tiny base and a streamed model whose stream adapters are non-zero (so they act)."""
    base = make_model(arch, seed)
    torch.manual_seed(seed + 100)
    cfg.setdefault("stream_layers", 2)
    model = add_streams(base, StreamConfig(mode=mode, stream_adapter_rank=RANK, **cfg)).eval()
    _randomize_adapters(model, seed)
    return base, model


def _randomize_adapters(model, seed, scale=0.5):
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.streams.adapters.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)


def _zero_adapters(model):
    with torch.no_grad():
        for layer in model.streams.adapters.layers:
            for pair in layer.values():
                pair.up.weight.zero_()


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_main_equals_base_and_adapters_change_streams(arch):
    base, model = _adapted(arch, seed=1)
    ids = random_ids(2, 9, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], reference_logits(base, ids, mask)[real], atol=1e-5, rtol=0)
    _zero_adapters(model)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
    # the adapters act on the streams (so the equality above is not trivial) and on nothing else
    assert not torch.allclose(out.stream_logits[real], plain.stream_logits[real], atol=1e-3)
    torch.testing.assert_close(out.logits, plain.logits, atol=0, rtol=0)
    torch.testing.assert_close(out.early_exit_logits, plain.early_exit_logits, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_linear_of_each_msa_layer_gets_an_adapter(arch):
    _, model = _adapted(arch)
    per_layer = model.streams.adapters.layers
    assert len(per_layer) == 2
    for layer, adapters in zip(model.layers[model.num_lower_layers :], per_layer):
        names = [name for name, _, _ in linear_targets(layer)]
        assert len(names) >= 4  # attention and MLP projections
        assert sorted(adapters.keys()) == sorted(n.replace(".", "-") for n in names)
        for name, fan_in, fan_out in linear_targets(layer):
            pair = adapters[name.replace(".", "-")]
            assert pair.down.weight.shape == (RANK, fan_in) and pair.up.weight.shape == (fan_out, RANK)
    expected = sum(RANK * (i + o) for layer in model.layers[model.num_lower_layers :] for _, i, o in linear_targets(layer))
    without = add_streams(make_model(arch), StreamConfig(stream_layers=2)).num_stream_parameters()
    assert model.num_stream_parameters() == without + expected


@pytest.mark.parametrize("arch", ARCHS)
def test_names_are_the_same_under_a_lora_adapter(arch):
    """With a peft LoRA attached the adapters attach to the LoRA wrappers, not to their insides."""
    base = make_model(arch, 2)
    plain = [linear_targets(layer) for layer in add_streams(base, StreamConfig(stream_layers=2)).layers[-2:]]
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS[arch], fan_in_fan_out=arch == "gpt2")
    model = add_streams(make_model(arch, 2), StreamConfig(stream_layers=2, stream_adapter_rank=RANK)).add_lora(lora)
    assert [linear_targets(layer) for layer in model.layers[-2:]] == plain


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_no_leakage_from_future_tokens(arch, mode):
    _, model = _adapted(arch, seed=3, mode=mode, stream_layers=3)
    ids = random_ids(2, 9, seed=3)
    with torch.no_grad():
        ref = model(ids)
        for t in (2, 5):
            changed = ids.clone()
            changed[:, t + 1 :] = random_ids(2, 9 - t - 1, seed=50 + t)
            out = model(changed)
            torch.testing.assert_close(out.logits[:, : t + 1], ref.logits[:, : t + 1], atol=1e-5, rtol=0)
            torch.testing.assert_close(out.stream_logits[:, : t + 1], ref.stream_logits[:, : t + 1], atol=1e-5, rtol=0)
            assert not torch.allclose(out.logits[:, t + 1 :], ref.logits[:, t + 1 :], atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_decoding_is_exact(arch, mode):
    _, model = _adapted(arch, seed=4, mode=mode)
    for seed in range(2):
        prompt = random_ids(1, 4 + 3 * seed, seed=seed)
        reference = generate_autoregressive(model, prompt, 14)
        for k, threshold in [(1, None), (3, None), ((2, 1, 1), 0.05)]:
            out = generate(model, prompt, 14, tree_top_k=k, prune_threshold=threshold)
            assert torch.equal(out.tokens, reference), (seed, k, threshold)
        if mode == "lossless":
            assert torch.equal(reference, hf_greedy(model.base, prompt, 14))


def test_gradients_reach_adapters_and_not_the_frozen_base():
    _, model = _adapted("llama", seed=5)
    model.train()
    ids = random_ids(2, 10, seed=5)
    labels = ids.clone()
    labels[:, :4] = -100
    model(ids, labels=labels).loss.backward()
    grads = {name: p.grad for name, p in model.streams.adapters.named_parameters()}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None for p in model.base.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_round_trip_and_rank_mismatch_refused(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    make_model(arch, 6).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa").eval()
    model = add_streams(base, StreamConfig(stream_layers=2, mode="lossless", stream_adapter_rank=RANK)).eval()
    _randomize_adapters(model, 6)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_streamed(tmp_path / "ckpt")
    ids = random_ids(1, 8, seed=6)
    with torch.no_grad():
        a, b = model(ids), loaded(ids)
    assert torch.equal(a.stream_logits.nan_to_num(), b.stream_logits.nan_to_num())
    assert torch.equal(a.logits, b.logits)
    # a checkpoint with adapters loaded into a model of another rank, or none, is refused
    import json

    meta_path = tmp_path / "ckpt" / "stream_config.json"
    for rank in (RANK * 2, None):
        meta = json.loads(meta_path.read_text())
        meta["stream_config"]["stream_adapter_rank"] = rank
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match="adapters" if rank is None else "mis-shaped"):
            load_streamed(tmp_path / "ckpt")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bad_rank_is_refused(bad):
    with pytest.raises(ValueError, match="stream_adapter_rank"):
        StreamConfig(stream_adapter_rank=bad)


@pytest.mark.parametrize("bad", ["future", "", None])
def test_bad_stream_targets_are_refused(bad):
    with pytest.raises(ValueError, match="stream_targets"):
        StreamConfig(stream_targets=bad)
