"""The vLLM runner's pieces that need no vLLM: vLLM's `speculative_config` for each drafter, the
``vllm_suffix`` and ``vllm_eagle3`` rows' runs, the error that names the fix when arctic-inference
(vLLM's suffix decoding) is missing or a trained drafter's folder is, and what speculators is told
when it trains a peer drafter. tests/vllm/test_vllm_drafter.py runs the drafters in vLLM."""

from __future__ import annotations

import json
import os
import sys

import pytest

from streamspec.evaluation.peers import AUTO_PEERS, PEERS, peers_arg
from streamspec.vllm.client import SUFFIX_DECODING_MISSING, VLLMRunError, check_suffix_decoding, run_vllm
from streamspec.vllm.run import SUFFIX_DEFAULTS, engine_key, speculative_config


def test_suffix_drafter_config():
    config = speculative_config({"drafter": "suffix"})
    assert config == {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
                      "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 1.0,
                      "suffix_decoding_min_token_prob": 0.1}
    assert config == {"method": "suffix", **SUFFIX_DEFAULTS}
    # a run's own settings win; others keep the defaults
    config = speculative_config({"drafter": "suffix", "num_speculative_tokens": 4,
                                 "suffix_decoding_max_cached_requests": 100})
    assert config["num_speculative_tokens"] == 4 and config["suffix_decoding_max_cached_requests"] == 100
    assert config["suffix_decoding_max_tree_depth"] == 24
    # an engine of its own: not shared with plain or n-gram runs of the same model
    spec = {"model": "m"}
    keys = {engine_key(spec, {"drafter": d}) for d in ("none", "ngram", "suffix")}
    assert len(keys) == 3
    assert engine_key(spec, {"drafter": "suffix", "name": "a"}) == engine_key(spec, {"drafter": "suffix", "concurrency": 8})
    with pytest.raises(ValueError, match="none, ngram, suffix, streams, eagle3 or peagle"):
        speculative_config({"drafter": "medusa"})


def test_the_suffix_peer_is_named_not_automatic():
    assert "vllm_suffix" in PEERS and "vllm_suffix" not in AUTO_PEERS
    assert peers_arg("vllm,vllm_suffix") == ("vllm", "vllm_suffix")


def without_arctic_inference(tmp_path) -> dict[str, str]:
    """An environment whose `arctic_inference` has no suffix decoding (a package of that name
    first on the path), as in a vLLM environment built before `make vllm` built it."""
    (tmp_path / "shadow" / "arctic_inference").mkdir(parents=True)
    (tmp_path / "shadow" / "arctic_inference" / "__init__.py").write_text("")
    path = [str(tmp_path / "shadow")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path)}


def test_missing_suffix_decoding_names_the_fix(tmp_path):
    env = without_arctic_inference(tmp_path)
    with pytest.raises(RuntimeError, match="make vllm") as caught:
        check_suffix_decoding(python=sys.executable, env=env)
    assert "arctic-inference==0.3.0" in str(caught.value) and "arctic_inference.suffix_decoding" in str(caught.value)
    # the runner refuses a suffix run before it starts vLLM, with the same message
    spec = {"model": "unused", "prompts": [[5, 6, 7]], "max_tokens": 4, "runs": [{"drafter": "suffix"}]}
    with pytest.raises(VLLMRunError) as caught:
        run_vllm(spec, python=sys.executable, env=env, timeout=120)
    assert SUFFIX_DECODING_MISSING in caught.value.output


@pytest.fixture
def fake_vllm(monkeypatch) -> list[dict]:
    """vLLM's runner replaced by one that answers every run with two tokens (drafters accept 1.5 a
    step) and records the specs it was given (the returned list)."""
    import streamspec.vllm.client as client

    specs: list[dict] = []

    def fake_run(spec, timeout=None):
        specs.append({**spec, "timeout": timeout})
        return {"runs": [{"name": r["name"], "concurrency": r["concurrency"], "outputs": [[7, 8]], "tokens": 2,
                          "seconds": 0.1, "tokens_per_s": 20.0,
                          "mean_acceptance_length": None if r["drafter"] == "none" else 1.5} for r in spec["runs"]]}

    monkeypatch.setattr(client, "vllm_python", lambda python=None: sys.executable)
    monkeypatch.setattr(client, "run_vllm", fake_run)
    return specs


def test_the_vllm_suffix_rows(monkeypatch, fake_vllm):
    """`vllm_rows` with ``vllm_suffix``: plain vLLM beside it, each at both concurrencies, the suffix
    runs with the runner's defaults; a vLLM environment without arctic-inference is refused
    before anything runs."""
    import streamspec.vllm.client as client
    from streamspec.evaluation.vllm_peers import vllm_rows

    specs = fake_vllm
    monkeypatch.setattr(client, "check_suffix_decoding", lambda python=None, env=None: None)
    rows = vllm_rows(("vllm_suffix",), "unused", "base", [[1, 2]], 2, [[7, 8]], baseline_tps=10.0, concurrency=(1, 4))
    assert [(r["name"], r["drafter"], r["concurrency"]) for r in specs[0]["runs"]] == [
        ("vllm", "none", 1), ("vllm@4", "none", 4), ("vllm_suffix", "suffix", 1), ("vllm_suffix@4", "suffix", 4)]
    assert all(speculative_config(r) in (None, {"method": "suffix", **SUFFIX_DEFAULTS}) for r in specs[0]["runs"])
    assert sorted(rows) == ["vllm", "vllm@4", "vllm_suffix", "vllm_suffix@4"]
    assert rows["vllm_suffix"]["identical_to_vllm"] and rows["vllm_suffix"]["mean_acceptance_length"] == 1.5

    def missing(python=None, env=None):
        raise RuntimeError(SUFFIX_DECODING_MISSING)

    monkeypatch.setattr(client, "check_suffix_decoding", missing)
    with pytest.raises(RuntimeError, match="make vllm"):
        vllm_rows(("vllm", "vllm_suffix"), "unused", "base", [[1, 2]], 2, [[7, 8]], baseline_tps=10.0)
    assert len(specs) == 1  # nothing ran


def speculators_folder(path, kind: str = "eagle3", tokens: int = 3):
    """A folder with a speculators-format config.json, as `streamspec.vllm.peer_training` writes."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "speculators_model_type": kind, "draft_vocab_size": 8,
        "speculators_config": {"algorithm": kind, "proposal_methods": [{"speculative_tokens": tokens}]}}))
    return str(path)


def test_trained_drafter_configs(tmp_path):
    """vllm_eagle3 / vllm_peagle: vLLM's eagle3 method on the trained folder (P-EAGLE with parallel
    drafting), K the drafts it was trained for unless the run says; a missing or wrong folder is
    refused naming how to train one."""
    eagle3, peagle = speculators_folder(tmp_path / "e"), speculators_folder(tmp_path / "p", "peagle", 4)
    assert speculative_config({"drafter": "eagle3", "folder": eagle3}) == {
        "method": "eagle3", "model": eagle3, "num_speculative_tokens": 3}
    assert speculative_config({"drafter": "eagle3", "folder": eagle3, "num_speculative_tokens": 5})[
        "num_speculative_tokens"] == 5
    assert speculative_config({"drafter": "peagle", "folder": peagle}) == {
        "method": "eagle3", "model": peagle, "parallel_drafting": True, "num_speculative_tokens": 4}
    spec = {"model": "m"}
    assert engine_key(spec, {"drafter": "eagle3", "folder": eagle3}) != engine_key(spec, {"drafter": "none"})
    with pytest.raises(ValueError, match="train_peer_drafters.py"):
        speculative_config({"drafter": "eagle3"})
    with pytest.raises(FileNotFoundError, match="no config.json.*train_peer_drafters.py --method eagle3"):
        speculative_config({"drafter": "eagle3", "folder": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="holds a drafter of type 'peagle', not 'eagle3'"):
        speculative_config({"drafter": "eagle3", "folder": peagle})
    assert "vllm_eagle3" in PEERS and "vllm_peagle" in PEERS and "vllm_eagle3" not in peers_arg("all")


def test_the_trained_drafter_rows(tmp_path, fake_vllm):
    """`vllm_rows` with ``vllm_eagle3``: its runs carry the drafter's folder; asked for without
    one (or with an empty folder), it is refused before anything runs, naming the way to train one."""
    from streamspec.evaluation.vllm_peers import vllm_rows

    specs = fake_vllm
    folder = speculators_folder(tmp_path / "eagle3")
    rows = vllm_rows(("vllm_eagle3",), "unused", "base", [[1, 2]], 2, [[7, 8]], baseline_tps=10.0, concurrency=(1,),
                     drafters={"eagle3": folder})
    assert [(r["name"], r["drafter"], r.get("folder")) for r in specs[0]["runs"]] == [
        ("vllm", "none", None), ("vllm_eagle3", "eagle3", folder)]
    assert sorted(rows) == ["vllm", "vllm_eagle3"] and rows["vllm_eagle3"]["mean_acceptance_length"] == 1.5
    with pytest.raises(ValueError, match="--eagle3 FOLDER"):
        vllm_rows(("vllm_eagle3",), "unused", "base", [[1, 2]], 2, [[7, 8]], baseline_tps=10.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="train_peer_drafters.py"):
        vllm_rows(("vllm", "vllm_eagle3"), "unused", "base", [[1, 2]], 2, [[7, 8]], baseline_tps=10.0,
                  drafters={"eagle3": str(tmp_path / "empty")})
    assert len(specs) == 1  # nothing ran


def test_peer_training_settings():
    """What speculators is told (no speculators here): its own CPU options, one full-attention
    draft layer, the target layers vLLM hands an EAGLE-3 drafter (ascending, distinct)."""
    from pathlib import Path

    from streamspec.vllm.peer_training import DEFAULTS, default_layer_ids, train_args

    assert default_layer_ids(30) == [2, 15, 27] and default_layer_ids(32) == [2, 16, 29]
    assert default_layer_ids(4) == [1, 2, 3]  # (2, 2, 1) would repeat a layer
    with pytest.raises(ValueError, match="too shallow"):
        default_layer_ids(2)
    spec = {**DEFAULTS, "model": "base", "max_steps": 7}
    args = train_args(spec, Path("data"), Path("work/checkpoints"), [2, 15, 27], 2)
    for flag in ("--draft-attn-impl=sdpa", "--loss-implementation=eager", "--num-workers=0", "--speculator-type=eagle3",
                 "--hidden-states-dtype=float32", "--num-layers=1", "--max-steps=7", "--ttt-steps=3",
                 "--draft-vocab-size=8192", "--mask-token-id=2"):
        assert flag in args
    assert args[args.index("--target-layer-ids") + 1:][:3] == ["2", "15", "27"]
    assert args[args.index("--full-attention-indices") + 1] == "0"
    peagle = train_args({**spec, "method": "peagle", "draft_vocab_size": None}, Path("d"), Path("c"), [1, 2, 3], 0)
    assert "--num-depths=4" in peagle and not any(a.startswith(("--ttt-steps", "--draft-vocab-size")) for a in peagle)
    assert "--no-resume-from-checkpoint" in args  # a fresh run by default
    resumed = train_args({**spec, "resume": True, "checkpoint_freq": 0.1, "hidden_states_dtype": "bfloat16"},
                         Path("d"), Path("c"), [1, 2, 3], 0)
    assert "--no-resume-from-checkpoint" not in resumed
    assert "--checkpoint-freq=0.1" in resumed and "--hidden-states-dtype=bfloat16" in resumed
    assert not any(a.startswith("--hidden-states-backend") for a in args)  # files: speculators' own backend
    online = train_args({**spec, "hidden_states": "online"}, Path("d"), Path("c"), [1, 2, 3], 0)
    assert "--hidden-states-backend=streamspec-target" in online


def test_eval_runs_every_vllm_row_at_each_concurrency_asked_for(monkeypatch, fake_vllm):
    """`streamspec eval --vllm-concurrency 1 8 32` reaches the vLLM runner as one run of each row
    at each concurrency."""
    from streamspec.evaluation import benchmark
    from streamspec.evaluation.vllm_peers import vllm_rows

    seen = {}

    def fake_benchmark(checkpoint, **kwargs):
        seen.update(kwargs)
        return {}

    monkeypatch.setattr(benchmark, "run_benchmark", fake_benchmark)
    from streamspec.cli import main

    main(["eval", "--checkpoint", "c", "--peers", "vllm_ngram", "--vllm-concurrency", "1", "8", "32"])
    assert seen["vllm_options"] == {"concurrency": (1, 8, 32)}
    # --vllm-streams: an exported drafter folder for the streams rows, checked before anything runs
    assert main(["eval", "--checkpoint", "c", "--peers", "vllm_streams", "--vllm-streams", "/nonexistent"]) != 0
    vllm_rows(("vllm_ngram",), "unused", "base", [[1, 2]], 2, [[7, 8]], baseline_tps=10.0, **seen["vllm_options"])
    assert [(r["name"], r["concurrency"]) for r in fake_vllm[0]["runs"]] == [
        ("vllm", 1), ("vllm@8", 8), ("vllm@32", 32), ("vllm_ngram", 1), ("vllm_ngram@8", 8), ("vllm_ngram@32", 32)]
    # the vLLM process's time limit grows with the runs and prompts (a fixed one cut a 21-run table short)
    vllm_rows(("vllm_ngram",), "unused", "base", [[1, 2]] * 32, 2, [[7, 8]] * 32, baseline_tps=10.0,
              **seen["vllm_options"])
    assert fake_vllm[0]["timeout"] == 1800 and fake_vllm[1]["timeout"] == 6 * 32 * 60


@pytest.mark.parametrize("given, expected", [({"OMP_NUM_THREADS": "1"}, "1"),
                                             ({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}, "2"),
                                             ({}, None)])
def test_the_ngram_drafters_numba_pool_gets_torchs_threads(given, expected):
    """vLLM's n-gram drafter runs numba kernels whose OpenMP pool would take every core: the runner
    gives it torch's threads (``OMP_NUM_THREADS``) unless numba's own setting says otherwise."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    code = "import os, streamspec.vllm.run; print(os.environ.get('NUMBA_NUM_THREADS'))"
    out = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)
