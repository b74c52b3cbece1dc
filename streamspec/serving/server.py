"""`streamspec serve`: load a model and run the OpenAI-compatible app with uvicorn."""

from __future__ import annotations

from pathlib import Path

from ..devices import dtype_name
from ..loading import load_for_inference
from .app import create_app


def serve(source: str | Path, *, host: str = "127.0.0.1", port: int = 8000, device: str = "auto", dtype: str = "auto",
          tree_top_k: int | tuple[int, ...] = 3, prune_threshold: float | None = None, max_model_len: int | None = None,
          served_model_name: str | None = None, gguf_file: str | None = None, cpu_kernels: bool = True,
          log_level: str = "info", lookup=None, tree_budget: int | None = None, config=None) -> None:
    """Serve `source` (a streamed checkpoint, or any causal LM `load_for_inference` takes) until
    interrupted. Binds `host` (loopback by default: pass ``0.0.0.0`` to accept other machines;
    there is no authentication). `config` (a `streamspec.decoding.DecodeConfig`) gives every decode
    option at once instead of tree_top_k, prune_threshold, lookup and tree_budget."""
    import uvicorn

    loaded = load_for_inference(source, device=device, dtype=dtype, gguf_file=gguf_file, cpu_kernels=cpu_kernels)
    app = create_app(loaded, served_model_name=served_model_name, tree_top_k=tree_top_k,
                     prune_threshold=prune_threshold, max_model_len=max_model_len, lookup=lookup, tree_budget=tree_budget,
                     config=config)
    kind = "speculative streaming" if loaded.streamed else "one token per pass (no streams)"
    print(f"streamspec serve: {app.state.engine.loaded.source} as {served_model_name or loaded.source!r} on "
          f"{loaded.device} in {dtype_name(loaded.dtype)}, {kind}; http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
