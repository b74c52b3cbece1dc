"""streamspec's streams as vLLM's drafter.

vLLM's EAGLE-3 proposer with parallel drafting (``"method": "eagle3"``, ``"parallel_drafting":
true``) hands its drafter, for each request, the target's hidden states at one layer for the
accepted tokens, one row at the last accepted position p and K−1 *mask rows* at positions
p+1…p+K−1 that attend causally to what comes before them. That is the stream pattern: stream j of
position p attends to the main keys ≤ p and to streams 1..j, at position p+j. The drafter
(`streamspec.vllm.drafter`) runs copies of the base's top Ns layers over those rows: the accepted
rows as main rows (their keys and values are the base's own), the mask rows as streams 1..K−1.
A folder exported with ``--layout dflash`` runs behind vLLM's DFlash proposer instead
(``"method": "dflash"``, `streamspec.vllm.dflash`): γ query rows are streams 1..γ and all K = γ
drafts are theirs, with no filler draft to verify.

This module is the plugin vLLM loads (entry point ``vllm.general_plugins``); it imports vLLM's
registry only. `streamspec.vllm.export` writes the drafter folder (it needs no vLLM);
`streamspec.vllm.run` is the runner the benchmark and the tests call in vLLM's environment.
"""

from __future__ import annotations

# the architecture names a drafter folder's config.json carries, by base model type. vLLM renames
# an EAGLE-3 draft architecture to ``Eagle3<name>`` unless it already starts with that prefix.
ARCHITECTURES = {
    "llama": "Eagle3LlamaStreamsDrafter",
    "qwen2": "Eagle3Qwen2StreamsDrafter",
    "mistral": "Eagle3MistralStreamsDrafter",
}
# the same for the DFlash layout (``"method": "dflash"``, `streamspec.vllm.dflash`); vLLM renames a
# DFlash draft architecture to ``DFlash<name>`` unless it starts with that prefix
DFLASH_ARCHITECTURES = {model_type: "DFlash" + name.removeprefix("Eagle3") for model_type, name in ARCHITECTURES.items()}
_CLASSES = {
    "Eagle3LlamaStreamsDrafter": "drafter:LlamaStreamsDrafter",
    "Eagle3Qwen2StreamsDrafter": "drafter:Qwen2StreamsDrafter",
    "Eagle3MistralStreamsDrafter": "drafter:MistralStreamsDrafter",
    "DFlashLlamaStreamsDrafter": "dflash:DFlashLlamaStreamsDrafter",
    "DFlashQwen2StreamsDrafter": "dflash:DFlashQwen2StreamsDrafter",
    "DFlashMistralStreamsDrafter": "dflash:DFlashMistralStreamsDrafter",
}
# a folder served with the other layout's method arrives under vLLM's renamed architecture: the
# class of that method, which refuses the folder naming the method it needs
_CLASSES.update({"DFlash" + name: _CLASSES["DFlash" + name.removeprefix("Eagle3")] for name in ARCHITECTURES.values()})
_CLASSES.update({"Eagle3" + name: _CLASSES["Eagle3" + name.removeprefix("DFlash")]
                 for name in DFLASH_ARCHITECTURES.values()})


def architecture(model_type: str, layout: str) -> str:
    """The architecture a drafter folder of `layout` names for a base of `model_type`."""
    from .format import PEAGLE, check_layout

    return (ARCHITECTURES if check_layout(layout) == PEAGLE else DFLASH_ARCHITECTURES)[model_type]


def register() -> None:
    """Register the drafter architectures with vLLM's model registry (vLLM calls this in every
    process it starts, through the ``vllm.general_plugins`` entry point)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in _CLASSES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, f"streamspec.vllm.{target}")
