"""llama.cpp as an engine beside streamspec: its OpenAI-compatible server, in a process of its own.

What CPU users run: llama.cpp's server through the prebuilt ``xllamacpp`` wheel (MIT, no
dependencies; ``pip install --only-binary=:all: xllamacpp``). `LlamaCppServer` starts one on a
GGUF, bound to 127.0.0.1 on a free port, with a fixed number of threads and prompt caching, in a
child process of its own, and stops it with the ``with`` block (killed if it does not stop in time). A source written ``llama.cpp:GGUF`` names such a server
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
    """A llama.cpp server on `gguf` in a child process (use as a context manager; `url` is its base URL).

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
        stop_timeout: seconds the server gets to stop at the end of the ``with`` block; one that
            takes longer is killed (with a warning). The server runs in a child process of its
            own for this: xllamacpp stops it in a destructor that cannot be interrupted.
        start_timeout: seconds the server gets to load its GGUF and listen; one that takes longer
            is killed and reported (a RuntimeError), never waited on for ever.
    """

    def __init__(self, gguf: str | Path, threads: int = 1, context: int = 4096, parallel: int = 1,
                 speculative: str | None = None, verbose: bool = False, ram_cache_mib: int | None = None,
                 slot_actions: bool = False, stop_timeout: float = 60.0,
                 start_timeout: float = 600.0) -> None:
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
        self._process = None
        self._stderr = None
        self.stop_timeout = float(stop_timeout)
        self.start_timeout = float(start_timeout)
        for name, value in (("stop_timeout", self.stop_timeout), ("start_timeout", self.start_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.url: str | None = None

    def __enter__(self) -> "LlamaCppServer":
        import importlib.util
        import select
        import subprocess
        import sys
        import tempfile

        if importlib.util.find_spec("xllamacpp") is None:
            raise ImportError(f"llama.cpp runs through the xllamacpp wheel: {INSTALL_HINT}")
        if self.slot_actions:
            self._slot_dir = tempfile.TemporaryDirectory(prefix="streamspec-slots-")
        settings = {"gguf": str(self.gguf), "context": int(self.context), "parallel": int(self.parallel),
                    "threads": int(self.threads), "verbose": bool(self.verbose), "ram_cache_mib": self.ram_cache_mib,
                    "slot_dir": self._slot_dir.name if self._slot_dir is not None else None,
                    "speculative": SPECULATIVE[self.speculative] if self.speculative is not None else None}
        # its own process (see _llamacpp_child.py): a server that never stops is killed, not waited on
        self._stderr = None if self.verbose else tempfile.TemporaryFile()
        self._process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_llamacpp_child.py"))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                         text=True)
        try:
            self._process.stdin.write(json.dumps(settings) + "\n")
            self._process.stdin.flush()
            ready, _, _ = select.select([self._process.stdout], [], [], self.start_timeout)
            line = self._process.stdout.readline().strip() if ready else None
            if line is None or not line.startswith("ADDRESS "):
                if line is None:
                    reason = f"not within {self.start_timeout:g} s (start_timeout): killed"
                else:
                    reason = line[len("ERROR "):] if line.startswith("ERROR ") else "it exited"
                tail = self._stderr_tail()  # kills it if it still runs
                reason += f"; its log ends:\n{tail}" if tail else ""
                raise RuntimeError(f"the llama.cpp server on {self.gguf} did not start: {reason}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.url = line[len("ADDRESS "):]
        return self

    def __exit__(self, *exc) -> None:
        import subprocess
        import warnings

        process, self._process = getattr(self, "_process", None), None
        self.url = None
        if process is not None:
            try:
                process.stdin.close()  # the server stops when its input closes
            except OSError:
                pass
            try:
                process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                warnings.warn(f"the llama.cpp server on {self.gguf} did not stop within {self.stop_timeout:g} s: "
                              "killed", RuntimeWarning, stacklevel=2)
                process.kill()
                process.wait()
            process.stdout.close()
        if getattr(self, "_stderr", None) is not None:
            self._stderr.close()
            self._stderr = None
        if self._slot_dir is not None:
            self._slot_dir.cleanup()
            self._slot_dir = None

    def _stderr_tail(self, chars: int = 2000) -> str:
        """The last `chars` characters the server process wrote on stderr (when not verbose),
        once it has ended (killed here if it still runs)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:].strip()

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
