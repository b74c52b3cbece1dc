"""Decoding a streamed model: the decode options (`config`: `DecodeConfig`), draft trees (`tree`), prompt-lookup branches (`lookup`), the
main-stream cache (`cache`), one sequence's speculative loop and `generate` (`generate`), what a
call returns and its one host read per pass (`output`), batches (`batch`), sessions that keep
their cache across calls (`session`), and the `streamspec generate` command (`text`).

``from streamspec.decoding import generate`` (or ``from streamspec import generate``) is the entry
point.
"""

from .config import DecodeConfig
from .generate import GenerateOutput, Sampler, generate, generate_autoregressive, speculate

__all__ = ["DecodeConfig", "GenerateOutput", "Sampler", "generate", "generate_autoregressive", "speculate"]
