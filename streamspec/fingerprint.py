"""Telling one base model from another of the same shape, with nothing but the standard library
(the vLLM drafter runs this inside vLLM's own environment)."""

from __future__ import annotations


def same_fingerprint(recorded: list[float], actual: list[float]) -> bool:
    """Whether two base fingerprints (sums of embedding rows, `streamspec.patch.saving.base_fingerprint`)
    name the same weights: tolerances that a dtype change passes (bf16 rounds each weight by
    <0.4%) and another model does not."""
    scale = max(max((abs(v) for v in recorded), default=0.0), 1e-6)
    return len(recorded) == len(actual) and all(abs(a - b) <= 0.02 * abs(a) + 1e-3 * scale
                                                for a, b in zip(recorded, actual))
