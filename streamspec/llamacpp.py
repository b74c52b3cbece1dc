"""llama.cpp as an engine beside streamspec: its OpenAI-compatible server, run inside this process.

What CPU users run: llama.cpp's server through the prebuilt ``xllamacpp`` wheel (MIT, no
dependencies; ``pip install --only-binary=:all: xllamacpp``). `LlamaCppServer` starts one on a
GGUF, bound to 127.0.0.1 on a free port, with a fixed number of threads and prompt caching, and
stops it with the ``with`` block. A source written ``llama.cpp:GGUF`` names such a server
(`parse_llama_cpp`), where GGUF is a path or a built-in name (`gguf_path`):

- ``streamspec:SmolLM2-135M-Instruct`` (or ``default``): the default model's own GGUF (its package);
- any path to a ``.gguf`` file.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PREFIX = "llama.cpp:"
# LlamaCppServer(speculative=...): llama.cpp's speculation types that need no second model
SPECULATIVE = {"ngram": "COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE"}
INSTALL_HINT = "pip install --only-binary=:all: xllamacpp==2026.10.11549"


def parse_llama_cpp(source: str) -> str | None:
    """The GGUF part of a ``llama.cpp:GGUF`` source, or None for any other source."""
    return source[len(PREFIX):] if source.startswith(PREFIX) else None


def gguf_path(name: str) -> Path:
    """The GGUF file a built-in name or a path stands for (see the module docstring)."""
    from .assets import BUILTIN_PREFIX, DEFAULT_MODEL_ID, default_gguf_path

    if name in (DEFAULT_MODEL_ID, "default"):
        return default_gguf_path()
    if name.startswith(BUILTIN_PREFIX):
        raise ValueError(f"{name!r} is no built-in GGUF here: use {DEFAULT_MODEL_ID} or a path to a .gguf file")
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    return path


class LlamaCppServer:
    """An in-process llama.cpp server on `gguf` (use as a context manager; `url` is its base URL).

    Args:
        gguf: a GGUF path or built-in name (`gguf_path`).
        threads: CPU threads for generation and prompt processing (keep the sum of every job's
            threads within the cores: oversubscribed, everything slows many-fold).
        context: tokens of context per slot.
        parallel: slots decoding at once (continuous batching: concurrent requests share passes).
        speculative: None (plain decoding) or one of `SPECULATIVE`: ``"ngram"``, llama.cpp's own
            n-gram speculation over the tokens so far (prompt lookup: drafts copied from earlier
            text, verified in one pass).
        verbose: llama.cpp's own log lines (each request's slot and timings) on stderr; off by
            default, so a benchmark's or a training's progress stays readable.
        ram_cache_mib: llama.cpp's host-memory cache of earlier prompts' states (restored into a
            slot when a new prompt shares their prefix), in MiB; None: llama.cpp's default (8 GiB
            in the wheel here), 0: none, so that a slot's own cache is the only one.
        slot_actions: allow `erase_slots` (llama.cpp's slot actions; they need a slot directory,
            a temporary one here).
    """

    def __init__(self, gguf: str | Path, threads: int = 1, context: int = 4096, parallel: int = 1,
                 speculative: str | None = None, verbose: bool = False, ram_cache_mib: int | None = None,
                 slot_actions: bool = False) -> None:
        for name, value in (("threads", threads), ("context", context), ("parallel", parallel)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if speculative is not None and speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be None or one of {list(SPECULATIVE)}, got {speculative!r}")
        self.gguf = gguf_path(str(gguf))
        self.threads, self.context, self.parallel = threads, context, parallel
        if ram_cache_mib is not None and int(ram_cache_mib) < 0:
            raise ValueError(f"ram_cache_mib must be None or >= 0, got {ram_cache_mib!r}")
        self.speculative = speculative
        self.verbose = verbose
        self.ram_cache_mib, self.slot_actions = ram_cache_mib, slot_actions
        self._slot_dir = None
        self._server = None
        self.url: str | None = None

    def __enter__(self) -> "LlamaCppServer":
        try:
            import xllamacpp as xlc
        except ImportError as err:
            raise ImportError(f"llama.cpp runs through the xllamacpp wheel: {INSTALL_HINT}") from err
        params = xlc.CommonParams()
        params.model.path = str(self.gguf)
        params.n_ctx = self.context * self.parallel
        params.n_parallel = self.parallel
        params.port = 0  # a free port
        params.hostnames = ["127.0.0.1"]
        params.cpuparams.n_threads = self.threads
        params.cpuparams_batch.n_threads = self.threads
        params.cache_prompt = True
        params.verbosity = 3 if self.verbose else 0
        if self.ram_cache_mib is not None:
            params.cache_ram_mib = int(self.ram_cache_mib)
        if self.slot_actions:
            import tempfile

            self._slot_dir = tempfile.TemporaryDirectory(prefix="streamspec-slots-")
            params.slot_save_path = self._slot_dir.name
        if self.speculative is not None:
            params.speculative.types = [getattr(xlc.common_speculative_type, SPECULATIVE[self.speculative])]
        try:
            self._server = xlc.Server(params)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        address = self._server.listening_address
        self.url = address if address.startswith("http") else f"http://{address}"
        return self

    def __exit__(self, *exc) -> None:
        self._server = None  # the server stops when its object goes
        self.url = None
        if self._slot_dir is not None:
            self._slot_dir.cleanup()
            self._slot_dir = None

    def erase_slots(self) -> None:
        """Empty every slot's prompt cache (the next request of each prefills its whole prompt).
        Needs ``slot_actions=True``."""
        if self.url is None:
            raise RuntimeError("the llama.cpp server is not running")
        if not self.slot_actions:
            raise RuntimeError("erase_slots needs a server started with slot_actions=True")
        for slot in range(self.parallel):
            post_json(f"{self.url}/slots/{slot}?action=erase", {}, timeout=60.0)


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """POST `body` as JSON and return the JSON answer; an HTTP error names the URL and the body."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise RuntimeError(f"{url} answered HTTP {err.code}: {detail}") from err
    except urllib.error.URLError as err:
        raise ConnectionError(f"cannot reach {url}: {err.reason}") from err


def server_model_id(url: str) -> str:
    """The model id an OpenAI-compatible server reports first (GET /v1/models)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as response:
            data = json.loads(response.read())
    except (urllib.error.URLError, OSError) as err:
        raise ConnectionError(f"cannot reach the server at {url} (/v1/models): {err}") from err
    models = data.get("data") or []
    if not models:
        raise ValueError(f"the server at {url} reports no model")
    return str(models[0].get("id"))
