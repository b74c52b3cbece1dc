"""An OpenAI-compatible HTTP server for streamed checkpoints and plain causal LMs (`streamspec serve`).

- `create_app(loaded, ...)`: the FastAPI app (`app.py`) around an `Engine` (`engine.py`);
- `serve(source, ...)`: load with `streamspec.loading.load_for_inference` and run it with uvicorn;
- `protocol.py`: the request and response shapes (pydantic).
"""

from .app import create_app
from .engine import Engine
from .server import serve

__all__ = ["Engine", "create_app", "serve"]
