"""A merged export loads as the plain model with AutoModelForCausalLM and carries
custom_generate/, so that `model.generate(..., custom_generate=folder)` decodes with speculative
streaming: the same tokens as streamspec's own generate, in fewer passes; plain `model.generate`
stays transformers' own. A tiny random Llama (the SmolLM2 tokenizer), and the default model with
its shipped streams (slow)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamspec import StreamConfig, add_streams, load_streamed
from streamspec.custom_generate import _streamed
from streamspec.decoding import generate

pytestmark = pytest.mark.usefixtures("single_thread")


def _check(folder, prompt: torch.Tensor, new: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert (folder / "custom_generate" / "generate.py").is_file()
    assert "streamspec" in (folder / "custom_generate" / "requirements.txt").read_text()
    plain = model.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, min_new_tokens=new)
    custom = model.generate(prompt, custom_generate=str(folder), trust_remote_code=True, max_new_tokens=new,
                            eos_token_id=None)
    own = generate(load_streamed(folder).eval(), prompt, new, eos_token_id=None)
    assert torch.equal(custom[:, : prompt.shape[1]], prompt)
    assert custom[0, prompt.shape[1]:].tolist() == own.tokens[0].tolist()
    # lossless streams: the base's own tokens, which plain generate (untouched) still returns
    assert plain[0, prompt.shape[1]:].tolist() == own.tokens[0].tolist()
    assert _streamed(model).hf_model is model  # the streams were put on this very model, once
    with pytest.raises(ValueError, match="trust_remote_code"):
        model.generate(prompt, custom_generate=str(folder), max_new_tokens=2)


def test_merged_export_decodes_through_custom_generate(tiny_dir, tmp_path):
    from streamspec.assets import load_tokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    streamed = add_streams(base, StreamConfig(num_streams=2, stream_layers=2, mode="lossless"))
    with torch.no_grad():
        for p in streamed.streams.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = streamed.save_pretrained(tmp_path / "merged", merge=True, tokenizer=load_tokenizer(str(tiny_dir)))
    prompt = torch.randint(0, base.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    _check(folder, prompt, 10)
    other = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="merged streamspec export"):
        other.generate(prompt, custom_generate=str(folder), trust_remote_code=True, max_new_tokens=2)


def test_shipped_streams_export_merged_and_decode_through_custom_generate(tmp_path):
    from streamspec.assets import load_default_tokenizer
    from streamspec.patch.checkpoint import export_checkpoint

    folder = export_checkpoint("streamspec:smollm2-135m-sql-streams", tmp_path / "merged", merge=True)
    tokenizer = load_default_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List the names of all singers."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    _check(folder, prompt, 16)
