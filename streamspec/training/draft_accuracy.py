"""Each draft's top-1 against a model's own tokens, teacher-forced: validation rows of a recipe,
or the model's own greedy replies to a task's held-out prompts (``eval/draft_accuracy.py``).

On held-out prompts the figures say, without timing anything, how often a chain's drafts would be
accepted there (``chain_j_top1``: streams 1..j all right at one position) and how far that is
from what the validation slice promised: a gap between the two is the text, not the decoder.
"""

from __future__ import annotations

import torch

from ..data.build import PadCollator, prompt_ids
from .trainer import evaluation_counts, summarize_counts


@torch.no_grad()
def greedy_examples(model, tokenizer, rows: list[dict], max_new_tokens: int, show_progress: bool = True) -> list[dict]:
    """`model`'s greedy replies to `rows`' prompts (each ending at its end of sequence or after
    `max_new_tokens`) as examples to score: ``input_ids`` (the prompt in the chat template, then
    the reply) and ``labels`` (-100 on the prompt)."""
    from tqdm import tqdm

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = []
    for row in tqdm(rows, desc="greedy replies", unit="prompt", disable=not show_progress):
        ids = prompt_ids(tokenizer, row)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
        reply = out[0, ids.shape[1]:].tolist()
        examples.append({"input_ids": ids[0].tolist() + reply, "labels": [-100] * ids.shape[1] + reply})
    return examples


@torch.no_grad()
def draft_accuracy(model, examples: list[dict], pad_id: int, batch_size: int = 8) -> dict[str, float]:
    """`streamspec.training.trainer.summarize_counts` of `model` on `examples` (``input_ids`` and
    ``labels``): main, each draft's and the chain's top-1 (and losses)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not examples:
        raise ValueError("no examples to score")
    collate = PadCollator(pad_id)
    sums: dict[str, float] = {}
    for i in range(0, len(examples), batch_size):
        for key, value in evaluation_counts(model, collate(examples[i : i + batch_size])).items():
            sums[key] = sums.get(key, 0.0) + value
    return summarize_counts(sums)


def chain_passes(right: torch.Tensor, has_target: torch.Tensor, last_prompt: int, reply: int) -> int:
    """The passes a greedy chain (one draft per stream, `streamspec.decoding`) takes to decode a
    reply of `reply` tokens, from one sequence's `StreamedModel.stream_hits` ([length, γ] each):
    the prefill gives the first token and its streams at the prompt's last position (`last_prompt`)
    draft the next; each pass adds 1 + the leading run of right drafts, and the next drafts come
    from the streams at the last position it accepted."""
    num_streams = right.shape[1]
    passes, produced, slot = 1, 1, last_prompt
    while produced < reply:
        accepted = 0
        while accepted < num_streams and has_target[slot, accepted] and right[slot, accepted]:
            accepted += 1
        passes += 1
        produced += 1 + accepted
        slot += 1 + accepted
    return passes


@torch.no_grad()
def chain_crr(model, examples: list[dict]) -> float:
    """The CRR (tokens a pass, prefill included) a greedy chain of `model`'s streams reaches on
    `examples` (the model's own replies, `greedy_examples`), simulated from their teacher-forced
    drafts: what `streamspec.generate` with ``tree_top_k=1`` measures on those prompts."""
    tokens = passes = 0
    for example in examples:
        ids, labels = torch.tensor([example["input_ids"]]), torch.tensor([example["labels"]])
        reply = int((labels != -100).sum())
        if not reply:
            continue
        right, has_target = model.stream_hits(ids, torch.ones_like(ids), labels)
        tokens += reply
        passes += chain_passes(right[0], has_target[0], ids.shape[1] - reply - 1, reply)
    if not passes:
        raise ValueError("no example has a reply to decode")
    return tokens / passes


def tokens_a_pass(metrics: dict[str, float]) -> float | None:
    """A greedy chain's tokens a pass averaged over the positions of the scored text: 1 + stream
    1's top-1 + each chain_j's (None for drafts without a chain, e.g. Medusa heads). Passes skip
    the positions they accept, so where right drafts come in runs a chain's CRR (`chain_crr`) is
    below this average."""
    if "stream_1_top1" not in metrics:
        return None
    chains = sorted(int(k.split("_")[1]) for k in metrics if k.startswith("chain_") and k.endswith("_top1"))
    return 1.0 + metrics["stream_1_top1"] + sum(metrics[f"chain_{j}_top1"] for j in chains)
