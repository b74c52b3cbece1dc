"""The training objective: next-token loss on the main stream, the future n-gram loss on each
stream (targets from the data or from the main stream itself), and the early-exit adapter's own
loss, computed only on rows with a target (METHOD §2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .loss import weighted_cross_entropy

if TYPE_CHECKING:
    from .model import StreamedModel


def loss_terms(model: "StreamedModel", lower, main, streams, index, valid, labels):
    """The loss terms ``(name, hidden, targets, weight, transform)``: main, each stream, and
    the early exit last. `transform` maps selected hidden rows to what the LM head takes."""
    cfg = model.stream_config
    batch = labels.shape[0]
    ignore = labels.new_full((batch, 1), -100)
    next_labels = torch.cat([labels[:, 1:], ignore], dim=1)  # target of position t is labels[t+1]
    norm = getattr(model.decoder, model.arch.norm)
    terms = [("main", main, next_labels, cfg.main_weight, norm)]
    # Stream j of the slot at position t predicts labels[t+1+j]; past the end there is none.
    targets_of = labels if cfg.stream_targets == "labels" else main_predictions(model, main, next_labels, norm)
    padded = torch.cat([targets_of, labels.new_full((batch, cfg.num_streams + 1), -100)], dim=1)
    for j, weight in enumerate(cfg.stream_weights, start=1):
        targets = padded.gather(1, index + 1 + j).masked_fill(~valid, -100)
        terms.append((f"stream_{j}", streams[:, :, j - 1], targets, weight, norm))
    terms.append(("early_exit", lower, next_labels, 1.0, model._early_exit_hidden))
    return terms


@torch.no_grad()
def main_predictions(model: "StreamedModel", main, next_labels, norm, chunk: int = 256):
    """For stream_targets='main': labels-shaped targets whose entry at position p is the main
    stream's top-1 prediction made at p−1 (for the token at p), -100 where the data has no
    target there."""
    keep = next_labels != -100
    rows = main[keep]
    head = model.hf_model.get_output_embeddings()
    predicted = torch.full_like(next_labels, -100)
    if rows.shape[0]:
        chunks = [head(norm(rows[i : i + chunk])).argmax(-1) for i in range(0, rows.shape[0], chunk)]
        predicted[keep] = torch.cat(chunks)
    return torch.cat([next_labels.new_full((next_labels.shape[0], 1), -100), predicted[:, :-1]], dim=1)


def total_loss(model: "StreamedModel", terms, chunk):
    """Weighted sum of the terms' cross-entropies, each a mean over its rows with a target;
    only those rows go through the LM head. The early-exit term (last) reaches only its
    adapter (see early_exit_head)."""
    head = model.hf_model.get_output_embeddings()
    loss, means = _term_losses(head, terms[:-1], chunk)
    exit_loss, exit_mean = _term_losses(head, terms[-1:], chunk, freeze_head=True)
    parts = {name: value for (name, *_), value in zip(terms, means + exit_mean)}
    return loss + exit_loss, parts


def _term_losses(head, terms, chunk, freeze_head=False):
    """Weighted sum over loss terms ``(name, hidden, targets, weight, transform)``, each term a mean
    over its rows with a target, in one pass through the head over those rows only. Returns the
    differentiable sum and each term's mean (detached)."""
    rows, targets, weights, counts = [], [], [], []
    for _, hidden, target, weight, transform in terms:
        keep = target != -100
        count = int(keep.sum())
        rows.append(transform(hidden[keep]))
        targets.append(target[keep])
        weights.append(hidden.new_full((count,), weight / max(count, 1), dtype=torch.float32))
        counts.append(count)
    loss, per_row = weighted_cross_entropy(
        head, torch.cat(rows), torch.cat(targets), torch.cat(weights), chunk, freeze_head=freeze_head
    )
    means = [(ce.sum() / max(count, 1)).detach() for ce, count in zip(per_row.split(counts), counts)]
    return loss, means
