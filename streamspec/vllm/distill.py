"""vLLM's offline engine as a greedy generator for distillation, in vLLM's environment.

    python -m streamspec.vllm.distill SPEC.json

SPEC: ``{"model": folder, "dtype": "float32", "max_num_seqs": 32, "max_model_len": null (the
model's), "threads": 1, "seed": 0}``. The engine starts once; then each line on stdin is a
request ``{"prompts": [[token ids], ...], "max_tokens": n, "stop_token_ids": [...]}`` decoded
greedily by one ``LLM.generate`` (vLLM keeps up to ``max_num_seqs`` of them in flight), and each
answer is one line ``{"outputs": [[token ids], ...]}`` (a stop token is included when the model
stopped on it). The first line out is ``{"ready": true, "seconds": start-up}``. Answers go to the
process's original stdout; everything vLLM prints goes to stderr, so the two never mix.

`streamspec.vllm.client.VLLMGenerator` runs it from streamspec's own environment; the loop that
builds prompts and writes shards is `streamspec.training.distill_engine`.
"""

from __future__ import annotations

import json
import os
import sys
import time


def configure_threads(threads: int) -> None:
    """Give vLLM's CPU worker `threads` OpenMP threads, unbound, unless the caller chose a binding
    (``VLLM_CPU_OMP_THREADS_BIND``): binding would pin it to cores another job may be using."""
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # vLLM's CPU build sizes its KV cache from this (GiB); its default takes most of the machine's memory
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # the engine in this process, the model on the same thread: with its own engine and worker
    # processes, vLLM's engine core spins (sched_yield) on a second core while the worker computes
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def start_engine(spec: dict):
    from vllm import LLM

    return LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
               max_model_len=spec.get("max_model_len"), max_num_seqs=int(spec.get("max_num_seqs", 32)),
               skip_tokenizer_init=True, seed=int(spec.get("seed", 0)), disable_log_stats=True,
               distributed_executor_backend="uni" if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" else None)


def generate(llm, request: dict) -> list[list[int]]:
    """Greedy completions of the request's prompts, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), detokenize=False,
                            stop_token_ids=list(request.get("stop_token_ids") or []))
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in request["prompts"]]
    return [list(result.outputs[0].token_ids) for result in llm.generate(prompts, params, use_tqdm=False)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m streamspec.vllm.distill SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    # answers keep the original stdout; fd 1 (and so vLLM's logs, and its processes') goes to stderr
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    configure_threads(int(spec.get("threads", 1)))
    start = time.perf_counter()
    llm = start_engine(spec)
    answers.write(json.dumps({"ready": True, "seconds": time.perf_counter() - start}) + "\n")
    answers.flush()
    for line in sys.stdin:
        if line.strip():
            answers.write(json.dumps({"outputs": generate(llm, json.loads(line))}) + "\n")
            answers.flush()
    return 0


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which import this module again
    sys.exit(main())
