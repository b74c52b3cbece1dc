"""Tokens/s of vLLM plain and of the streams drafter at each drafts-a-step K and batch size: the
measuring half of ``streamspec vllm-calibrate`` (`streamspec.vllm.calibrate`), run in vLLM's
environment.

    python -m streamspec.vllm.measure SPEC.json OUT.json

SPEC: ``{"model", "drafter" (folder), "prompts": [[ids], ...], "batch_sizes": [1, 8, ...], "ks": [0,
2, ...], "max_tokens", "repeats", "dtype", "max_model_len", "margin" (optional), "serving" (optional)}``.

Two engines live side by side in this process: vLLM plain, and the streams drafter started with
the largest K and a schedule. Between measurements the streams engine's scheduler is told the K of
the next one (its batch-size lookup, `set_drafts`), so one engine measures every K: each K costs
no engine start. At each batch size b, b requests at once (the prompts, repeated when there are
fewer; every prompt, b at a time, when there are more) decode `max_tokens` tokens each past their
end of sequence, so the batch stays at b; every
configuration is warmed up at that batch size first (new shapes cost the CPU's kernels a set-up),
and the configurations alternate for `repeats` rounds, each keeping its best round (another job on
the machine slows rounds, never speeds them up). Prefix caching is off, so no round reuses an
earlier one's prompts. Outputs are compared with plain vLLM's.

With ``"serving": true`` the workload is a server's instead: prefix caching on and every prompt in
the cache before the timed rounds (a server whose requests share their schemas or system prompts
prefills little), and each request stops at its end of sequence (or `max_tokens`), so the batch
drains as requests finish, as a burst of b requests does; tokens/s counts the tokens generated.

With a "margin", the schedule is chosen (`streamspec.vllm.calibrate.choose_schedule`) and a third
engine starts with it (the configuration calibrate writes): it must start, and its outputs and
tokens/s at each batch size are reported beside the others.
Progress goes to stdout as ``PROGRESS done total label`` lines.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

from .format import PEAGLE, streams_speculative_config

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engines in this process (see run.py)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# unbound: the OS keeps the compute thread off a core another job is busy on (a binding would pin it)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def start(spec: dict, speculative: dict | None, max_num_seqs: int):
    from vllm import LLM

    return LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
               max_model_len=spec.get("max_model_len"), max_num_seqs=max_num_seqs, skip_tokenizer_init=True,
               speculative_config=speculative, enable_prefix_caching=bool(spec.get("serving")), seed=0,
               distributed_executor_backend="uni")


def set_drafts(llm, k: int) -> None:
    """Make every batch size of `llm`'s schedule draft `k` a step (vLLM's scheduler reads its dense
    batch-size lookup each step; the engine core runs in this process)."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        lookup = scheduler.dynamic_sd_lookup
    except AttributeError as err:
        raise RuntimeError("this vLLM keeps its scheduler elsewhere: calibrate reads vLLM 0.32's in-process engine "
                           f"core (VLLM_ENABLE_V1_MULTIPROCESSING=0) ({err})") from err
    if lookup is None:
        raise RuntimeError("the streams engine started without a schedule (num_speculative_tokens_per_batch_size)")
    lookup[1:] = [k] * (len(lookup) - 1)


def decode(llm, prompts, size: int, max_tokens: int, ignore_eos: bool = True) -> tuple[list[list[int]], float]:
    """`prompts` decoded `size` at a time (each `max_tokens` tokens, or up to its end of sequence
    with ``ignore_eos=False``); their outputs and the seconds it took."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False)
    outputs = []
    start_time = time.perf_counter()
    for i in range(0, len(prompts), size):
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + size]], params, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in results]
    return outputs, time.perf_counter() - start_time


def batch(prompts: list[list[int]], size: int) -> list[list[int]]:
    """What batch size `size` decodes: every prompt, `size` at a time (repeated to fill the last
    batch, or one batch when `size` exceeds them)."""
    count = -(-max(len(prompts), size) // size) * size
    return [prompts[i % len(prompts)] for i in range(count)]


def measure(spec: dict, progress=print) -> dict:
    sizes, ks = [int(b) for b in spec["batch_sizes"]], [int(k) for k in spec["ks"]]
    layout = spec.get("layout", PEAGLE)
    k_max, repeats, tokens = max(max(ks), 2 if layout == PEAGLE else 1), int(spec.get("repeats", 2)), int(spec["max_tokens"])
    serving = bool(spec.get("serving"))

    def timed(llm, prompts, size: int) -> tuple[list[list[int]], float]:
        """One timed round: its outputs and tokens/s (the tokens generated)."""
        out, seconds = decode(llm, prompts, size, tokens, ignore_eos=not serving)
        return out, sum(map(len, out)) / seconds

    def warm_up(llm, prompts, size: int) -> None:
        """This batch size's shapes set up; serving: every prompt in the prefix cache."""
        decode(llm, prompts if serving else prompts[:size], size, min(tokens, 8))
    streams_config = streams_speculative_config(layout, spec["drafter"], k_max, [[1, max(sizes), k_max]])
    configs = ["plain"] + [f"K={k}" for k in ks]
    total = len(sizes) * len(configs) * (repeats + 1) + 2 + (len(sizes) + 1 if "margin" in spec else 0)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        progress(f"PROGRESS {done} {total} {label}")

    engines = {"plain": start(spec, None, max(sizes))}
    tick("plain engine started")
    engines["streams"] = start(spec, streams_config, max(sizes))
    tick("streams engine started")
    rows = []
    for size in sizes:
        prompts = batch(spec["prompts"], size)
        best: dict[str, float] = {}
        outputs: dict[str, list] = {}
        for round_ in range(repeats + 1):  # round 0 warms every configuration up at this batch size
            for config in configs:
                llm = engines["plain" if config == "plain" else "streams"]
                if config != "plain":
                    set_drafts(llm, int(config[2:]))
                if round_:
                    out, rate = timed(llm, prompts, size)
                    outputs.setdefault(config, out)
                    best[config] = max(best.get(config, 0.0), rate)
                else:
                    warm_up(llm, prompts, size)
                tick(f"batch {size} {config} {'round ' + str(round_) if round_ else 'warm-up'}")
        plain = outputs["plain"]
        rows.append({"batch_size": size, "tokens_per_s": best,
                     "identical": {c: outputs[c] == plain for c in configs if c != "plain"}, "outputs": plain})
    del engines["streams"]
    gc.collect()
    result = {"rows": rows, "num_speculative_tokens": k_max, "schedule_check": None}
    if "margin" in spec:  # choose, then start the chosen configuration and measure it
        from .calibrate import choose_schedule, speculative_config

        picks, schedule = choose_schedule(rows, float(spec["margin"]))
        result.update(picks=picks, schedule=schedule, schedule_check=[])
        engines["schedule"] = start(spec, speculative_config(spec["drafter"], schedule, layout), max(sizes))
        tick("schedule engine started")
        for row in rows:
            prompts = batch(spec["prompts"], row["batch_size"])
            warm_up(engines["schedule"], prompts, row["batch_size"])
            best = 0.0
            for _ in range(repeats):
                out, rate = timed(engines["schedule"], prompts, row["batch_size"])
                best = max(best, rate)
            tick(f"batch {row['batch_size']} schedule")
            result["schedule_check"].append({"batch_size": row["batch_size"], "tokens_per_s": best,
                                             "identical": out == row["outputs"]})
    for row in rows:
        del row["outputs"]
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m streamspec.vllm.measure SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    result = measure(spec, progress=lambda line: print(line, flush=True))
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
