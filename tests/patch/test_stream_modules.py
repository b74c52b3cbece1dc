"""The stream modules (value rotation, stream adapters) are wrappers put in place once: gradient
checkpointing recomputes them exactly, the plain model's own forward passes through them, a deep
copy is a working model of its own, peft LoRA goes inside them, and every state dict and saved
folder keeps the keys of the plain model (and of checkpoints written before the wrappers)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import LORA_TARGETS, hf_greedy, make_model, random_ids, reference_logits
from streamspec import StreamConfig, add_streams, load_streamed
from streamspec.patch.checkpoint import load_adapter_weights
from streamspec.decoding import generate
from streamspec.patch.stream_modules import StreamAdapter, StreamModule, StreamRows, ValueRotation

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.filterwarnings("ignore::FutureWarning")]

INITS = ("identity", "lowrank", "value_rotation")
RANK = 4


def _streamed(arch, seed=0, mode="shared", init="value_rotation", adapters=True, lora=False, **cfg):
    """A tiny streamed model whose zero-initialised stream weights are made non-zero (so they act)."""
    cfg.setdefault("stream_layers", 2)
    model = add_streams(
        make_model(arch, seed),
        StreamConfig(mode=mode, stream_init=init, stream_adapter_rank=RANK if adapters else None, **cfg),
    )
    if lora:
        model.add_lora(LoraConfig(r=2, target_modules=LORA_TARGETS[arch], fan_in_fan_out=arch == "gpt2",
                                  init_lora_weights=False))
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.streams.named_parameters():
            if name.startswith("adapters.") or name.startswith("init_up"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
    return model.eval()


def _batch(seed, batch=2, length=9, prompt=3):
    ids = random_ids(batch, length, seed=seed)
    labels = ids.clone()
    labels[:, :prompt] = -100  # completion positions carry streams, prompt positions do not
    return ids, labels


def _loss_and_grads(model, batches):
    model.train()
    model.zero_grad()
    loss = sum(model(ids, labels=labels).loss for ids, labels in batches)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_training(build, batches):
    """Loss and gradients with gradient checkpointing equal those without."""
    plain_loss, plain = _loss_and_grads(build(), batches)
    checkpointed = build()
    checkpointed.hf_model.gradient_checkpointing_enable()
    loss, grads = _loss_and_grads(checkpointed, batches)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    assert grads.keys() == plain.keys() and any(n.startswith("streams.") for n in grads)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["shared", "lossless"])
@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("adapters", [False, True])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(arch, mode, init, adapters):
    _assert_same_training(lambda: _streamed(arch, 1, mode, init, adapters), [_batch(1)])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_checkpointing_with_lora_and_two_forwards_before_one_backward(arch):
    """The row split travels with each layer call, so a recomputation sees its own forward's split
    even when another forward, with another split, ran in between."""
    ids, labels = _batch(2, length=11, prompt=6)
    batches = [_batch(2), (ids, labels)]
    _assert_same_training(lambda: _streamed(arch, 2, lora=True), batches)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("adapters", [False, True])
def test_lossless_main_logits_equal_the_base(arch, init, adapters):
    model = _streamed(arch, 3, "lossless", init, adapters)
    base = make_model(arch, 3)  # the same weights, never touched by add_streams
    ids = random_ids(2, 9, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    real = mask.bool()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    expected = reference_logits(base, ids, mask)
    torch.testing.assert_close(out.logits[real], expected[real], atol=1e-5, rtol=0)
    # the plain model's own forward, through the wrappers, is the base exactly
    assert torch.equal(reference_logits(model.base, ids, mask), expected)


def test_value_rotation_turns_stream_rows_only():
    """Stream j's value pairs turn by j·π/(γ+1) (a complex product), main rows are left bit for bit."""
    g, num_main, slots = 3, 5, 2
    linear = torch.nn.Linear(8, 8)
    rows = StreamRows()
    rotation = ValueRotation(linear, rows, g, None)
    x = torch.randn(2, num_main + slots * g, 8)
    assert torch.equal(rotation(x), linear(x))  # no split known: the base layer's output
    rows.num_main = num_main
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out, expected = rotation(x), linear(x)
        assert torch.equal(out[:, :num_main], expected[:, :num_main])
        angle = torch.arange(1, g + 1).repeat(slots) * (math.pi / (g + 1))
        turned = torch.view_as_complex(expected[:, num_main:].unflatten(-1, (-1, 2)).contiguous()) * torch.polar(
            torch.ones(()), angle
        )[:, None]
        torch.testing.assert_close(out[:, num_main:], torch.view_as_real(turned).flatten(-2))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_deepcopy_is_a_model_of_its_own(arch):
    model = _streamed(arch, 4, lora=True)
    twin = copy.deepcopy(model)
    ids, labels = _batch(4)
    with torch.no_grad():
        a, b = model(ids), twin(ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.stream_logits.nan_to_num(), b.stream_logits.nan_to_num())
    wrappers = [m for m in twin.modules() if isinstance(m, StreamModule)]
    assert wrappers and all(m.rows is twin._rows for m in wrappers)
    adapters = {id(p) for p in twin.streams.adapters.parameters()}
    assert all(id(m.pair.up.weight) in adapters for m in wrappers if isinstance(m, StreamAdapter))
    with torch.no_grad():  # the copy's weights are its own
        for p in twin.streams.adapters.parameters():
            p.mul_(2)
        assert torch.equal(model(ids).stream_logits.nan_to_num(), a.stream_logits.nan_to_num())
        assert not torch.equal(twin(ids).stream_logits.nan_to_num(), b.stream_logits.nan_to_num())
    _, grads = _loss_and_grads(twin, [(ids, labels)])
    assert any("lora_A" in n for n in grads) and any(n.startswith("streams.adapters.") for n in grads)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_after_streams_goes_inside_the_stream_modules(arch):
    model = _streamed(arch, 5, lora=True)
    value_path = model.arch.value_proj
    for layer in model.layers[model.num_lower_layers :]:
        value = layer.get_submodule(value_path)
        assert isinstance(value, StreamAdapter) and isinstance(value.base_layer, ValueRotation)
        assert isinstance(value.base_layer.base_layer, BaseTunerLayer)  # LoRA, inside the rotation
    for layer in model.layers[: model.num_lower_layers]:
        assert isinstance(layer.get_submodule(value_path), BaseTunerLayer)
        assert not any(isinstance(m, StreamModule) for m in layer.modules())
    ids, labels = _batch(5)
    _, grads = _loss_and_grads(model, [(ids, labels)])
    assert any("lora_A" in n for n in grads) and any(n.startswith("streams.adapters.") for n in grads)
    # merging the LoRA keeps the stream modules (peft merges the LoRA layer inside them)
    model.eval()
    with torch.no_grad():
        before = model(ids)
        model.base = model.base.merge_and_unload()
        after = model(ids)
    assert not model.has_lora and isinstance(model.layers[-1].get_submodule(value_path).base_layer, ValueRotation)
    torch.testing.assert_close(after.logits, before.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(after.stream_logits, before.stream_logits, atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_merged_save_is_a_plain_transformers_folder(arch, tmp_path):
    model = _streamed(arch, 6, lora=True)
    model.save_pretrained(tmp_path / "merged", merge=True)
    assert not any("base_layer" in k or "lora_" in k for k in load_file(tmp_path / "merged" / "model.safetensors"))
    plain, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="sdpa", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = random_ids(1, 8, seed=6)
    torch.testing.assert_close(reference_logits(plain.eval(), ids), reference_logits(model.base, ids), atol=1e-5, rtol=0)
    # saving left the model's own wrappers in place; the folder loads back as the same streamed model
    assert isinstance(model.layers[-1].get_submodule(model.arch.value_proj), StreamAdapter)
    with torch.no_grad():
        a, b = model(ids), load_streamed(tmp_path / "merged")(ids)
    torch.testing.assert_close(b.stream_logits, a.stream_logits, atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plain_state_dicts_load_and_adapters_save_in_peft_layout(arch, tmp_path):
    """A plain model's state dict (a merged checkpoint's base) loads strictly into the wrapped
    model; a LoRA adapter saved from a streamed model has peft's own layout and resumes into one."""
    model = _streamed(arch, 7)
    plain = make_model(arch, 8)
    result = model.hf_model.load_state_dict(plain.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = random_ids(1, 8, seed=7)
    assert torch.equal(reference_logits(model.base, ids), reference_logits(plain, ids))
    model.hf_model.load_state_dict(model.hf_model.state_dict(), strict=True)  # its own keys load too

    model = _streamed(arch, 7, lora=True)
    reference = _streamed(arch, 7, adapters=False, init="identity", lora=True)  # no wrappers at all
    for m, folder in ((model, "lora"), (reference, "reference")):
        m.config._name_or_path = "a-tiny-base"  # an adapter-only checkpoint records its base
        m.save_pretrained(tmp_path / folder)
    saved = load_file(tmp_path / "lora" / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == load_file(tmp_path / "reference" / "adapter" / "adapter_model.safetensors").keys()
    assert isinstance(model.layers[-1].get_submodule(model.arch.value_proj), StreamAdapter)  # back in place
    resumed = _streamed(arch, 9, lora=True)
    load_adapter_weights(resumed.base, tmp_path / "lora" / "adapter")  # the training-resume path
    lora = {n: p for n, p in model.base.named_parameters() if "lora_" in n}
    assert lora and all(torch.equal(p, dict(resumed.base.named_parameters())[n]) for n, p in lora.items())


# The stream weights' keys, as checkpoints written before the stream modules have them.
LINEARS = {
    "llama": ["self_attn-q_proj", "self_attn-k_proj", "self_attn-v_proj", "self_attn-o_proj",
              "mlp-gate_proj", "mlp-up_proj", "mlp-down_proj"],
    "gpt2": ["attn-c_attn", "attn-c_proj", "mlp-c_fc", "mlp-c_proj"],
}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_stream_weight_keys_are_those_of_earlier_checkpoints(arch, tmp_path):
    model = _streamed(arch, 10, mode="lossless", init="lowrank")
    expected = {"stream_embeddings", "init_down.weight", "init_up.weight", "exit_down.weight", "exit_up.weight"}
    expected |= {f"adapters.layers.{i}.{name}.{w}.weight" for i in (0, 1) for name in LINEARS[arch] for w in ("down", "up")}
    assert set(model.streams.state_dict()) == expected
    model.config._name_or_path = "a-tiny-base"
    model.save_pretrained(tmp_path / "ckpt")
    assert set(load_file(tmp_path / "ckpt" / "streams.safetensors")) == expected
    loaded = load_streamed(tmp_path / "ckpt", base_model=make_model(arch, 10))
    ids = random_ids(1, 8, seed=10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).stream_logits.nan_to_num(), model(ids).stream_logits.nan_to_num())


def test_decoding_with_stream_modules_is_exact():
    model = _streamed("llama", 11, mode="lossless")
    prompt = random_ids(1, 5, seed=11)
    reference = hf_greedy(make_model("llama", 11), prompt, 12)
    for k in (1, 3):
        assert torch.equal(generate(model, prompt, 12, tree_top_k=k).tokens, reference)


def test_a_layer_that_drops_the_row_split_is_refused():
    model = _streamed("llama", 12)
    model._stream_hooks[0].remove()  # as if the first MSA layer did not pass it to its attention
    with pytest.raises(RuntimeError, match="stream rows"):
        model(random_ids(1, 6, seed=12))


def test_stream_modules_can_be_taken_out_and_put_back():
    model = _streamed("gpt2", 13)
    ids = random_ids(1, 7, seed=13)
    with torch.no_grad():
        before = model(ids).stream_logits
        model.remove_stream_modules()
        assert not any(isinstance(m, StreamModule) for m in model.modules()) and not model._stream_hooks
        assert not torch.allclose(model(ids).stream_logits.nan_to_num(), before.nan_to_num())
        model.insert_stream_modules()
        model.insert_stream_modules()  # idempotent: never a wrapper around a wrapper of the same kind
        assert torch.equal(model(ids).stream_logits.nan_to_num(), before.nan_to_num())
    value = model.layers[-1].get_submodule(model.arch.value_proj)
    assert isinstance(value, StreamAdapter) and not isinstance(value.base_layer.base_layer, StreamModule)
