"""streamspec: Speculative Streaming for Hugging Face causal language models."""

from .assets import DEFAULT_MODEL_ID, load_default_model, load_default_tokenizer
from .patch.checkpoint import CheckpointError, load_streamed
from .config import StreamConfig
from .decoding.generate import generate
from .patch.model import StreamedModel, StreamedOutput, add_streams

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL_ID",
    "CheckpointError",
    "StreamConfig",
    "StreamedModel",
    "StreamedOutput",
    "add_streams",
    "generate",
    "load_default_model",
    "load_default_tokenizer",
    "load_streamed",
    "__version__",
]
