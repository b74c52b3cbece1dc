"""The peers a user would run beside streamspec, and the machine's limit, as benchmark rows.

- ``transformers_compiled``: transformers `generate` with a static cache and `torch.compile`
  (inductor, fullgraph, static shapes; on a CPU with inductor's weight freezing): the honest
  "same framework, compiled" baseline. The cache's length is bucketed (a multiple of
  `CAPACITY_STEP`), so one compiled graph serves every prompt of a bucket; the compile time of the
  first call is paid in the benchmark's untimed warm-up and reported (`compile_seconds`).
- ``llama_cpp`` / ``llama_cpp_lookup``: the same model through llama.cpp's server (the
  ``xllamacpp`` wheel, in process, `streamspec.llamacpp.LlamaCppServer`) on a GGUF (the default
  model's own, or one given), plain and with llama.cpp's own n-gram (prompt-lookup) speculation.
  A quantized GGUF computes other numbers than the transformers model: its outputs are compared,
  not required equal (``identical_to_baseline``).
- ``memory_floor``: what one pass must read (the weights, and the KV cache at the run's mean
  context) over this machine's measured read bandwidth (`measure_read_bandwidth`, the benchmark's
  thread count): the fastest a pass can be when it is bound by memory, as it is at batch 1. Every
  row gets ``floor_ms`` (its own model's floor) and ``x_floor`` (its decoding step's ms as a
  multiple of it: the step split when the row has one, else ms per pass with its prefill).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

# in process, run by --peers auto
AUTO_PEERS = ("transformers_compiled", "llama_cpp", "llama_cpp_lookup", "memory_floor")
# vLLM in its own environment (`streamspec.evaluation.vllm_peers`): named, or --peers all
PEERS = AUTO_PEERS + ("vllm", "vllm_ngram", "vllm_suffix", "vllm_streams", "vllm_eagle3", "vllm_peagle")
# vLLM with a drafter trained for the model (`streamspec.evaluation.peer_drafters`): named only,
# with the drafter's folder (streamspec eval --eagle3 / --peagle FOLDER); not in --peers all
TRAINED_PEERS = ("vllm_eagle3", "vllm_peagle")
CAPACITY_STEP = 256  # transformers_compiled's static cache holds a multiple of this many tokens


def peers_arg(text: str) -> tuple[str, ...]:
    """``--peers``: ``auto`` (the in-process peers, `AUTO_PEERS`; the llama.cpp rows when a GGUF is
    known), ``all`` (with vLLM's rows too, but for those of trained drafters, `TRAINED_PEERS`,
    which are named with their folders), ``none``, or a comma-separated list of `PEERS`."""
    if text == "auto":
        return AUTO_PEERS
    if text == "all":
        return tuple(p for p in PEERS if p not in TRAINED_PEERS)
    if text in ("none", ""):
        return ()
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}: choose from {list(PEERS)}, 'auto' or 'none'")
    return names


def check_peers(peers) -> tuple[str, ...]:
    peers = tuple(peers or ())
    unknown = [n for n in peers if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}: choose from {list(PEERS)}")
    return peers


# ---------------------------------------------------------------------------------------------
# transformers, compiled


def transformers_compiled_method(model, eos_token_id, cpp_wrapper: bool = False) -> Callable:
    """transformers `generate` with a static cache through `torch.compile` (see the module
    docstring). Greedy; counts one pass per new token (the prefill gives the first). The method's
    ``compile_seconds`` holds the first call's duration per cache length (its compile)."""
    from transformers import CompileConfig, StaticCache

    device = next(model.parameters()).device
    options = {"freezing": True} if device.type == "cpu" else None
    if cpp_wrapper:
        options = {**(options or {}), "cpp_wrapper": True}
    # torch.compile takes a mode or options, not both: CUDA graphs on a GPU, inductor's options on a CPU
    config = CompileConfig(fullgraph=True, dynamic=False, mode=None if options else "reduce-overhead", options=options)
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    caches: dict[int, object] = {}
    compile_seconds: dict[int, float] = {}

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], int, list[int], dict]:
        from ..kernels import default_kernels

        ids = ids.to(device)
        capacity = -(-(ids.shape[1] + max_new_tokens) // CAPACITY_STEP) * CAPACITY_STEP
        first = capacity not in caches
        if first:
            caches[capacity] = StaticCache(config=model.config, max_cache_len=capacity)
        else:
            caches[capacity].reset()
        start = time.perf_counter()
        # the benchmark's pass counters hook the model (`CallCounter`): a compiled graph would trace them
        hooks = [(d, dict(d)) for d in (model._forward_pre_hooks, model._forward_hooks)]
        for d, _ in hooks:
            d.clear()
        try:
            with torch.no_grad(), default_kernels(model):  # inductor packs the weights itself
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=eos_token_id, pad_token_id=eos_token_id, cache=caches[capacity],
                    compile_config=config,
                )
        finally:
            for d, saved in hooks:
                d.update(saved)
        if first:
            compile_seconds[capacity] = round(time.perf_counter() - start, 1)
        new = out[0, ids.shape[1]:].tolist()
        return new, len(new), [], {}

    run.__name__ = "transformers_compiled"
    run.compile_seconds = compile_seconds
    return run


# ---------------------------------------------------------------------------------------------
# llama.cpp


def llama_cpp_method(name: str, url: str) -> Callable:
    """Greedy completions of the prompt's token ids from the llama.cpp server at `url` (its
    ``/completion`` endpoint, no prompt cache: every prompt prefilled whole, as ours are). Passes
    are the tokens predicted less the drafts llama.cpp accepted; the split is llama.cpp's own
    timings (prefill, decoding) and the rest (HTTP and JSON)."""
    from ..llamacpp import post_json

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], int, list[int], dict]:
        start = time.perf_counter()
        answer = post_json(url.rstrip("/") + "/completion", {
            "prompt": [int(t) for t in ids[0].tolist()], "n_predict": max_new_tokens, "temperature": 0.0,
            "top_k": 1, "cache_prompt": False, "return_tokens": True,
        })
        wall = time.perf_counter() - start
        tokens = [int(t) for t in answer.get("tokens") or []]
        timings = answer.get("timings") or {}
        accepted = int(timings.get("draft_n_accepted") or 0)
        passes = max(len(tokens) - accepted, 1 if tokens else 0)
        prefill, decode = timings.get("prompt_ms", 0.0) / 1000, timings.get("predicted_ms", 0.0) / 1000
        split = {"prefill": prefill, "forward": decode, "head": 0.0, "overhead": max(wall - prefill - decode, 0.0)}
        return tokens, passes, [], split

    run.__name__ = name
    return run


# ---------------------------------------------------------------------------------------------
# the memory floor


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """This machine's read bandwidth in bytes/s at torch's thread count: the best of `repeats`
    sums over a `megabytes` float32 tensor (larger than any cache, read once per sum)."""
    if megabytes < 64:
        raise ValueError(f"megabytes must be >= 64 (a buffer that fits a cache measures the cache), got {megabytes}")
    buffer = torch.ones(megabytes * 2**20 // 4)
    buffer.sum()  # touch every page once
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decoding pass reads: every parameter once (tied ones once), less the
    input embedding table when it is not also the LM head (a pass reads only its tokens' rows)."""
    seen, total = set(), 0
    skip = None
    inner = getattr(model, "hf_model", model)
    if hasattr(inner, "get_input_embeddings") and hasattr(inner, "get_output_embeddings"):
        inputs, outputs = inner.get_input_embeddings(), inner.get_output_embeddings()
        if inputs is not None and (outputs is None or outputs.weight.data_ptr() != inputs.weight.data_ptr()):
            skip = inputs.weight.data_ptr()
    for param in model.parameters():
        ptr = param.data_ptr()
        if ptr in seen or ptr == skip:
            continue
        seen.add(ptr)
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one cached token holds across the model's layers."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def floor_ms(model_bytes: int, kv_per_token: int, context: float, bandwidth: float) -> float:
    """The memory floor of one pass in ms: weights plus the KV cache at `context` tokens."""
    return 1000 * (model_bytes + kv_per_token * context) / bandwidth


def add_memory_floor(summary: dict, floors: dict[str, float], bandwidth: float, details: dict) -> None:
    """Give every row of `summary` its floor (``floor_ms``: `floors` by row, default the base
    model's) and ``x_floor``; add the ``memory_floor`` row (one token per pass at the floor)."""
    base_floor = floors.get("baseline")
    for name, entry in summary.items():
        floor = floors.get(name, base_floor)
        if not floor:
            continue
        step = None
        if entry.get("ms_per_step_forward") is not None:
            step = sum(entry.get(f"ms_per_step_{k}") or 0.0 for k in ("forward", "head", "overhead"))
        basis, ms = ("decoding step", step) if step else ("pass, prefill included", entry.get("ms_per_pass"))
        entry["floor_ms"] = round(floor, 2)
        if ms:
            entry["x_floor"] = round(ms / floor, 2)
            entry["floor_basis"] = basis
    base = summary.get("baseline", {})
    tps = 1000 / base_floor if base_floor else None
    summary["memory_floor"] = {
        "tokens_per_second": round(tps, 2) if tps else None,
        "speedup": round(tps / base["tokens_per_second"], 3) if tps and base.get("tokens_per_second") else None,
        "ms_per_pass": round(base_floor, 2) if base_floor else None,
        "read_gb_per_s": round(bandwidth / 1e9, 2),
        **details,
    }


def peer_methods(peers, gguf, base_model, eos, baseline):
    """The peer rows' methods and a context that holds their
    llama.cpp servers for the run (its ``gguf`` attribute: the GGUF they run, or None)."""
    from contextlib import ExitStack

    from ..llamacpp import LlamaCppServer

    auto = peers == "auto"
    peers = AUTO_PEERS if auto else check_peers(peers)
    stack = ExitStack()
    stack.gguf = None
    methods = {}
    if "transformers_compiled" in peers:
        methods["transformers_compiled"] = transformers_compiled_method(base_model, eos)
    wanted = [p for p in peers if p.startswith("llama_cpp")]
    if wanted:
        path = gguf
        if path is None and baseline is None:
            from ..assets import DEFAULT_MODEL_ID

            if getattr(base_model.config, "_name_or_path", None) == DEFAULT_MODEL_ID:  # its GGUF is this model
                path = DEFAULT_MODEL_ID
        if path is None:
            if not auto:
                raise ValueError(f"the {wanted} rows need a GGUF of the baseline's model: give gguf=PATH (--gguf)")
            print(f"peers: no GGUF of the baseline's model known, so no {', '.join(wanted)} rows (give --gguf PATH)")
            wanted = []
        try:
            for name in wanted:
                server = stack.enter_context(LlamaCppServer(path, threads=torch.get_num_threads(),
                                                            speculative="ngram" if name == "llama_cpp_lookup" else None))
                methods[name] = llama_cpp_method(name, server.url)
                stack.gguf = server.gguf
        except ImportError:
            if not auto:
                raise
            print("peers: xllamacpp is not installed, so no llama.cpp rows")
            for name in wanted:
                methods.pop(name, None)
    stack.floor = "memory_floor" in peers
    return methods, stack


def peer_summary(summary, results, methods, peers, rows, tokenizer, model, base_model, heads, gguf_of) -> None:
    """The peer rows' extra figures: compile times, agreement with the baseline, the memory floor."""
    from ..data.build import prompt_ids

    base_ids = results["baseline"].token_ids
    for name in ("transformers_compiled", "llama_cpp", "llama_cpp_lookup"):
        if name in summary:
            same = sum(a == b for a, b in zip(results[name].token_ids, base_ids))
            summary[name]["identical_outputs_share"] = round(same / max(len(base_ids), 1), 3)
    if "transformers_compiled" in summary:
        entry, run, base = summary["transformers_compiled"], results["transformers_compiled"], results["baseline"]
        entry["compile_seconds"] = methods["transformers_compiled"].compile_seconds
        steps = run.passes - run.prompts
        if base.split.get("prefill") and steps > 0:
            # its prefill runs eager (transformers compiles the decoding step only), as the
            # baseline's on the same prompts: the rest of its time is its decoding steps
            entry["ms_per_step_forward"] = round(1000 * max(run.seconds - base.split["prefill"], 0.0) / steps, 2)
            entry["ms_prefill"] = round(1000 * base.split["prefill"] / run.prompts, 1)
            entry["prefill_from"] = "baseline"
    if not getattr(gguf_of, "floor", False) or not rows:
        return
    bandwidth = measure_read_bandwidth()
    prompt = sum(prompt_ids(tokenizer, r).shape[1] for r in rows) / len(rows)
    dtype = next(base_model.parameters()).dtype
    kv = kv_bytes_per_token(base_model.config, dtype)
    sizes = {"baseline": weight_bytes(base_model), "streams": weight_bytes(model)}
    if heads is not None:
        sizes["medusa"] = weight_bytes(heads)
    if gguf_of.gguf is not None:
        sizes["gguf"] = gguf_of.gguf.stat().st_size
    floors = {}
    for name, entry in summary.items():
        context = prompt + entry["tokens"] / (2 * len(rows))
        if name.startswith("llama_cpp"):
            size, per_token = sizes["gguf"], kv_bytes_per_token(base_model.config, torch.float16)
        else:
            key = "medusa" if name == "medusa" else "baseline" if name in ("baseline", "baseline_default_kernels",
                                                                           "prompt_lookup", "transformers_compiled") else "streams"
            size, per_token = sizes[key], kv
        floors[name] = floor_ms(size, per_token, context, bandwidth)
    add_memory_floor(summary, floors, bandwidth, {
        "weight_bytes": sizes,
        "kv_kb_per_token": round(kv / 1024, 1), "mean_prompt_tokens": round(prompt, 1),
        "threads": torch.get_num_threads()})
