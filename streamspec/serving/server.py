"""`streamspec serve`: load a model and run the OpenAI-compatible app with uvicorn."""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

from ..devices import dtype_name
from ..loading import load_for_inference
from .app import create_app

API_KEY_ENV = "STREAMSPEC_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether `host` binds this machine alone (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: other machines may reach it
        return False


def serve(source: str | Path, *, host: str = "127.0.0.1", port: int = 8000, device: str = "auto", dtype: str = "auto",
          tree_top_k: int | tuple[int, ...] = 3, prune_threshold: float | None = None, max_model_len: int | None = None,
          served_model_name: str | None = None, gguf_file: str | None = None, cpu_kernels: bool = True,
          log_level: str = "info", lookup=None, tree_budget: int | None = None, config=None,
          api_key: str | None = None) -> None:
    """Serve `source` (a streamed checkpoint, or any causal LM `load_for_inference` takes) until
    interrupted. Binds `host` (loopback by default: pass ``0.0.0.0`` to accept other machines).
    `api_key` (default: $STREAMSPEC_API_KEY) is the key every ``/v1/`` request must carry as
    ``Authorization: Bearer KEY``; binding beyond loopback without one prints a warning.
    `config` (a `streamspec.decoding.DecodeConfig`) gives every decode option at once instead of
    tree_top_k, prune_threshold, lookup and tree_budget."""
    import uvicorn

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    if not api_key and not is_loopback(host):
        print(f"streamspec serve: warning: binding {host} without an API key: anyone who reaches this address can "
              f"use the model (pass --api-key or set {API_KEY_ENV})", file=sys.stderr, flush=True)

    loaded = load_for_inference(source, device=device, dtype=dtype, gguf_file=gguf_file, cpu_kernels=cpu_kernels)
    app = create_app(loaded, served_model_name=served_model_name, tree_top_k=tree_top_k,
                     prune_threshold=prune_threshold, max_model_len=max_model_len, lookup=lookup, tree_budget=tree_budget,
                     config=config, api_key=api_key)
    kind = "speculative streaming" if loaded.streamed else "one token per pass (no streams)"
    print(f"streamspec serve: {app.state.engine.loaded.source} as {served_model_name or loaded.source!r} on "
          f"{loaded.device} in {dtype_name(loaded.dtype)}, {kind}; http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
