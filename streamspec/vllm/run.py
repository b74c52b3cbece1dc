"""Decode token-id prompts with vLLM, plain or with a drafter, and write what came out as JSON.

Runs inside vLLM's environment (``make vllm`` builds ``.venv-vllm``): streamspec's benchmark and
tests call it through a subprocess, so the rest of streamspec never imports vLLM.

    python -m streamspec.vllm.run SPEC.json OUT.json

SPEC: ``{"model": folder, "dtype": "float32", "max_tokens": 96, "max_model_len": null (the model's),
"prompts": [[token ids], ...], "runs": [{"name": ..., "drafter": "none" | "ngram" | "suffix" |
"streams" | "eagle3" | "peagle", "folder": drafter folder, "num_speculative_tokens": K,
"concurrency": 1 | n, "model": folder (default: the spec's), "prompts": (default: the spec's)}, ...],
"reset_prefix_cache": true}``;
"max_tokens" may be a list (one a prompt); each run starts with vLLM's prefix cache emptied (unless
"reset_prefix_cache" is false), so it never reads the prompts an earlier run on its engine decoded;
a streams run may carry a "schedule" (vLLM's ``num_speculative_tokens_per_batch_size``: ``[[first
batch size, last, K], ...]``; K defaults to the schedule's most), "zero_drafts" ("skip" | "cache":
what a step with no drafts does, `streamspec.vllm.schedule`) and "block_drop" (true: vLLM's
recompute of the last cached prompt block, which `streamspec.vllm.format.streams_speculative_config` turns off
for the DFlash layout); a suffix run may also set
vLLM's ``suffix_decoding_*`` options (`SUFFIX_DEFAULTS`); an eagle3 / peagle run's folder is a
drafter speculators trained (`PEER_DRAFTERS`; K defaults to the drafts it was trained for).
Consecutive runs of the same model and drafter share one engine (started with room for the
largest concurrency among them; an engine's start costs more than most runs); a run of another
model or drafter gets a fresh one. OUT holds, per run, each prompt's
output token ids, the wall time of the decode, tokens/s, and vLLM's own speculative counters (read
before and after the run, so runs on a shared engine count only their own), with the drafts
accepted at each draft position. A streams run's folder picks vLLM's method by its layout
(``streamspec export --format vllm --layout``: eagle3 with parallel drafting, or dflash).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

from .client import SUFFIX_DECODING_MISSING
from .format import ALIGNMENT_ENV, PEAGLE, streams_speculative_config

# vLLM's CPU build sizes its KV cache from this (GiB); its default takes most of the machine's memory
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's n-gram drafter runs numba kernels on numba's OpenMP pool, which is sized to every core of
# the machine by default, whatever threads torch was given; its idle workers wait spinning, and with
# another job busy on the other core of a 2-core machine the n-gram row ran at 1.1 tokens/s, 22.7
# with one numba thread (8 Spider questions, one at a time). The pool gets torch's threads.
if os.environ.get("OMP_NUM_THREADS"):
    os.environ.setdefault("NUMBA_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
# the engine in this process, on the model's thread: with its own engine-core process, vLLM starts
# three times slower here and its engine core spins (sched_yield) on a core the model needs
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

_CALLER_ZERO_DRAFTS = os.environ.get("STREAMSPEC_VLLM_ZERO_DRAFTS")  # `streamspec.vllm.schedule.ZERO_DRAFTS_ENV`

# vLLM's suffix decoding (https://arxiv.org/abs/2411.04975; its suffix trees are arctic-inference's
# C++ extension, which `make vllm` builds): drafts continue the longest match of the text's end in
# suffix trees of the request's prompt and output so far, as long as the match supports (at most
# max_spec_factor × its length) and while a token's frequency there is at least min_token_prob.
# vLLM's own defaults, but for two:
# - num_speculative_tokens 8 (vLLM's default is the tree depth, 24): on a CPU every drafted token is
#   a row of the verification pass, and a long draft past the match's end mostly costs;
# - max_cached_requests 0: no global tree of earlier responses. Runs on one engine decode the same
#   prompts (and the warm-up decodes the first), so later runs would draft the earlier runs' outputs.
#   A run may set it to measure the method with that tree: alone in its spec, since consecutive
#   runs of the same settings share an engine.
SUFFIX_DEFAULTS = {"num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
                   "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 1.0,
                   "suffix_decoding_min_token_prob": 0.1}
# Peer drafters trained by vLLM's training library, speculators (`streamspec.vllm.peer_training`):
# EAGLE-3 (one autoregressive draft pass per drafted token) and P-EAGLE (all drafts from one pass:
# vLLM's parallel drafting). Both are vLLM's eagle3 method on a speculators-format folder.
PEER_DRAFTERS = ("eagle3", "peagle")


def speculative_config(run: dict) -> dict | None:
    """vLLM's ``speculative_config`` for one run of the spec."""
    drafter = run.get("drafter", "none")
    if drafter == "none":
        return None
    if drafter == "ngram":
        return {"method": "ngram", "num_speculative_tokens": run.get("num_speculative_tokens", 4),
                "prompt_lookup_max": run.get("prompt_lookup_max", 4), "prompt_lookup_min": 1}
    if drafter == "suffix":
        return {"method": "suffix", **{k: run.get(k, v) for k, v in SUFFIX_DEFAULTS.items()}}
    if drafter == "streams":
        with open(os.path.join(run["folder"], "config.json"), encoding="utf-8") as f:
            facts = json.load(f)["streamspec"]
        # the folder's layout picks vLLM's method (streamspec.vllm.format.LAYOUTS)
        schedule = run.get("schedule")  # drafts by batch size (`streamspec.vllm.schedule`)
        if run.get("num_speculative_tokens"):
            drafts = run["num_speculative_tokens"]
        elif schedule and max(int(k) for _, _, k in schedule) > 0:  # the schedule's most
            drafts = max(int(k) for _, _, k in schedule)
        else:  # the folder's recommendation: every stream drafts
            drafts = facts["num_speculative_tokens"]
        config = streams_speculative_config(facts.get("layout", PEAGLE), run["folder"], drafts, schedule)
        if "block_drop" in run:  # vLLM's recompute of the last cached prompt block, on or off for this run
            config["disable_eagle_block_drop"] = not run["block_drop"]
        return config
    if drafter in PEER_DRAFTERS:
        folder = check_drafter_folder(drafter, run.get("folder"))
        config = {"method": "eagle3", "model": folder}
        if drafter == "peagle":
            config["parallel_drafting"] = True
        config["num_speculative_tokens"] = run.get("num_speculative_tokens") or trained_speculative_tokens(folder)
        return config
    raise ValueError(f"drafter must be none, ngram, suffix, streams, eagle3 or peagle, got {drafter!r}")


def check_drafter_folder(drafter: str, folder: str | None) -> str:
    """`folder` when it holds a trained EAGLE-3 / P-EAGLE drafter (speculators' format, what
    `streamspec.vllm.peer_training` writes); raises naming the way to train one otherwise."""
    how = f"train one with `python eval/train_peer_drafters.py --method {drafter}` and pass its folder"
    if not folder:
        raise ValueError(f"drafter {drafter!r} needs the folder of a trained drafter: {how}")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"drafter {drafter!r}: {folder} holds no drafter (no config.json): {how}")
    with open(path, encoding="utf-8") as f:
        kind = json.load(f).get("speculators_model_type")
    if kind != drafter:
        raise ValueError(f"drafter {drafter!r}: {folder} holds a drafter of type {kind!r}, not {drafter!r}")
    return folder


def trained_speculative_tokens(folder: str) -> int:
    """The drafts a step the drafter was trained for (speculators' proposal method: its TTT steps)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return int(json.load(f)["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def require_suffix_decoding() -> None:
    """Raises, naming the fix, when this environment lacks arctic-inference's suffix trees (vLLM's
    own message would ask for another version of the package)."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401  (loads the C++ extension)
    except ImportError as err:
        raise RuntimeError(f"{SUFFIX_DECODING_MISSING} ({err})") from err


PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# prompt tokens looked up in vLLM's prefix cache, and those found there
PREFIX_CACHE = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*``) and its prefix-cache counters
    (`PREFIX_CACHE`) as name -> value; the accepted drafts per draft position (`PER_POSITION`) as a
    list, position 1 first."""
    found: dict = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:spec_decode") and metric.name not in PREFIX_CACHE:
            continue
        if hasattr(metric, "values"):  # a vector: one count per draft position
            had = found.get(metric.name, [])
            found[metric.name] = [a + b for a, b in zip(had, metric.values)] + list(metric.values[len(had):])
        elif hasattr(metric, "value"):
            found[metric.name] = found.get(metric.name, 0) + metric.value
    return found


def counter_change(before: dict, after: dict) -> dict:
    """What the counters moved by between two reads (vectors element by element)."""
    change = {}
    for name, value in after.items():
        old = before.get(name, [] if isinstance(value, list) else 0)
        if isinstance(value, list):
            change[name] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
        else:
            change[name] = value - old
    return change


def engine_key(spec: dict, run: dict) -> str:
    """What an engine is made of for `run`: runs with the same key can share one."""
    return json.dumps({"model": run.get("model", spec["model"]), "speculative": speculative_config(run),
                       "zero_drafts": run.get("zero_drafts")}, sort_keys=True)


def start_engine(spec: dict, run: dict, max_num_seqs: int):
    """A vLLM engine for `run`'s model and drafter, with room for `max_num_seqs` requests at once."""
    if run.get("drafter") == "suffix":
        require_suffix_decoding()
    from vllm import LLM

    from .schedule import ZERO_DRAFTS_ENV

    # what the streams drafter does at K' = 0 (read when the engine starts): the run's, else the caller's
    mode = run.get("zero_drafts") or _CALLER_ZERO_DRAFTS
    if mode:
        os.environ[ZERO_DRAFTS_ENV] = mode
    else:
        os.environ.pop(ZERO_DRAFTS_ENV, None)
    return LLM(model=run.get("model", spec["model"]), dtype=spec.get("dtype", "float32"),
               enforce_eager=spec.get("enforce_eager", True), max_model_len=spec.get("max_model_len"),
               max_num_seqs=max(max_num_seqs, 1), skip_tokenizer_init=True, speculative_config=speculative_config(run),
               disable_log_stats=False, seed=0,
               distributed_executor_backend="uni" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else None)


def decode(llm, spec: dict, run: dict) -> dict:
    """One run on `llm`: every prompt (one at a time, or `concurrency` at once), its figures."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    concurrency = int(run.get("concurrency", 1))
    speculative = speculative_config(run)
    max_tokens = spec.get("max_tokens", 96)  # or one a prompt
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run.get("prompts", spec["prompts"])]
    if isinstance(max_tokens, list) and len(max_tokens) != len(prompts):
        raise ValueError(f"run {run.get('name', '?')!r}: {len(max_tokens)} max_tokens for {len(prompts)} prompts "
                         "(a list gives one a prompt; a run with its own prompts needs one number)")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=spec.get("ignore_eos", False), detokenize=False)
              for n in (max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts))]
    if spec.get("warmup", True):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)
    if spec.get("reset_prefix_cache", True):
        # a run's prompts start uncached, whatever ran on this engine before (the warm-up, or the same
        # prompts at another concurrency): prompts still share their common prefixes within the run
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache before the run (a request still running?)")
    before = counters(llm)
    outputs: list[list[int]] = []
    log = os.environ.get(ALIGNMENT_ENV)
    log_lines: list[int] = []  # the drafter's alignment log: its length after each batch
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        for result in llm.generate(prompts[i:i + concurrency], params[i:i + concurrency], use_tqdm=False):
            outputs.append(list(result.outputs[0].token_ids))
        if log and run.get("drafter") == "streams":
            log_lines.append(_lines(log))
    seconds = time.perf_counter() - start
    after = counters(llm)
    spec_counters = counter_change(before, after)
    drafts = spec_counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = spec_counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    tokens = sum(len(o) for o in outputs)
    return {"name": run.get("name", run.get("drafter", "none")), "drafter": run.get("drafter", "none"),
            "num_speculative_tokens": (speculative or {}).get("num_speculative_tokens"),
            "concurrency": concurrency, "outputs": outputs, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "counters": spec_counters,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            # the share of steps whose draft at position i (1 first) was accepted
            "acceptance_per_position": [n / drafts for n in spec_counters.get(PER_POSITION, [])] if drafts else None,
            "alignment_lines": log_lines}


def _same_engine(spec: dict, runs: list[dict], key: str) -> list[dict]:
    """The runs at the head of `runs` that share the engine `key`."""
    out = []
    for run in runs:
        if engine_key(spec, run) != key:
            break
        out.append(run)
    return out


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m streamspec.vllm.run SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    runs, results = spec["runs"], []
    llm, key = None, None
    for i, run in enumerate(runs):
        if engine_key(spec, run) != key:
            if key is not None and NUMBA_LIBRARY in sys.modules:
                llm = None  # this process's engine goes before the child's starts
                gc.collect()
                return _rest_in_a_new_process(spec, runs[i:], results, argv[1])
            llm = None  # the last engine goes before the next one starts
            gc.collect()
            key = engine_key(spec, run)
            sharing = _same_engine(spec, runs[i:], key)
            llm = start_engine(spec, run, max(int(r.get("concurrency", 1)) for r in sharing))
        results.append(decode(llm, spec, run))
        _write(argv[1], results)  # after every run: a later failure keeps the earlier
    return 0


# vLLM 0.32 fails to start an engine in a process where an earlier engine ran its n-gram drafter:
# that drafter's numba loads llvmlite, whose library object answers every attribute (`__dict__`
# too) with a C-function wrapper, and the CPU worker's Triton-kernel override scan
# (`vllm.triton_utils.dispatcher._rebind_kernels`, over every module) calls ``.get`` on it. Once
# llvmlite is loaded, the next engine starts in a fresh process.
NUMBA_LIBRARY = "llvmlite.binding.ffi"


def _write(path: str, results: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"runs": results}, f)


def _rest_in_a_new_process(spec: dict, rest: list[dict], results: list[dict], out: str) -> int:
    """`rest` of the runs in a child process (this module again); its results after `results` in
    `out`, also when the child fails (what it finished is kept). Returns the child's status."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="streamspec-vllm-rest-") as tmp:
        spec_path, rest_out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump({**spec, "runs": rest}, f)
        sys.stdout.flush()
        sys.stderr.flush()
        status = subprocess.call([sys.executable, "-m", "streamspec.vllm.run", spec_path, rest_out])
        if os.path.exists(rest_out):
            with open(rest_out, encoding="utf-8") as f:
                results = results + json.load(f)["runs"]
    _write(out, results)
    return status


if __name__ == "__main__":
    sys.exit(main())
