"""Running vLLM from streamspec's own environment: a subprocess in vLLM's environment
(`streamspec.vllm.run`), so streamspec never imports vLLM beside its training stack (vLLM pins
its own transformers)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

VLLM_PYTHON_ENV = "STREAMSPEC_VLLM_PYTHON"


def vllm_python(python: str | None = None) -> Path:
    """The Python of vLLM's environment: `python`, else $STREAMSPEC_VLLM_PYTHON, else the
    checkout's ``.venv-vllm`` (what ``make vllm`` builds). Raises with the way to make one."""
    candidates = [python, os.environ.get(VLLM_PYTHON_ENV)]
    candidates.append(str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError(
        "no vLLM environment found: build one with `make vllm` (a checkout's .venv-vllm), or point "
        f"${VLLM_PYTHON_ENV} at the Python of an environment with vLLM and streamspec installed")


def run_vllm(spec: dict, python: str | None = None, env: dict[str, str] | None = None,
             timeout: float = 1800) -> dict:
    """Run `spec` (see `streamspec.vllm.run`) in vLLM's environment; returns its results
    (``{"runs": [...]}``). A failure raises with the end of vLLM's output."""
    exe = vllm_python(python)
    with tempfile.TemporaryDirectory(prefix="streamspec-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        child_env = {**os.environ, **(env or {})}
        proc = subprocess.run([str(exe), "-m", "streamspec.vllm.run", str(spec_path), str(out_path)],
                              capture_output=True, text=True, timeout=timeout, env=child_env)
        if proc.returncode != 0:
            raise VLLMRunError(proc.returncode, proc.stdout + proc.stderr)
        return json.loads(out_path.read_text(encoding="utf-8"))


class VLLMRunError(RuntimeError):
    """vLLM's run failed; `output` holds what it printed."""

    def __init__(self, returncode: int, output: str) -> None:
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-25:])
        super().__init__(f"vLLM exited with status {returncode}:\n{tail}")
