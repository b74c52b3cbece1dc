"""`eval/draft_accuracy.py`'s parts: the model's own greedy replies to held-out prompts, scored
teacher-forced (main, each stream, the chain)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamspec import StreamConfig, add_streams
from streamspec.data.build import prompt_ids
from streamspec.training.draft_accuracy import chain_passes, draft_accuracy, greedy_examples, tokens_a_pass


def test_replies_are_the_base_greedy_text_and_scores_do_not_depend_on_batching(tiny_dir, single_thread):
    torch.manual_seed(1)
    model = add_streams(AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa"),
                        StreamConfig(stream_layers=2, mode="lossless", stream_adapter_rank=4)).eval()
    with torch.no_grad():
        for p in model.streams.adapters.parameters():
            p.normal_(std=0.2)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    rows = [{"prompt": "How many singers are there?"}, {"prompt": "Name the oldest stadium and its city."}]
    examples = greedy_examples(model.hf_model, tokenizer, rows, max_new_tokens=7, show_progress=False)
    for row, example in zip(rows, examples):
        prompt = prompt_ids(tokenizer, row)
        n = prompt.shape[1]
        with torch.no_grad():  # the streamed model's main rows are the base's: its replies are the base's
            reply = fresh.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7, do_sample=False,
                                   pad_token_id=tokenizer.eos_token_id)[0, n:].tolist()
        assert example["input_ids"] == prompt[0].tolist() + reply
        assert example["labels"] == [-100] * n + reply
    pad = tokenizer.eos_token_id
    one, both = draft_accuracy(model, examples, pad, batch_size=1), draft_accuracy(model, examples, pad, batch_size=2)
    assert one == pytest.approx(both, rel=1e-5)  # padding a batch changes nothing
    assert one["main_top1"] == 1.0  # the replies are the model's own greedy tokens
    assert one["chain_3_top1"] <= one["chain_2_top1"] <= min(one["stream_1_top1"], one["stream_2_top1"])
    assert tokens_a_pass(one) == pytest.approx(1 + one["stream_1_top1"] + one["chain_2_top1"] + one["chain_3_top1"])
    assert tokens_a_pass({"head_1_top1": 0.5}) is None
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        greedy_examples(model.hf_model, tokenizer, rows, max_new_tokens=0)
    with pytest.raises(ValueError, match="no examples"):
        draft_accuracy(model, [], pad)


def test_a_chain_pass_adds_the_leading_run_of_right_drafts():
    """chain_passes walks the text as a greedy chain decodes it: the prefill's one token, then per
    pass 1 + the right drafts in a row at the last accepted position, until the reply is out."""
    bits = lambda rows: torch.tensor(rows, dtype=torch.bool)  # noqa: E731  [position, stream]
    # positions 0-1 the prompt (1 its last), 2.. the reply; γ = 2
    right = bits([[0, 0], [1, 1], [0, 1], [1, 0], [0, 0], [1, 1], [0, 0], [0, 0], [0, 0]])
    has = torch.ones_like(right)
    # prefill → reply token 1; pass 2 from position 1: both drafts right → 3 more (4 out), next slot 4;
    # pass 3 from 4: none → 1 (5 out), slot 5; pass 4 from 5: both → 3 (8 out)
    assert chain_passes(right, has, last_prompt=1, reply=7) == 4
    assert chain_passes(right, has, last_prompt=1, reply=1) == 1  # the prefill's token alone
    has[5, 0] = False  # no target for stream 1 there (past the reply's end): nothing accepted from 5
    assert chain_passes(right, has, last_prompt=1, reply=7) == 5
