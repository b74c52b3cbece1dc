"""`make demo` / `streamspec demo`: what a user should see first.

Loads the default model (SmolLM2-135M-Instruct, offline), adds streams, and shows the parameter
overhead, that lossless mode reproduces the base exactly, and one forward pass's main and stream
predictions on a real Spider question. Later stages (train → export → benchmark) grow here.
"""

from __future__ import annotations

import torch

from .assets import load_default_model, load_default_tokenizer
from .config import StreamConfig
from .data import load_spider, sql_prompt
from .layout import position_ids_from_mask
from .model import add_streams


def run_demo(example_index: int = 0) -> dict:
    """Print the demo and return its numbers."""
    torch.manual_seed(0)
    tokenizer = load_default_tokenizer()
    base = load_default_model()
    config = StreamConfig()
    model = add_streams(base, config).eval()
    base_params = sum(p.numel() for p in base.parameters())
    added = model.num_stream_parameters()
    print(f"model: SmolLM2-135M-Instruct ({base_params:,} parameters, {base.config.num_hidden_layers} layers)")
    print(
        f"streams: γ={config.num_streams} in the top Ns={config.stream_layers} layers, mode={config.mode}; "
        f"added parameters: {added:,} ({100 * added / base_params:.4f}% of the base)"
    )

    example = load_spider()[example_index]
    messages = [{"role": "user", "content": sql_prompt(example["schema"], example["question"])}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text += example["query"]  # teacher-force the gold SQL so every position has a known future
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    print(f"\nprompt: Spider '{example['db_id']}' — {example['question']!r} ({ids.shape[1]} tokens with the gold SQL)")

    with torch.no_grad():
        out = model(ids)
        lossless = add_streams(base, StreamConfig(mode="lossless")).eval()
        diff = (lossless(ids).logits - base(ids, position_ids=position_ids_from_mask(torch.ones_like(ids, dtype=torch.bool))).logits).abs().max().item()
    print(f"lossless mode: max |logits − base logits| = {diff:.2e} (the base model's outputs, up to fp32 rounding)")

    # Read predictions at the position just before the SQL's 4th token.
    prompt_len = len(tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids)
    t = prompt_len + 2
    show = lambda token_id: repr(tokenizer.decode([int(token_id)]))  # noqa: E731
    print(f"\nat position {t} (after {tokenizer.decode(ids[0, prompt_len:t + 1])!r}):")
    print(f"  main     predicts t+1: {show(out.logits[0, t].argmax())}   (truth {show(ids[0, t + 1])})")
    for j in range(config.num_streams):
        truth = ids[0, t + 2 + j] if t + 2 + j < ids.shape[1] else None
        print(
            f"  stream {j + 1} predicts t+{j + 2}: {show(out.stream_logits[0, t, j].argmax())}   "
            f"(truth {show(truth) if truth is not None else '-'})"
        )
    print(f"  early exit (layer {model.num_lower_layers}) predicts t+1: {show(out.early_exit_logits[0, t].argmax())}")
    print("\nThe streams are untrained here: fine-tuning teaches stream j to predict the token j+1 steps ahead.")
    return {"base_parameters": base_params, "added_parameters": added, "lossless_max_diff": diff}
