"""The real default model (SmolLM2-135M-Instruct, offline) on real text (Spider questions)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from streamspec import StreamConfig, add_streams, load_default_model, load_default_tokenizer
from streamspec.data import load_spider, sql_prompt
from streamspec.patch.layout import position_ids_from_mask


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def base():
    return load_default_model()


def _batch(tokenizer, indices, padding_side="right"):
    """Chat-formatted Spider prompts + gold SQL; labels cover the SQL (and end-of-turn) only."""
    rows = load_spider()
    ids, labels = [], []
    for i in indices:
        messages = [{"role": "user", "content": sql_prompt(rows[i]["schema"], rows[i]["question"])}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        p = tokenizer(prompt, add_special_tokens=False).input_ids
        c = tokenizer(rows[i]["query"] + tokenizer.eos_token, add_special_tokens=False).input_ids
        ids.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    def fill(seq, value):
        gap = [value] * (width - len(seq))
        return seq + gap if padding_side == "right" else gap + seq
    input_ids = torch.tensor([fill(s, pad) for s in ids])
    attention_mask = torch.tensor([fill([1] * len(s), 0) for s in ids])
    return input_ids, attention_mask, torch.tensor([fill(s, -100) for s in labels])


def test_parameter_overhead_matches_readme(base):
    model = add_streams(base, StreamConfig())
    # README: 3·576 stream vectors + 2·576·8 early-exit adapter = 10,944.
    assert model.num_stream_parameters() == 3 * 576 + 2 * 576 * 8 == 10_944


def test_lossless_equals_base_on_real_text(base, tokenizer):
    ids, mask, _ = _batch(tokenizer, [0, 40], padding_side="left")
    model = add_streams(base, StreamConfig(mode="lossless")).eval()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        ref = base(ids, attention_mask=mask, position_ids=position_ids_from_mask(mask.bool())).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours[real].argmax(-1), ref[real].argmax(-1))
    assert not any(p.requires_grad for p in base.parameters())
    for p in base.parameters():  # the fixture is shared: leave the base as we found it
        p.requires_grad_(True)


@pytest.fixture(scope="module")
def trained(tokenizer):
    """SmolLM2 with shared-mode streams and LoRA after 6 steps on two Spider examples, and the
    losses of every step."""
    torch.manual_seed(0)
    ids, mask, labels = _batch(tokenizer, [0, 7])
    model = add_streams(load_default_model(), StreamConfig(mode="shared"))  # own copy: LoRA mutates it
    model.add_lora(LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    history = []
    for _ in range(6):
        out = model(ids, attention_mask=mask, labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        history.append({"loss": out.loss.item(), **{k: v.item() for k, v in out.loss_parts.items()}})
    return model.eval(), history


def test_shared_mode_training_lowers_loss_on_real_text(trained):
    model, history = trained
    first, last = history[0], history[-1]
    assert last["loss"] < 0.8 * first["loss"], history
    for part in ("stream_1", "stream_2", "stream_3", "early_exit"):
        assert last[part] < first[part], (part, history)
    # The LoRA and the stream parameters both moved; the frozen base did not get gradients.
    assert model.streams.stream_embeddings.grad is not None
    assert any("lora_" in n and p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters())
    assert all(p.grad is None for n, p in model.base.named_parameters() if "lora_" not in n)


def test_trained_checkpoint_decodes_exactly(trained, tokenizer, tmp_path):
    """The fine-tuned SmolLM2, saved and reloaded with its LoRA merged: speculative decoding with
    a chain, a tree and a pruned tree gives exactly its one-token-per-pass output on held-out
    Spider questions; sampling with a seed is reproducible."""
    from streamspec import load_streamed
    from streamspec.data.build import format_prompt
    from streamspec.decoding import generate

    model, _ = trained
    model.save_pretrained(tmp_path / "ckpt")
    merged = load_streamed(tmp_path / "ckpt", merge_lora=True)
    rows = load_spider("test")
    for row in (rows[0], rows[100]):
        ids = tokenizer(format_prompt(tokenizer, row), return_tensors="pt", add_special_tokens=False).input_ids
        reference = generate(merged, ids, 20, speculative=False).tokens
        with torch.no_grad():  # merging LoRA keeps the model's greedy choices on this text
            assert torch.equal(reference, generate(model, ids, 20, speculative=False).tokens)
        for kwargs in (dict(tree_top_k=1), dict(tree_top_k=3), dict(tree_top_k=3, prune_threshold=0.05)):
            out = generate(merged, ids, 20, **kwargs)
            assert torch.equal(out.tokens, reference), kwargs
        first = generate(merged, ids, 12, temperature=0.8, top_p=0.95, seed=3).tokens
        assert torch.equal(first, generate(merged, ids, 12, temperature=0.8, top_p=0.95, seed=3).tokens)


def test_demo_introduction_shows_overhead_and_lossless_check(capsys):
    from streamspec.demo import introduce

    numbers = introduce()
    shown = capsys.readouterr().out
    assert numbers["added_parameters"] == 10_944 and "10,944" in shown
    assert numbers["lossless_max_diff"] < 1e-3
    for line in ("main     predicts t+1", "stream 1 predicts t+2", "stream 3 predicts t+4", "early exit"):
        assert line in shown


@pytest.mark.parametrize("name", ["smollm2-135m-sql-streams", "smollm2-135m-summarize-streams",
                                  "smollm2-135m-reason-streams"])
def test_shipped_streams_load_by_name_and_keep_the_base_exact(base, tokenizer, name):
    """The stream weights in streamspec/weights/ (what `make demo` benchmarks) load by name for
    the default model, strictly, and decode the base model's own tokens with fewer passes."""
    from streamspec.assets import shipped_streams_path
    from streamspec.data.aclsum import load_aclsum
    from streamspec.decoding.generate import generate
    from streamspec.data.build import prompt_ids
    from streamspec.loading import load_for_inference

    loaded = load_for_inference(f"streamspec:{name}", device="cpu", dtype="float32", cpu_kernels=False)
    assert loaded.streamed and loaded.model.stream_config.mode == "lossless"
    assert loaded.source == str(shipped_streams_path(name))
    if "reason" in name:  # the drafter's own prompt: a GSM8K evaluation problem in SpecReason's framing
        from streamspec.data.reasoning import solve_message
        from streamspec.reason.tasks import load_problems

        problem = load_problems(task="gsm8k", limit=1)[0].question
        text = tokenizer.apply_chat_template([{"role": "user", "content": solve_message(problem)}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    else:
        ids = prompt_ids(tokenizer, (load_spider("test") if "sql" in name else load_aclsum("test"))[3])
    plain = base.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    out = generate(loaded.model, ids, 24, tree_top_k=(2, 1, 1), eos_token_id=eos)
    assert out.tokens[0].tolist() == plain[: out.tokens.shape[1]] and out.tokens.shape[1] == min(len(plain), 24)
    assert out.forward_passes < out.tokens.shape[1]  # trained streams: more than one token per pass


def test_teacher_forced_drafts_give_the_decoded_chain_pass_for_pass(tokenizer):
    """`eval/draft_accuracy.py`'s simulated chain: from the shipped SQL streams' teacher-forced hits
    on the model's own replies, the passes a greedy chain takes, equal to `generate`'s own count
    (tree_top_k 1) reply for reply: offline equals online."""
    from streamspec.data.build import prompt_ids
    from streamspec.decoding.generate import generate
    from streamspec.evaluation.benchmark import held_out_rows
    from streamspec.training.draft_accuracy import chain_crr, chain_passes, greedy_examples
    from streamspec.loading import load_for_inference

    loaded = load_for_inference("streamspec:smollm2-135m-sql-streams", device="cpu", dtype="float32", cpu_kernels=False)
    rows = held_out_rows("sql")[1:3]
    examples = greedy_examples(loaded.model.hf_model, tokenizer, rows, 40, show_progress=False)
    tokens = passes = 0
    for row, example in zip(rows, examples):
        ids = prompt_ids(tokenizer, row)
        out = generate(loaded.model, ids, 40, tree_top_k=1, eos_token_id=tokenizer.eos_token_id)
        assert out.tokens[0].tolist() == example["input_ids"][ids.shape[1]:]
        full, labels = torch.tensor([example["input_ids"]]), torch.tensor([example["labels"]])
        right, has_target = loaded.model.stream_hits(full, None, labels)
        assert chain_passes(right[0], has_target[0], ids.shape[1] - 1, out.tokens.shape[1]) == out.forward_passes
        assert out.forward_passes < out.tokens.shape[1]  # drafts were accepted: the walk is not trivial
        tokens, passes = tokens + out.tokens.shape[1], passes + out.forward_passes
    assert chain_crr(loaded.model, examples) == pytest.approx(tokens / passes)


def test_the_shipped_streams_for_vllm_read_the_next_token(base, tokenizer):
    """``smollm2-135m-sql-vllm-streams`` (vLLM's DFlash drafter; tests/vllm runs it there) loads by
    name for the default model and reads the token after each position: streamspec's own decoders,
    which draft before that token is known, refuse it saying so; its main rows are the base's."""
    from streamspec import load_streamed
    from streamspec.data.build import prompt_ids
    from streamspec.decoding.generate import generate

    model = load_streamed("streamspec:smollm2-135m-sql-vllm-streams", dtype=torch.float32)
    assert model.stream_config.next_token_input and model.stream_config.mode == "lossless"
    ids = prompt_ids(tokenizer, load_spider("test")[3])
    with torch.no_grad():
        out = model(ids, streams_at="all")
        plain = base(ids).logits
    torch.testing.assert_close(out.logits, plain, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="read the token after each position"):
        generate(model, ids, 4)


def test_offline_training_gives_the_online_loss_and_gradients(base, tokenizer):
    """Offline training (stored activations, `data.cache_activations`) on the real model and real
    Spider text: the same loss parts and stream gradients as the online forward."""
    from streamspec.training.activations import ActivationCollator, compute_activations, with_activation_index

    input_ids, attention_mask, labels = _batch(tokenizer, [0, 5])
    rows = [{"input_ids": ids[m.bool()].tolist(), "labels": lab[m.bool()].tolist()}
            for ids, m, lab in zip(input_ids, attention_mask, labels)]
    model = add_streams(base, StreamConfig(mode="lossless", main_weight=0.0, stream_adapter_rank=8,
                                           stream_targets="main"))
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.streams.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        stored = compute_activations(model, input_ids, attention_mask, labels)

        class Store:
            folder = "memory"

            def __getitem__(self, i):
                return stored[i]

        batch = ActivationCollator(tokenizer.pad_token_id, Store())(with_activation_index(rows))
        results = []
        for inputs in ({k: v for k, v in batch.items() if k != "activations"}, batch):
            model.zero_grad(set_to_none=True)
            out = model(**inputs)
            out.loss.backward()
            results.append((out, {n: p.grad.clone() for n, p in model.streams.named_parameters() if p.grad is not None}))
        (online, online_grads), (offline, offline_grads) = results
        for name, value in online.loss_parts.items():
            assert torch.allclose(offline.loss_parts[name], value, rtol=1e-4, atol=1e-4), name
        assert online_grads and set(online_grads) == set(offline_grads)
        for name, grad in online_grads.items():
            assert torch.allclose(offline_grads[name], grad, rtol=1e-3, atol=1e-5 * grad.abs().max()), name
    finally:
        model.remove_stream_modules()  # the module's `base` fixture is shared
