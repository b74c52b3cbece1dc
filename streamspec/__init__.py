"""streamspec: Speculative Streaming for Hugging Face causal language models.

The names below are imported on first use, so that a part of the package that needs little (the
vLLM plugin, `streamspec.vllm`, which runs inside vLLM's own environment without peft) imports
without the rest.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DEFAULT_MODEL_ID": ".assets",
    "load_default_model": ".assets",
    "load_default_tokenizer": ".assets",
    "CheckpointError": ".patch.checkpoint",
    "load_streamed": ".patch.checkpoint",
    "StreamConfig": ".config",
    "generate": ".decoding.generate",
    "StreamedModel": ".patch.model",
    "StreamedOutput": ".patch.model",
    "add_streams": ".patch.model",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'streamspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
