"""Where SpecReason's models run: in process (`LocalBackend`) or behind an OpenAI-compatible
server (`ServerBackend`: vLLM, SGLang, `streamspec serve`).

A backend holds one growing conversation: the solving prompt of the current problem, then the
steps kept so far. Text is what the roles exchange (drafter and base may have different
tokenizers); inside a backend, token ids are kept between calls and only new text is tokenised.
Every backend can

- `generate` the next piece of text (a step, stopping at the delimiter; the answer, stopping when
  the ``\\boxed{`` closes) and keep it,
- `judge` a step: keep it and read the model's probabilities of the digits 0..9 as the next token
  after the judging request, in one pass whose request tokens are then dropped again,
- `append` text written elsewhere, and `rollback` to a `mark`.

A local backend keeps the KV cache of everything kept (`streamspec.decoding.session.DecodingSession`), so
a judgement reads only the new step and the request; a step kept after its judgement keeps the
entries the judge pass wrote.

Each kind lives in a module of its own (`backend_base`, `local_backend`, `server_backend`); this
module re-exports them and builds one from a `BackendConfig` (`backend_from_config`).
"""

from __future__ import annotations

from .backend_base import (  # noqa: F401 (re-exported)
    Backend,
    BackendError,
    ChatFrame,
    Generation,
    Judgement,
    Sampling,
    TextStop,
    _digit_ids,
    chat_frame,
)
from .config import BackendConfig
from .local_backend import LocalBackend, default_tree  # noqa: F401 (re-exported)
from .server_backend import LlamaCppBackend, ServerBackend, role_gguf, top_logprobs  # noqa: F401 (re-exported)


def backend_from_config(config: BackendConfig, name: str) -> Backend:
    """Build the backend a `BackendConfig` describes (loading an in-process model, or starting a
    llama.cpp server for a ``llama.cpp:GGUF`` source)."""
    if config.llama_cpp is not None:
        return LlamaCppBackend(config.llama_cpp, threads=config.threads, tokenizer=config.tokenizer,
                               timeout=config.timeout, retries=config.retries, name=name)
    if config.is_server:
        return ServerBackend(config.source, config.model, tokenizer=config.tokenizer, timeout=config.timeout,
                             retries=config.retries, api_key=config.api_key, name=name)
    from ..loading import load_for_inference

    loaded = load_for_inference(config.source, device=config.device, dtype=config.dtype, gguf_file=config.gguf_file)
    return LocalBackend(loaded.model, loaded.tokenizer, streams=config.streams, name=name, config=config.decode_config())
