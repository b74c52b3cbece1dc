"""The drafter folder's format: what `streamspec.vllm.export` writes into config.json and what
`streamspec.vllm.drafter` checks against the model vLLM serves. Standard library only."""

from __future__ import annotations

from typing import Any

DRAFTER_FORMAT = "streamspec-vllm-drafter"
DRAFTER_FORMAT_VERSION = 1
# Set to a file path to check, at every drafter pass, that the main row at each request's last
# accepted position predicts the token the target has just sampled (true under greedy decoding
# when the layer id, the copied weights, the cache and the positions are right); one JSON line a
# pass is appended: {"checked": n, "agreed": m, "positions_ok": bool, "passes": [[p, drafts], ...]}.
ALIGNMENT_ENV = "STREAMSPEC_VLLM_ALIGNMENT"
# the base facts a drafter records and refuses to run against another value of
CHECKED = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")


def check_target(facts: dict[str, Any], target_config, target_layers: int) -> None:
    """Refuse a served model whose shape is not the drafter's base (`facts`: config.json's
    ``streamspec`` section). The weights themselves are compared when vLLM shares the target's
    embeddings with the drafter (`StreamsDrafter._check_base`)."""
    if facts.get("format_version") != DRAFTER_FORMAT_VERSION:
        raise ValueError(f"drafter folder format version {facts.get('format_version')!r}; this streamspec reads "
                         f"version {DRAFTER_FORMAT_VERSION}: export the drafter again")
    actual = {
        "model_type": getattr(target_config, "model_type", None),
        "hidden_size": getattr(target_config, "hidden_size", None),
        "num_hidden_layers": target_layers,
        "vocab_size": getattr(target_config, "vocab_size", None),
    }
    wrong = {k: (facts.get(k), v) for k, v in actual.items() if facts.get(k) != v}
    if wrong:
        details = ", ".join(f"{k}: drafter {a!r}, served {b!r}" for k, (a, b) in wrong.items())
        raise ValueError(f"the streams drafter was exported from {facts.get('base_name')!r}, which is not the model "
                         f"vLLM serves ({details}): export it from a checkpoint trained on the served model")


def recommended_drafts(num_streams: int) -> int:
    """``num_speculative_tokens`` that uses every stream: γ+1 (the row at the last accepted
    position and γ mask rows, one per stream; see `streamspec.vllm.drafter`)."""
    return num_streams + 1
