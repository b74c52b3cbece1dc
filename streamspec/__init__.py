"""streamspec: Speculative Streaming for Hugging Face causal language models."""

from .config import StreamConfig
from .model import StreamedModel, StreamedOutput, add_streams

__version__ = "0.1.0"

__all__ = ["StreamConfig", "StreamedModel", "StreamedOutput", "add_streams", "__version__"]
