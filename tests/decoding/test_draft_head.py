"""Drafting through a bfloat16 copy of the LM head (`DecoderParts.use_bf16_draft_head`): the tokens a
float32 model decodes are its own (the drafts are only guesses the float32 head verifies), the
copy's logits are the head's up to bf16 rounding, it is never part of the state dict, it follows
the LM head when that changes, and `load_for_inference` turns it on only where it applies."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, random_ids
from streamspec import StreamConfig, add_streams, native
from streamspec.decoding import generate, generate_autoregressive
from streamspec.kernels import pack_linear_layers, packed_dtypes, use_decode_attention
from streamspec.loading import load_for_inference

pytestmark = pytest.mark.skipif(not native.cpu_has_avx512_bf16() or torch.bfloat16 not in packed_dtypes(),
                                reason="streamspec's bf16 kernels do not run on this CPU")


def _streamed(arch: str = "llama"):
    torch.manual_seed(0)
    model = add_streams(make_model(arch), StreamConfig(num_streams=3, stream_layers=2)).eval()
    with torch.no_grad():  # streams that agree with the main stream now and then
        model.streams.stream_embeddings.mul_(0.1)
    pack_linear_layers(model)
    use_decode_attention(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_drafts_decode_the_models_own_tokens(arch):
    model = _streamed(arch)
    ids = random_ids(1, 12, seed=3)
    reference = generate_autoregressive(model, ids, 40).tolist()
    plain = generate(model, ids, 40, tree_top_k=(2, 1, 1))
    keys = set(model.state_dict())
    assert model.use_bf16_draft_head()
    assert set(model.state_dict()) == keys  # the copy is not saved with the model
    for options in (dict(tree_top_k=(2, 1, 1)), dict(tree_top_k=1), dict(tree_top_k=3, tree_budget=7)):
        out = generate(model, ids, 40, **options)
        assert out.tokens.tolist() == reference, options
    assert plain.tokens.tolist() == reference
    compiled = generate(model, ids, 40, tree_top_k=(2, 1, 1), compile="aot_eager")
    assert compiled.tokens.tolist() == reference
    assert compiled.accepted_per_pass == generate(model, ids, 40, tree_top_k=(2, 1, 1)).accepted_per_pass


def test_the_draft_head_is_the_lm_head_up_to_bf16_and_follows_it():
    model = _streamed()
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(model.draft_head(hidden), model.head(hidden))  # off: the head itself
        assert model.use_bf16_draft_head()
        drafted, exact = model.draft_head(hidden), model.head(hidden)
        assert drafted.dtype == torch.float32 and not torch.equal(drafted, exact)
        torch.testing.assert_close(drafted, exact, rtol=0.05, atol=0.05)
        model.hf_model.get_output_embeddings().weight.mul_(2.0)  # changed in place: copied again
        torch.testing.assert_close(model.draft_head(hidden), model.head(hidden), rtol=0.05, atol=0.1)
        moved = _streamed()
        assert moved.use_bf16_draft_head()
        moved.to(torch.bfloat16)  # a cast replaces the head's weight: the copy is dropped, not misused
        assert torch.equal(moved.draft_head(hidden.bfloat16()), moved.head(hidden.bfloat16()))
        moved.to(torch.float32)  # back: copied again from the weight it now has
        again, exact = moved.draft_head(hidden), moved.head(hidden)
        assert not torch.equal(again, exact)
        torch.testing.assert_close(again, exact, rtol=0.05, atol=0.05)
        assert not model.use_bf16_draft_head(False)
        assert torch.equal(model.draft_head(hidden), model.head(hidden))
        half = _streamed().to(torch.bfloat16)
        assert not half.use_bf16_draft_head()  # a bf16 model drafts with its own head
        assert torch.equal(half.draft_head(hidden.bfloat16()), half.head(hidden.bfloat16()))


def test_load_for_inference_drafts_in_bf16_for_float32_on_the_cpu(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    streamed = add_streams(base, StreamConfig(stream_layers=2))
    streamed.save_pretrained(tmp_path / "ckpt", tokenizer=load_for_inference(tiny_dir, cpu_kernels=False).tokenizer)
    assert "_bf16_draft_head" in load_for_inference(tmp_path / "ckpt", dtype="float32").model.__dict__
    assert "_bf16_draft_head" not in load_for_inference(tmp_path / "ckpt", dtype="float32",
                                                        bf16_draft_head=False).model.__dict__
    assert "_bf16_draft_head" not in load_for_inference(tmp_path / "ckpt", dtype="bfloat16").model.__dict__
    assert "_bf16_draft_head" not in load_for_inference(tmp_path / "ckpt", dtype="float32",
                                                        cpu_kernels=False).model.__dict__


def test_a_compiled_draft_head_tells_a_model_with_the_copy_from_one_without():
    """The copy is read through an attribute compiled graphs guard on: the same compiled function
    over a model drafting in bf16 and one without gives each its own logits, never the other's graph."""
    with_copy, without = _streamed(), _streamed()
    assert with_copy.use_bf16_draft_head()
    hidden = torch.randn(3, without.config.hidden_size)
    step = torch.compile(lambda model, h: model.draft_head(h), backend="aot_eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        plain, drafted = step(without, hidden), step(with_copy, hidden)
        assert torch.equal(plain, without.head(hidden))
        assert torch.equal(drafted, with_copy.draft_head(hidden))
        assert not torch.equal(drafted, plain)
