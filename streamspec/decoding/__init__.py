"""Decoding a streamed model, one module per job: the decode options (`config`: `DecodeConfig`),
keyed token draws (`sampling`), draft trees (`tree`) and prompt-lookup branches (`lookup`), the
main-stream cache (`cache`), the loops (`loop`), verification on the device and the host
(`verify`), the compiled step (`compiled`), what a call returns and its one host read per pass
(`output`), batches (`batch`), decoding sessions that keep their cache across calls (`session`), the
public entry `generate` (`generate`) and the `streamspec generate` command (`text`).

``from streamspec.decoding import generate`` (or ``from streamspec import generate``) is the entry
point.
"""

from .config import DecodeConfig
from .generate import GenerateOutput, Sampler, generate, generate_autoregressive, speculate

__all__ = ["DecodeConfig", "GenerateOutput", "Sampler", "generate", "generate_autoregressive", "speculate"]
