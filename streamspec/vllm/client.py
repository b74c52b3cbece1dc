"""Running vLLM from streamspec's own environment: a subprocess in vLLM's environment
(`streamspec.vllm.run`), so streamspec never imports vLLM beside its training stack (vLLM pins
its own transformers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

VLLM_PYTHON_ENV = "STREAMSPEC_VLLM_PYTHON"
# vLLM's suffix decoding (drafter "suffix") imports arctic-inference's suffix trees, a C++ extension
# that the package ships as source only: `make vllm` builds it into vLLM's environment
SUFFIX_DECODING_MISSING = ("vLLM's suffix decoding (drafter \"suffix\", the vllm_suffix row) needs "
                           "arctic-inference==0.3.0 built into vLLM's environment: run `make vllm`")


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


def check_suffix_decoding(python: str | None = None, env: dict[str, str] | None = None) -> None:
    """Raises `SUFFIX_DECODING_MISSING`, with the import's error, when vLLM's environment cannot
    load arctic-inference's suffix trees (a Python start, no vLLM)."""
    proc = subprocess.run([str(vllm_python(python)), "-c", "import arctic_inference.suffix_decoding"],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise RuntimeError(f"{SUFFIX_DECODING_MISSING} ({lines[-1] if lines else f'status {proc.returncode}'})")


def run_vllm(spec: dict, python: str | None = None, env: dict[str, str] | None = None,
             timeout: float = 1800) -> dict:
    """Run `spec` (see `streamspec.vllm.run`) in vLLM's environment; returns its results
    (``{"runs": [...]}``). A failure raises with the end of vLLM's output."""
    exe = vllm_python(python)
    with tempfile.TemporaryDirectory(prefix="streamspec-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        child_env = {**os.environ, **(env or {})}
        # its own process group: a run past `timeout` is stopped with the processes it started
        proc = subprocess.Popen([str(exe), "-m", "streamspec.vllm.run", str(spec_path), str(out_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if proc.returncode != 0:
            raise VLLMRunError(proc.returncode, stdout + stderr)
        return json.loads(out_path.read_text(encoding="utf-8"))


class VLLMRunError(RuntimeError):
    """vLLM's run failed; `output` holds what it printed."""

    def __init__(self, returncode: int, output: str) -> None:
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-25:])
        super().__init__(f"vLLM exited with status {returncode}:\n{tail}")


class VLLMGenerator:
    """vLLM's offline engine in a subprocess of vLLM's environment (`streamspec.vllm.distill`),
    as a greedy generator: ``generator(prompts, max_tokens, stop_token_ids)`` returns each
    prompt's generated token ids. Start it with ``with``; it stops on leaving.

    Args:
        model: a local model folder (or a name vLLM resolves).
        log: where vLLM's output goes (its last lines are raised with a failure).
    """

    def __init__(self, model: str, log: str | Path, dtype: str = "float32", max_num_seqs: int = 32, threads: int = 1,
                 max_model_len: int | None = None, seed: int = 0, python: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.spec = {"model": str(model), "dtype": dtype, "max_num_seqs": max_num_seqs, "threads": threads,
                     "max_model_len": max_model_len, "seed": seed}
        self.log, self.python, self.env = Path(log), python, env
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None

    def __enter__(self) -> "VLLMGenerator":
        exe = vllm_python(self.python)
        self._tmp = tempfile.TemporaryDirectory(prefix="streamspec-vllm-")
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(self.spec), encoding="utf-8")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_handle = self.log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen([str(exe), "-m", "streamspec.vllm.distill", str(spec_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log_handle, text=True,
                                     env={**os.environ, **(self.env or {})})
        try:
            self.start_seconds = self._answer()["seconds"]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __call__(self, prompts: list[list[int]], max_tokens: int, stop_token_ids: list[int]) -> list[list[int]]:
        if self.proc is None:
            raise RuntimeError("VLLMGenerator is not started: use it in a `with` block")
        request = {"prompts": [[int(t) for t in p] for p in prompts], "max_tokens": max_tokens,
                   "stop_token_ids": list(stop_token_ids)}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the process has ended: `_answer` raises with its output
        outputs = self._answer()["outputs"]
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM answered {len(outputs)} outputs for {len(prompts)} prompts")
        return outputs

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:  # the process ended: say why
            code = self.proc.wait()
            self._log_handle.flush()
            raise VLLMRunError(code, self.log.read_text(encoding="utf-8", errors="replace"))
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        self._log_handle.close()
        self._tmp.cleanup()
