"""llama.cpp as an engine (the `xllamacpp` wheel, a local server on the default model's own
GGUF): the server starts on 127.0.0.1 and answers token-id prompts; `streamspec distill --server`
builds a set from it that resumes and is keyed apart from the model's own; bad sources are refused."""

from __future__ import annotations

import json

import pytest

from streamspec.data.distill import DistillArgs, distilled_set_path, read_distilled
from streamspec.llamacpp import LlamaCppServer, gguf_path, parse_llama_cpp, server_model_id
from streamspec.training.distill import build_distilled_set, server_completion

pytest.importorskip("xllamacpp")
SERVER = "llama.cpp:streamspec:SmolLM2-135M-Instruct"


def test_sources_and_refusals(tmp_path):
    assert parse_llama_cpp(SERVER) == "streamspec:SmolLM2-135M-Instruct" and parse_llama_cpp("http://x") is None
    assert gguf_path("streamspec:SmolLM2-135M-Instruct").read_bytes()[:4] == b"GGUF"
    with pytest.raises(FileNotFoundError):
        gguf_path(str(tmp_path / "missing.gguf"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="GGUF magic"):
        gguf_path(str(fake))
    with pytest.raises(ValueError, match="no built-in GGUF here"):
        gguf_path("streamspec:NoSuchModel")
    with pytest.raises(ValueError, match="threads"):
        LlamaCppServer("streamspec:SmolLM2-135M-Instruct", threads=0)
    with pytest.raises(ValueError, match="ram_cache_mib"):
        LlamaCppServer("streamspec:SmolLM2-135M-Instruct", ram_cache_mib=-1)
    with pytest.raises(ValueError, match="exclusive"):
        DistillArgs(enabled=True, server=SERVER, decoder="some/checkpoint")


def test_server_answers_token_prompts_and_greedy_is_deterministic():
    with LlamaCppServer("streamspec:SmolLM2-135M-Instruct", threads=1, parallel=2) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert server_model_id(server.url)
        prompt = [1, 9690, 198, 2683, 359, 253]
        first = server_completion(server.url, prompt, 12, 0.0, 0)
        assert first == server_completion(server.url, prompt, 12, 0.0, 0)
        assert isinstance(first[0], str) and first[0] and first[1] is False  # 12 tokens: stopped at the limit
    assert server.url is None


def test_distill_on_a_llama_cpp_server_resumes_and_is_its_own_set(tmp_path):
    args = DistillArgs(enabled=True, sources=["validation"], max_new_tokens=8, server=SERVER, server_parallel=2)
    own = DistillArgs(enabled=True, sources=["validation"], max_new_tokens=8)
    model = "streamspec:SmolLM2-135M-Instruct"
    assert distilled_set_path(model, "sql", args) != distilled_set_path(model, "sql", own)
    out = tmp_path / "set.jsonl"
    build_distilled_set(model, "sql", args, out=out, limit=2, progress=False)
    rows = read_distilled(out)
    assert len(rows) == 2 and all(r["completion"] and r["source"] == "validation" for r in rows)
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["server"] == SERVER and meta["settings"]["server"] == SERVER
    # resumed: the two rows kept as they were, one more prompt decoded
    build_distilled_set(model, "sql", args, out=out, limit=3, progress=False)
    again = read_distilled(out)
    assert len(again) == 3 and again[:2] == rows
    # the same file with other settings (the model's own engine) is refused
    with pytest.raises(ValueError, match="other settings"):
        build_distilled_set(model, "sql", own, out=out, limit=3, progress=False)


def test_greedy_beside_sampled_completions_on_a_server(tmp_path):
    """with_greedy on a server: sample 0 is the server's greedy text (as a greedy-only set of the
    same server has it), sample 1 a draw at the set's temperature."""
    model = "streamspec:SmolLM2-135M-Instruct"
    greedy = DistillArgs(enabled=True, sources=["validation"], max_new_tokens=8, server=SERVER, server_parallel=1)
    mixed = DistillArgs(enabled=True, sources=["validation"], max_new_tokens=8, server=SERVER, server_parallel=1,
                        samples=1, temperature=1.5, with_greedy=True)
    build_distilled_set(model, "sql", greedy, out=tmp_path / "greedy.jsonl", limit=1, progress=False)
    build_distilled_set(model, "sql", mixed, out=tmp_path / "mixed.jsonl", limit=1, progress=False)
    (only,) = read_distilled(tmp_path / "greedy.jsonl")
    rows = {r["sample"]: r for r in read_distilled(tmp_path / "mixed.jsonl")}
    assert sorted(rows) == [0, 1] and rows[0]["completion"] == only["completion"]
    assert rows[1]["completion"] != only["completion"], "a draw at temperature 1.5 repeated the greedy text"


def test_agreement_with_the_model_is_reported():
    from streamspec.training.distill import server_agreement

    args = DistillArgs(enabled=True, sources=["validation"], max_new_tokens=6, server=SERVER, server_parallel=2)
    report = server_agreement("streamspec:SmolLM2-135M-Instruct", "sql", args, count=2, device="cpu", dtype="float32")
    assert report["compared"] == 2 and 0 <= report["identical"] <= 2
    assert 0.0 <= report["mean_common_prefix_share"] <= 1.0
    assert report["identical_share"] == report["identical"] / 2
    with pytest.raises(ValueError, match="server"):
        server_agreement("streamspec:SmolLM2-135M-Instruct", "sql", DistillArgs(enabled=True), count=1)


def test_erased_slots_prefill_again_and_no_other_cache_restores_them():
    """With the host-memory prompt cache off, erasing the slots leaves nothing cached: a prompt
    seen before is prefilled whole; erasing needs slot actions."""
    from streamspec.llamacpp import post_json

    prompt = [1, 9690, 198, 2683, 359, 253] * 8

    def prefilled(url):
        return post_json(url + "/completion", {"prompt": prompt, "n_predict": 1, "cache_prompt": True,
                                               "id_slot": 0})["timings"]["prompt_n"]

    with LlamaCppServer("streamspec:SmolLM2-135M-Instruct", threads=1, ram_cache_mib=0, slot_actions=True) as server:
        whole = prefilled(server.url)
        assert whole >= len(prompt) - 1 and prefilled(server.url) <= 1  # the slot's own cache
        server.erase_slots()
        assert prefilled(server.url) == whole
    with LlamaCppServer("streamspec:SmolLM2-135M-Instruct", threads=1) as server:
        with pytest.raises(RuntimeError, match="slot_actions"):
            server.erase_slots()


def test_the_server_is_a_child_process_that_stops_or_is_killed(tmp_path, monkeypatch):
    import os
    import signal
    import warnings

    with LlamaCppServer("streamspec:SmolLM2-135M-Instruct", threads=1) as server:
        process = server._process
        assert process.pid != os.getpid() and process.poll() is None
    assert process.returncode == 0 and server._process is None  # stopped when the block ended
    # a server that does not stop in time is killed, with a warning, never waited on for ever
    server = LlamaCppServer("streamspec:SmolLM2-135M-Instruct", threads=1, stop_timeout=1)
    with pytest.warns(RuntimeWarning, match="did not stop within 1 s: killed"):
        with server:
            process = server._process
            os.kill(process.pid, signal.SIGSTOP)  # frozen: it cannot stop by itself
    assert process.returncode == -signal.SIGKILL and server.url is None
    # a GGUF llama.cpp cannot load: a clear error, and no process left behind
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    server = LlamaCppServer(str(broken), threads=1)
    with pytest.raises(RuntimeError, match="did not start"):
        server.__enter__()
    assert server._process is None and server.url is None
    # a server that does not start in time: killed at once and reported (not left to stop_timeout's
    # "did not stop" warning), verbose or not, nothing left behind
    import subprocess

    started = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    for verbose in (False, True):
        server = LlamaCppServer("streamspec:SmolLM2-135M-Instruct", threads=1, start_timeout=0.01, verbose=verbose)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeError, match=r"did not start: not within 0.01 s \(start_timeout\): killed"):
                server.__enter__()
        assert server._process is None and server.url is None
        assert started[-1].returncode == -signal.SIGKILL  # killed, not left to finish its start
    assert len(started) == 2
    for name in ("start_timeout", "stop_timeout"):
        with pytest.raises(ValueError, match=f"{name} must be > 0 seconds, got 0.0"):
            LlamaCppServer("streamspec:SmolLM2-135M-Instruct", **{name: 0})
