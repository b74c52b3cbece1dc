"""SpecReason's HTTP backend against real OpenAI-compatible servers: `streamspec serve`, started by
the test on a free loopback port as a user would start it, and `vllm serve` (vLLM's CPU build in
`make vllm`'s environment), plain and with streams as its drafter."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamspec import StreamConfig, add_streams
from streamspec.reason.backends import BackendError, LocalBackend, ServerBackend
from streamspec.reason.config import ReasonConfig
from streamspec.reason.reasoner import SpecReasoner

pytestmark = pytest.mark.usefixtures("single_thread")
CFG = dict(token_budget=60, step_max_tokens=12, answer_max_tokens=4, temperature=0.0, judge_request="score_0_9")
PROBLEM = "What is 2+3?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(command: list[str], port: int, timeout: float = 120.0) -> subprocess.Popen:
    return _wait_up(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), port,
                    timeout)


def _wait_up(process: subprocess.Popen, port: int, timeout: float = 120.0) -> subprocess.Popen:
    """`process` once its server answers on `port` (killed, with what it printed, if it never does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not come up in time")


@pytest.fixture(scope="module")
def served(tiny_dir):
    """`streamspec serve` of the tiny base, one thread, on a free loopback port."""
    port = _free_port()
    env_command = [sys.executable, "-m", "streamspec.cli", "serve", "--checkpoint", str(tiny_dir), "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", "base", "--device", "cpu", "--dtype", "float32",
                   "--log-level", "warning"]
    process = _start(env_command, port)
    yield f"http://127.0.0.1:{port}/v1"
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def local(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    drafter = add_streams(AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa"),
                          StreamConfig(stream_layers=2, mode="lossless")).eval()
    return tokenizer, base, drafter


def test_judging_over_http_reads_the_same_digits(served, local, tiny_dir):
    tokenizer, base, _ = local
    remote = ServerBackend(served, "base", tokenizer=str(tiny_dir), name="base")
    here = LocalBackend(base, tokenizer, name="base")
    for backend in (remote, here):
        backend.start(PROBLEM)
        backend.append("First, add the numbers.\n\n")
    a, b = remote.judge("2 + 3 = 5.\n\n", "score_0_9"), here.judge("2 + 3 = 5.\n\n", "score_0_9")
    # the server reports the top 20 tokens: every digit among them has the in-process probability
    for d in range(10):
        assert a.digit_probs[d] <= b.digit_probs[d] + 1e-4
        if a.digit_probs[d] > 0:
            assert a.digit_probs[d] == pytest.approx(b.digit_probs[d], rel=1e-3, abs=1e-5)
    assert a.top_digit == b.top_digit
    assert remote.text == here.frame.prefix(PROBLEM) + "First, add the numbers.\n\n2 + 3 = 5.\n\n"


def test_specreason_with_a_served_base_equals_the_local_one(served, local, tiny_dir):
    tokenizer, base, drafter = local
    for threshold in (0, 9):
        cfg = ReasonConfig(threshold=threshold, score="expected", **CFG)
        remote = SpecReasoner(LocalBackend(drafter, tokenizer, name="drafter"),
                              ServerBackend(served, "base", tokenizer=str(tiny_dir), name="base"), cfg).solve(PROBLEM)
        here = SpecReasoner(LocalBackend(drafter, tokenizer, name="drafter"), LocalBackend(base, tokenizer), cfg).solve(PROBLEM)
        assert remote.stop_reason != "error", remote.error
        assert [s.author for s in remote.steps] == [s.author for s in here.steps]
        assert remote.text == here.text
        assert remote.tokens["total"] <= cfg.token_budget


def test_a_drafter_behind_the_server(served, local, tiny_dir):
    tokenizer, base, _ = local
    cfg = ReasonConfig(threshold=0, **CFG)
    remote = SpecReasoner(ServerBackend(served, "base", tokenizer=str(tiny_dir), name="drafter"), None, cfg)
    here = SpecReasoner(LocalBackend(base, tokenizer), None, cfg)
    assert remote.drafter_only(PROBLEM).text == here.drafter_only(PROBLEM).text


def test_unreachable_server_and_unknown_model_are_clear(served, tiny_dir):
    with pytest.raises(BackendError, match="cannot reach"):
        ServerBackend(f"http://127.0.0.1:{_free_port()}/v1", "base", tokenizer=str(tiny_dir), timeout=2, retries=0)
    with pytest.raises(BackendError, match="serves"):
        ServerBackend(served, "no-such-model", tokenizer=str(tiny_dir))


def test_a_server_that_goes_away_is_recorded_and_the_run_goes_on(tiny_dir, local):
    tokenizer, _, drafter = local
    port = _free_port()
    process = _start([sys.executable, "-m", "streamspec.cli", "serve", "--checkpoint", str(tiny_dir), "--host",
                      "127.0.0.1", "--port", str(port), "--served-model-name", "base", "--device", "cpu"], port)
    base = ServerBackend(f"http://127.0.0.1:{port}/v1", "base", tokenizer=str(tiny_dir), timeout=5, retries=1)
    process.terminate()
    process.wait(timeout=30)
    reasoner = SpecReasoner(LocalBackend(drafter, tokenizer), base, ReasonConfig(**CFG))
    first, second = reasoner.solve(PROBLEM), reasoner.solve("What is 4*3?")
    assert first.stop_reason == second.stop_reason == "error"
    assert "failed" in first.error and first.tokens["total"] <= CFG["token_budget"]


def _vllm_serve(folder: str, name: str, speculative: dict | None = None) -> tuple[subprocess.Popen, int]:
    """vLLM's OpenAI server (its CPU build, `make vllm`'s environment) starting on a free loopback
    port (`_wait_up` waits for it): the server `vllm serve` starts (the CPU build's `vllm` command
    looks its version up under the distribution name "vllm" and fails, so the module is run
    directly; the arguments are the same)."""
    from streamspec.vllm.client import vllm_python

    port = _free_port()
    command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
               "--served-model-name", name, "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager",
               # the model in the engine-core process (no worker process of its own waiting on it)
               "--distributed-executor-backend", "uni"]
    if speculative:
        command += ["--speculative-config", json.dumps(speculative)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env), port


def test_specreason_against_vllm_servers(tmp_path):
    """SpecReason's backends on two `vllm serve` servers of SmolLM2: the base, and the drafter with
    the shipped reasoning streams as its speculative config. Greedy, the run equals the one whose
    drafter is the plain server (speculation changes no token), and the streams drafted."""
    from streamspec.assets import default_model_path
    from streamspec.vllm.client import vllm_python
    from streamspec.vllm.export import export_for_vllm
    from streamspec.vllm.run import speculative_config

    try:
        vllm_python()
    except FileNotFoundError as err:  # `make test` builds it first
        pytest.skip(str(err))
    folder = str(default_model_path())
    drafter = export_for_vllm("streamspec:smollm2-135m-reason-streams", tmp_path / "drafter")
    # both servers start side by side (their start-up is most of the test's time)
    base, base_port = _vllm_serve(folder, "smol")
    # the folder's own method and drafts a step (the default layout's: every stream drafts)
    streams, streams_port = _vllm_serve(folder, "smol-streams",
                                        speculative_config({"drafter": "streams", "folder": str(drafter)}))
    base_url, streams_url = f"http://127.0.0.1:{base_port}/v1", f"http://127.0.0.1:{streams_port}/v1"
    try:
        _wait_up(base, base_port, timeout=600)
        _wait_up(streams, streams_port, timeout=600)
        cfg = ReasonConfig(token_budget=120, step_max_tokens=40, answer_max_tokens=6, temperature=0.0,
                           judge_request="score_0_9", score="expected")
        problem = "Tom has 3 apples and buys 5 more. How many apples does he have?"
        judge = ServerBackend(base_url, "smol", tokenizer=folder, name="base")
        with_streams = SpecReasoner(ServerBackend(streams_url, "smol-streams", tokenizer=folder, name="drafter"), judge,
                                    cfg).solve(problem)
        plain = SpecReasoner(ServerBackend(base_url, "smol", tokenizer=folder, name="drafter"), judge, cfg).solve(problem)
        assert with_streams.stop_reason != "error", with_streams.error
        assert with_streams.drafted_steps and all(sum(s.digit_probs) > 0 for s in with_streams.drafted_steps)
        assert with_streams.text == plain.text
        assert [s.author for s in with_streams.steps] == [s.author for s in plain.steps]
        metrics = httpx.get(streams_url.removesuffix("/v1") + "/metrics", timeout=10).text
        accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert accepted and sum(accepted) > 0
    finally:
        for process in (base, streams):
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=60)
