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
# The draft layouts a drafter folder is exported for (config.json's ``streamspec.layout``; a folder
# without one is "peagle"): vLLM's EAGLE-3 parallel drafting, K = γ+1 drafts with the last a filler
# (`streamspec.vllm.drafter`), or vLLM's DFlash proposer, K = γ drafts (`streamspec.vllm.dflash`).
# The default is DFlash: the same drafts and acceptance without the filler's verified row, and
# context rows that cost a key/value projection instead of Ns layers (docs/serving.md, measured).
PEAGLE, DFLASH = "peagle", "dflash"
LAYOUTS = (PEAGLE, DFLASH)
DEFAULT_LAYOUT = DFLASH
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


def recommended_drafts(num_streams: int, layout: str = PEAGLE) -> int:
    """``num_speculative_tokens`` that uses every stream: γ+1 in the P-EAGLE layout (the row at the
    last accepted position and γ mask rows, one per stream; see `streamspec.vllm.drafter`), γ in
    the DFlash layout (one draft per stream; `streamspec.vllm.dflash`)."""
    return num_streams + 1 if layout == PEAGLE else num_streams


def draft_range(num_streams: int, layout: str = PEAGLE, lookup: bool = False) -> tuple[int, int]:
    """The drafts a step the streams drafter can give (besides 0, no drafting): 2..γ+1 in the
    P-EAGLE layout (1 would be the filler alone), 1..γ in the DFlash layout, 1..2γ there with
    lookup drafts (`streamspec.vllm.lookup`: a lookup hit fills the positions beyond the streams';
    without one they hold stream γ's guess one position further)."""
    if check_layout(layout) == PEAGLE:
        return 2, num_streams + 1
    return 1, 2 * num_streams if lookup else num_streams


def check_layout(layout: str) -> str:
    """`layout` when it is one the drafter runs in; raises naming those otherwise."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def layout_aux_layers(layout: str, first: int, stream_layers: int) -> list[int]:
    """The target layers whose input vLLM hands the drafter: N−Ns alone in the P-EAGLE layout (the
    drafter runs its layers over the accepted rows itself), N−Ns…N−1 in the DFlash layout (each
    layer's keys and values of the accepted rows come from the target's own states)."""
    return [first] if check_layout(layout) == PEAGLE else list(range(first, first + stream_layers))


def speculative_method(layout: str) -> str:
    """vLLM's speculative ``method`` that runs a drafter folder of `layout`."""
    return {PEAGLE: "eagle3", DFLASH: "dflash"}[check_layout(layout)]


def streams_speculative_config(layout: str, folder: str, drafts: int, schedule: list | None = None,
                               parallel_drafting: bool = True) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a streams drafter folder of `layout`: its method, `drafts`
    a step, drafts by batch size when a `schedule` is given, and the layout's options.

    The DFlash layout sets ``disable_eagle_block_drop``: on a prefix-cache hit vLLM otherwise
    recomputes the last cached block of the prompt for every drafter that reads the target's
    hidden states (EAGLE's drafter keys at a position need the token after it, so its last cached
    row may be stale). The DFlash streams drafter needs no such row: its context keys and values at
    each position come from the target's state there alone, written when that position was first
    computed, and the state at the last prompt position, which the streams start from, is always
    recomputed (vLLM never serves a whole prompt from the cache). On a CPU a block is 128 tokens,
    so the drop recomputed up to 128 tokens a request that plain decoding reads from the cache."""
    config: dict[str, Any] = {"method": speculative_method(layout), "model": str(folder),
                              "num_speculative_tokens": int(drafts)}
    if parallel_drafting:
        config["parallel_drafting"] = True
    if schedule:
        config["num_speculative_tokens_per_batch_size"] = [[int(x) for x in entry] for entry in schedule]
    if layout == DFLASH:
        config["disable_eagle_block_drop"] = True
    return config


def check_folder_layout(facts: dict[str, Any], layout: str) -> None:
    """Refuse a drafter folder exported for another layout than the drafter vLLM built for it (the
    speculative ``method`` picks the class), naming the method the folder needs."""
    exported = facts.get("layout", PEAGLE)
    if exported != layout:
        raise ValueError(f"the drafter folder was exported for the {exported!r} layout, which vLLM runs with "
                         f'"method": "{speculative_method(exported)}"; it was started with "method": '
                         f'"{speculative_method(layout)}" (streamspec.vllm.run picks the method from the folder)')
