"""streamspec's streams as vLLM's drafter.

vLLM's EAGLE-3 proposer with parallel drafting (``"method": "eagle3"``, ``"parallel_drafting":
true``) hands its drafter, for each request, the target's hidden states at one layer for the
accepted tokens, one row at the last accepted position p and K−1 *mask rows* at positions
p+1…p+K−1 that attend causally to what comes before them. That is the stream pattern: stream j of
position p attends to the main keys ≤ p and to streams 1..j, at position p+j. The drafter
(`streamspec.vllm.drafter`) runs copies of the base's top Ns layers over those rows: the accepted
rows as main rows (their keys and values are the base's own), the mask rows as streams 1..K−1.

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
_CLASSES = {
    "Eagle3LlamaStreamsDrafter": "LlamaStreamsDrafter",
    "Eagle3Qwen2StreamsDrafter": "Qwen2StreamsDrafter",
    "Eagle3MistralStreamsDrafter": "MistralStreamsDrafter",
}


def register() -> None:
    """Register the drafter architectures with vLLM's model registry (vLLM calls this in every
    process it starts, through the ``vllm.general_plugins`` entry point)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, cls in _CLASSES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, f"streamspec.vllm.drafter:{cls}")
