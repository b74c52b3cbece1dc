"""The training objective: next-token loss on the main stream, the future n-gram loss on each
stream (targets from the data or from the main stream itself), and the early-exit adapter's own
loss, computed only on rows with a target (METHOD §2). `model` is a
`streamspec.patch.model.StreamedModel` (named by its base class: the model imports this module)."""

from __future__ import annotations

import torch

from .decoder import DecoderParts
from .loss import weighted_cross_entropy


def loss_terms(model: DecoderParts, lower, main, streams, index, valid, labels, own=None):
    """The loss terms ``(name, hidden, targets, weight, transform)``: main, each stream, and
    the early exit last. `transform` maps selected hidden rows to what the LM head takes.

    Offline training passes ``main=None`` (the main term is stored, see `offline_total_loss`) and
    `own`, the stored `main_predictions`."""
    cfg = model.stream_config
    batch = labels.shape[0]
    ignore = labels.new_full((batch, 1), -100)
    next_labels = torch.cat([labels[:, 1:], ignore], dim=1)  # target of position t is labels[t+1]
    norm = getattr(model.decoder, model.arch.norm)
    terms = [] if main is None else [("main", main, next_labels, cfg.main_weight, norm)]
    # Stream j of the slot at position t predicts labels[t+1+j]; past the end there is none.
    if cfg.stream_targets == "labels":
        targets_of = labels
    elif own is not None:
        targets_of = own
    elif main is not None:
        targets_of = main_predictions(model, main, labels, norm)
    else:
        raise ValueError("stream_targets='main' offline needs the stored main predictions ('own')")
    padded = torch.cat([targets_of, labels.new_full((batch, cfg.num_streams + 1), -100)], dim=1)
    for j, weight in enumerate(cfg.stream_weights, start=1):
        targets = padded.gather(1, index + 1 + j).masked_fill(~valid, -100)
        terms.append((f"stream_{j}", streams[:, :, j - 1], targets, weight, norm))
    terms.append(("early_exit", lower, next_labels, 1.0, model.early_exit_hidden))
    return terms


def main_predictions(model: DecoderParts, main, labels, norm, chunk: int = 256):
    """For stream_targets='main': labels-shaped targets whose entry at position p is the main
    stream's top-1 prediction made at p−1 (for the token at p), -100 where the data has no
    target there (`main_outputs`' ``own``, the head being `norm` then the LM head)."""
    head = model.hf_model.get_output_embeddings()
    return main_outputs(lambda rows: head(norm(rows)), main, labels, chunk)[1]


@torch.no_grad()
def main_outputs(head, final: torch.Tensor, labels: torch.Tensor, chunk: int = 256):
    """What the frozen main stream's term needs, from one LM-head call per `chunk` of the rows
    with a target: ``main_ce`` [B, T] float32, the main stream's CE at t for the token at t+1 (0
    without one), and ``own`` [B, T], its top-1 predictions at the positions they predict
    (`main_predictions`: the targets of ``stream_targets: main``; -100 without one). `head` maps
    final hidden states to logits (final norm included)."""
    next_labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    keep = next_labels != -100
    rows, targets = final[keep], next_labels[keep]
    main_ce = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    predicted = torch.full_like(next_labels, -100)
    if rows.shape[0]:
        ce, top = [], []
        for start in range(0, rows.shape[0], chunk):
            logits = head(rows[start : start + chunk]).float()
            ce.append(torch.nn.functional.cross_entropy(logits, targets[start : start + chunk], reduction="none"))
            top.append(logits.argmax(-1))
        main_ce[keep], predicted[keep] = torch.cat(ce), torch.cat(top)
    own = torch.cat([next_labels.new_full((labels.shape[0], 1), -100), predicted[:, :-1]], dim=1)
    return main_ce, own


def total_loss(model: DecoderParts, terms, chunk):
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


# ----------------------------------------------------------------------------- offline training
# Stored activations of a batch (`streamspec.training.activations.ActivationCollator`):
#   hidden [B, T, h]   at the input of layer N−Ns (streams) or after the last layer (Medusa
#                      heads), at the positions some loss term reads (zeros elsewhere);
#   main_ce [B, T]     float32, the main stream's CE at t for the token at t+1 (0 without one);
#   own [B, T]         `main_predictions` (-100 without one);
#   keys, values [B, Ns, kv_heads, T, head_dim]  the MSA layers' main keys and values (streams).
_STORED = ("hidden", "main_ce", "own")


def check_activations(activations: dict, shape: tuple[int, int], num_msa_layers: int | None) -> dict:
    """The batch's stored activations, checked against the batch's [B, T] shape."""
    if not isinstance(activations, dict):
        raise TypeError(f"activations must be a dict of tensors, got {type(activations).__name__}")
    wanted = _STORED + (("keys", "values") if num_msa_layers else ())
    missing = [k for k in wanted if k not in activations]
    if missing:
        raise ValueError(f"activations lack {missing} (have {sorted(activations)})")
    for name in wanted:
        got = tuple(activations[name].shape)
        ok = got[:2] == shape if name in _STORED else (len(got) == 5 and got[:2] == (shape[0], num_msa_layers)
                                                        and got[3] == shape[1])
        if not ok:
            raise ValueError(f"activations[{name!r}] has shape {got}, which does not fit a batch of shape {shape}"
                             + (f" with {num_msa_layers} MSA layers" if name not in _STORED else ""))
    return activations


def stored_main_mean(labels: torch.Tensor, stored: dict) -> torch.Tensor:
    """The main term's mean CE from the stored per-position CE (a constant: the base is frozen)."""
    keep = labels[:, 1:] != -100
    ce = stored["main_ce"][:, :-1][keep]
    return (ce.sum() / max(int(keep.sum()), 1)).detach()


def stored_main_counts(labels: torch.Tensor, stored: dict) -> dict[str, float]:
    """Validation sums of the main term (as `evaluate_counts` gives them) from stored values:
    the main stream's top-1 at t is ``own[t+1]``."""
    keep = labels[:, 1:] != -100
    correct = (stored["own"][:, 1:] == labels[:, 1:]) & keep
    return {"main_loss_sum": float(stored["main_ce"][:, :-1][keep].sum()), "main_correct": int(correct.sum()),
            "main_count": int(keep.sum())}


def offline_total_loss(model: DecoderParts, lower, streams, index, valid, labels, stored, carry, chunk):
    """`total_loss` from the frozen main stream's activations (stored, or computed for the batch
    in lossless mode: `TrainingForward.frozen_main`): the stream and early-exit terms computed, the
    main term read from the main stream's CE (with its weight: it adds a constant)."""
    terms = loss_terms(model, lower, None, streams, index, valid, labels, own=stored.get("own"))
    loss, parts = total_loss(model, terms, chunk)
    main = stored_main_mean(labels, stored)
    return loss + model.stream_config.main_weight * main, {"main": main, **parts}
