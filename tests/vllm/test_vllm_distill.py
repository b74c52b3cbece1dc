"""Distillation through vLLM's offline engine (its CPU build, in `make vllm`'s environment): the
greedy text of a tiny random Llama saved with the SmolLM2 tokenizer equals transformers' greedy
`generate` on the same prompt ids, turn 2 of each chat is prompted with the model's own turn-1
reply, and a run after a shard is lost rewrites that shard identically, the others untouched. One
vLLM process, one engine, for both runs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from streamspec.assets import load_default_tokenizer, load_tokenizer
from streamspec.data.build import format_prompt
from streamspec.data.distill import read_distilled
from streamspec.data.distill_shards import MANIFEST, ShardedDistillArgs, shard_path
from streamspec.training.distill_engine import ShardedRun, stop_token_ids
from streamspec.vllm.client import VLLMGenerator, vllm_python

try:
    vllm_python()
except FileNotFoundError as err:  # `make test` builds the environment first
    pytest.skip(str(err), allow_module_level=True)

NEW_TOKENS = 8
QUESTIONS = [("Hi there, how are you?", "What did you do today?"), ("Name a colour.", "Why that one?"),
             ("What is 2 + 2?", "And times 3?"), ("Tell me a joke.", "Another one?"),
             ("Where is Paris?", "Is it big?"), ("Say something nice.", "Thanks! Anything else?")]


def tiny_chat_base(folder):
    """A tiny random Llama with the SmolLM2 tokenizer (its chat template), wide enough for vLLM's
    CPU attention kernels (head size 32)."""
    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)  # (tied, small weights: every reply repeats the prompt's last token)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_vllm_distils_greedy_chats_into_shards_and_resumes(tmp_path):
    base = tiny_chat_base(tmp_path / "tiny")
    tokenizer = load_tokenizer(str(base))
    stops = stop_token_ids(tokenizer, base)
    conversations = [{"source": "chat", "id": f"c{i}", "turns": list(turns)} for i, turns in enumerate(QUESTIONS)]
    args = ShardedDistillArgs(sources=["chat"], shard_size=3, max_new_tokens=NEW_TOKENS)
    out = tmp_path / "set"

    def distil(engine):
        runner = ShardedRun(out, str(base), args, conversations, tokenizer, stops, command="test")
        return runner.run(engine, progress=False, max_num_seqs=4)

    with VLLMGenerator(base, log=tmp_path / "engine.log", max_num_seqs=4, threads=1, max_model_len=512) as engine:
        summary = distil(engine)
        assert summary["shards"] == 2 and summary["rows"] == 12
        texts = [shard_path(out, i).read_bytes() for i in range(2)]
        stamp = shard_path(out, 0).stat().st_mtime_ns
        shard_path(out, 1).unlink()
        again = distil(engine)
    assert again["conversations"] == 3 and again["rows"] == 6  # shard 2 only
    assert [shard_path(out, i).read_bytes() for i in range(2)] == texts
    assert shard_path(out, 0).stat().st_mtime_ns == stamp
    assert len(json.loads((out / MANIFEST).read_text())["runs"]) == 2

    rows = read_distilled(out)
    assert [(r["conversation"], r["turn"]) for r in rows] == [(f"c{i}", k) for i in range(6) for k in (0, 1)]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for row in rows:
        ids = torch.tensor([tokenizer(format_prompt(tokenizer, row), add_special_tokens=False).input_ids])
        assert row["prompt_tokens"] == ids.shape[1]
        with torch.no_grad():
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       do_sample=False, eos_token_id=stops, pad_token_id=2)
        assert row["completion_ids"] == reference[0, ids.shape[1]:].tolist(), (row["conversation"], row["turn"])
    for first, second in zip(rows[::2], rows[1::2]):
        reply = {"role": "assistant", "content": first["completion"]}
        assert second["messages"][:3] == [first["messages"][0], reply, second["messages"][2]]
        assert first["completion"] and first["completion"] in format_prompt(tokenizer, second)
