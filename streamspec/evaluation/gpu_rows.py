"""The rows of the GPU check (`streamspec.evaluation.gpu_check`), part by part: `rows_of(part,
device, quick)`. Each row is a closure that measures one thing and returns its figures; rows of
a part share what its first row set up (a model), so a failed set-up fails the rows after it,
one by one, and the next part still runs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

@dataclass
class Row:
    """One row of the check: its part, its name, and what measures it (returns the figures)."""

    part: str
    name: str
    run: Callable[[], dict]


ARCHS = ("llama", "qwen2", "mistral", "gpt2")
# Random-weight shapes of public configs (their config.json values; no download).
SHAPES = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=True, max_position_embeddings=131072),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                               rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                               rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768),
}
TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"],
                "gpt2": ["c_attn"]}


def rows_of(part: str, device: torch.device, quick: bool) -> list[Row]:
    return {"a": _exactness, "b": _end_to_end, "c": _pass_costs, "d": _training, "e": _reasoning}[part](device, quick)


def _backend(device: torch.device, quick: bool):
    """The compile backend of compiled rows: inductor, or on a CPU in quick mode aot_eager (the same
    loops without a minute of C++ compile a graph)."""
    return "aot_eager" if quick and device.type == "cpu" else True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_model(arch: str, device: torch.device, seed: int = 0):
    """A tiny random causal LM of `arch` (float32, eval), as the tests build them."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    torch.manual_seed(seed)
    if arch == "gpt2":
        config = GPT2Config(vocab_size=101, n_embd=32, n_layer=4, n_head=4, n_inner=64, n_positions=512,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    else:
        kind = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
        extra = {"qwen2": dict(use_sliding_window=False), "mistral": dict(sliding_window=None)}.get(arch, {})
        config = kind(attention_dropout=0.0, **TINY, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval().to(device)


def random_model(shape: str, device: torch.device, dtype: torch.dtype, quick: bool):
    """Random weights of a public shape (`SHAPES`; quick: the tiny config of its family)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(SHAPES[shape])
    if quick:
        values.update(TINY, vocab_size=512)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


# -- a: exactness ---------------------------------------------------------------------------------
def _exactness(device, quick):
    archs = ("llama", "gpt2") if quick else ARCHS
    return [Row("a", f"{arch} {mode} {'compiled' if compiled else 'eager'}", partial(_exact, arch, mode, compiled,
                                                                                       device, quick))
            for compiled in (False, True) for arch in archs for mode in ("lossless + adapters", "shared + LoRA")]


def _streamed_tiny(arch, mode, device):
    from peft import LoraConfig

    from ..config import StreamConfig
    from ..patch.model import add_streams

    base = tiny_model(arch, device)
    if mode.startswith("lossless"):
        model = add_streams(base, StreamConfig(num_streams=3, stream_layers=2, mode="lossless", stream_adapter_rank=4))
    else:
        model = add_streams(base, StreamConfig(num_streams=3, stream_layers=2, mode="shared"))
        model.add_lora(LoraConfig(r=4, target_modules=LORA_TARGETS[arch], lora_dropout=0.0, init_lora_weights=False))
    torch.manual_seed(1)
    with torch.no_grad():  # drafts that agree now and then; adapters that change the stream rows
        model.streams.stream_embeddings.mul_(0.1)
        for name, p in model.streams.named_parameters():
            if name.startswith("adapters."):
                p.copy_(0.05 * torch.randn_like(p))
    return model.eval()


def _exact(arch, mode, compiled, device, quick) -> dict:
    from ..decoding import DecodeConfig, generate
    from ..decoding.lookup import PromptLookup

    model = _streamed_tiny(arch, mode, device)
    part = torch.randint(3, 101, (1, 6), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([part] * 4, dim=1).to(device)  # repeats itself: lookup branches are found
    expected = generate(model, ids, 24, speculative=False).tokens.tolist()
    configs = {"chain": DecodeConfig(tree_top_k=1), "tree (2,1,1)": DecodeConfig(tree_top_k=(2, 1, 1)),
               "tree + lookup": DecodeConfig(tree_top_k=(2, 1, 1), lookup=PromptLookup(6, 2)),
               "confidence tree": DecodeConfig(tree_top_k=3, tree_budget=6)}
    backend = _backend(device, quick) if compiled else False
    differ = [name for name, config in configs.items()
              if generate(model, ids, 24, config=config.replace(compile=backend)).tokens.tolist() != expected]
    if differ:
        raise AssertionError(f"not equal to one token a pass: {', '.join(differ)}")
    return {"configs": len(configs), "identical": True}


# -- b: end to end --------------------------------------------------------------------------------
def _end_to_end(device, quick):
    rows = []
    for dtype in (("float32",) if quick else ("float32", "bfloat16")):
        shared: dict = {}
        rows.append(Row("b", f"{dtype}: load", partial(_load_default, shared, device, dtype, quick)))
        for name in _E2E_ROWS:
            if quick and name in ("transformers compiled", "tree compiled", "tree + lookup compiled",
                                  "confidence tree compiled"):
                continue
            rows.append(Row("b", f"{dtype}: {name}", partial(_e2e_row, shared, name, device, quick)))
    return rows


_E2E_ROWS = ("generate", "prompt lookup", "transformers compiled", "one token compiled", "chain eager",
             "chain compiled", "tree compiled", "tree + lookup compiled", "confidence tree compiled")


def _load_default(shared, device, dtype, quick) -> dict:
    from ..evaluation.benchmark import _baseline_model, held_out_rows
    from ..loading import load_for_inference
    from ..patch.checkpoint import read_checkpoint_meta
    from ..assets import shipped_or_path

    checkpoint = shipped_or_path("streamspec:smollm2-135m-sql-streams")
    loaded = load_for_inference(checkpoint, device=str(device), dtype=dtype)
    shared.update(model=loaded.model, tokenizer=loaded.tokenizer, eos=loaded.tokenizer.eos_token_id,
                  base=_baseline_model(read_checkpoint_meta(checkpoint), checkpoint, None, loaded.device, loaded.dtype),
                  rows=held_out_rows("sql")[: 1 if quick else 10], new=16 if quick else 96, results={})
    return {"prompts": len(shared["rows"]), "new_tokens": shared["new"], "dtype": str(loaded.dtype)}


def _e2e_method(shared, name, device, quick):
    from ..decoding import DecodeConfig
    from .methods import hf_method, streaming_method
    from .peers import transformers_compiled_method
    from .tuning import CONFIDENCE_TOP_K, DEFAULT_BUDGET, DEFAULT_LOOKUP

    model, base, eos = shared["model"], shared["base"], shared["eos"]
    compiled = DecodeConfig(compile=_backend(device, quick))
    return {
        "generate": lambda: hf_method("generate", base, eos),
        "prompt lookup": lambda: hf_method("prompt_lookup", base, eos, prompt_lookup_num_tokens=8),
        "transformers compiled": lambda: transformers_compiled_method(base, eos),
        "one token compiled": lambda: streaming_method(model, eos, compiled, speculative=False),
        "chain eager": lambda: streaming_method(model, eos, DecodeConfig(compile=False), tree_top_k=1),
        "chain compiled": lambda: streaming_method(model, eos, compiled, tree_top_k=1),
        "tree compiled": lambda: streaming_method(model, eos, compiled, tree_top_k=(2, 1, 1)),
        "tree + lookup compiled": lambda: streaming_method(model, eos, compiled, tree_top_k=(2, 1, 1),
                                                           lookup=DEFAULT_LOOKUP),
        "confidence tree compiled": lambda: streaming_method(model, eos, compiled, tree_top_k=CONFIDENCE_TOP_K,
                                                             tree_budget=DEFAULT_BUDGET),
    }[name]()


def _e2e_row(shared, name, device, quick) -> dict:
    from .methods import run_methods

    method = _e2e_method(shared, name, device, quick)
    result = run_methods({name: method}, shared["tokenizer"], shared["rows"], shared["new"])[name]
    results = shared["results"]
    results[name] = result
    figures = result.summary(None)
    row = {k: figures.get(k) for k in ("tokens_per_second", "crr", "ms_per_pass", "ms_per_step_forward",
                                        "ms_per_step_host", "reads_per_step", "graph_calls_per_step")
           if figures.get(k) is not None}
    for reference, label in (("generate", "x_generate"), ("transformers compiled", "x_transformers_compiled")):
        if reference in results and results[reference].seconds and result.seconds:
            row[label] = round((result.tokens / result.seconds) / (results[reference].tokens / results[reference].seconds), 3)
    if "generate" in results and name != "generate":
        row["identical_to_generate"] = result.token_ids == results["generate"].token_ids
    return row


# -- c: the cost of one compiled pass -------------------------------------------------------------
PASSES = ("1 row", "chain", "tree (2,1,1)", "lookup tree (15 rows)")


def _pass_costs(device, quick):
    rows = []
    for shape in ("smollm2-135m + SQL streams", "llama-3.2-1b", "llama-3.1-8b"):
        shared: dict = {}
        rows.append(Row("c", f"{shape}: build", partial(_pass_model, shared, shape, device, quick)))
        rows += [Row("c", f"{shape}: {kind}", partial(_pass_cost, shared, kind, device, quick)) for kind in PASSES]
    return rows


def _pass_model(shared, shape, device, quick) -> dict:
    from ..config import StreamConfig
    from ..patch.model import add_streams

    if shape.startswith("smollm2"):
        from ..loading import load_for_inference

        model = load_for_inference("streamspec:smollm2-135m-sql-streams", device=str(device), dtype="bfloat16").model
    else:
        model = add_streams(random_model(shape, device, torch.bfloat16, quick),
                            StreamConfig(mode="lossless", stream_adapter_rank=64)).eval()
    shared["model"] = model
    return {"parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}


def _pass_cost(shared, kind, device, quick) -> dict:
    """One compiled pass of `kind` called as the loops call it, at a fixed stored length after a
    128-token prefill: its first call (compile), then the median of 10 timed calls (each waited
    for), the median host time of a call (returning, not waited for), and a profiler split."""
    from ..decoding import compiled as passes
    from ..decoding.cache import MainStreamCache
    from ..decoding.graphs import compiled_capacity
    from ..decoding.sampling import Sampler
    from ..decoding.tree import build_tree
    from ..patch.layout import causal, main_allowed

    model = shared["model"]
    backend = "aot_eager" if quick and device.type == "cpu" else "inductor"
    length = 32 if quick else 128
    ids = torch.randint(3, 100, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    cache = MainStreamCache(len(model.layers))
    cache.reserve(compiled_capacity(length + 64, 15 * 4))
    positions = torch.arange(length, device=device)[None]
    with torch.no_grad():
        model.step(ids, positions, main_allowed(causal(length, device), torch.ones(1, length, dtype=torch.bool,
                   device=device)), torch.full((1, 1), length - 1, device=device), cache)
    sampler, key = Sampler(device=device), torch.zeros((), dtype=torch.long, device=device)
    root = ids[0, -1:]
    if kind == "1 row":
        step, args = passes._compiled_token_pass(backend, device.type), (torch.tensor([length, 5], device=device),
                                                                         sampler, key)
    elif kind == "lookup tree (15 rows)":  # the (2,1,1) stream tree with one 8-token lookup branch
        parents = (-1, 0, 0, 1, 2, 3, 4) + (0, 7, 8, 9, 10, 11, 12, 13)
        tree = passes._padded_tree_on(parents, 15, passes.HOST_GRAPH_DEPTH, (2, 1, 1), device)
        feed = torch.tensor([5] * 15 + [length], device=device)
        step = passes._compiled_host_pass(backend, device.type)
        args = (feed, tree, sampler, key, passes.HOST_GRAPH_WIDTH, 3, True)
    else:
        shape = (1, 1, 1) if kind == "chain" else (2, 1, 1)
        tree = build_tree(shape, 3).to(device)
        candidates = torch.full((3, max(shape)), 5, dtype=torch.long, device=device)
        step = passes._compiled_pass(backend, device.type)
        args = (passes.pass_state(length, root, candidates), tree, sampler, key, max(shape))

    def call():
        with torch.no_grad():
            return step(model, *cache.buffers, *args)

    start = time.perf_counter()
    call()
    _sync(device)
    compile_s = time.perf_counter() - start
    for _ in range(3):
        call()
    _sync(device)
    waited, host = [], []
    for _ in range(10):
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
        _sync(device)
        waited.append(time.perf_counter() - start)
    figures = {"ms_per_pass": round(1000 * statistics.median(waited), 3),
               "host_ms_per_call": round(1000 * statistics.median(host), 3), "first_call_s": round(compile_s, 1)}
    figures.update(_profile(call, device))
    return figures


def _profile(call, device) -> dict:
    """A torch.profiler split of one call: the device's kernel time and kernel count (on a CPU:
    the aten ops), and the host's time in the call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        call()
        host = time.perf_counter() - start
        _sync(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(getattr(e, "device_time", 0.0) or getattr(e, "self_device_time_total", 0.0) for e in kernels)
        return {"profiled_kernels": len(kernels), "profiled_gpu_ms": round(gpu_us / 1000, 3),
                "profiled_host_ms": round(1000 * host, 3)}
    return {"profiled_aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
            "profiled_host_ms": round(1000 * host, 3)}


# -- d: a training step ---------------------------------------------------------------------------
def _training(device, quick):
    return [Row("d", f"llama-3.2-1b: {what}", partial(_train_step, what, device, quick))
            for what in ("next-token LoRA", "lossless streams + stream adapters", "shared streams + LoRA")]


def _train_step(what, device, quick) -> dict:
    from peft import LoraConfig, get_peft_model

    from ..config import StreamConfig
    from ..patch.model import add_streams

    batch, length = (2, 32) if quick else (8, 1024)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    base = random_model("llama-3.2-1b", device, dtype, quick).train()
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    if what == "next-token LoRA":
        model = get_peft_model(base, lora)
    elif what.startswith("lossless"):
        model = add_streams(base, StreamConfig(mode="lossless", main_weight=0.0, stream_adapter_rank=32))
    else:
        model = add_streams(base, StreamConfig(mode="shared")).add_lora(lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # allocations, kernel choices
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    step()
    _sync(device)
    figures = {"batch": f"{batch} x {length}", "step_s": round(time.perf_counter() - start, 3),
               "trainable_m": round(sum(p.numel() for p in trainable) / 1e6, 2)}
    if device.type == "cuda":
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    return figures


# -- e: SpecReason's model costs ------------------------------------------------------------------
def _reasoning(device, quick):
    return [Row("e", shape, partial(_prefill_decode, shape, device, quick))
            for shape in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]


def _prefill_decode(shape, device, quick) -> dict:
    """Prefill tokens/s (one forward over a 1024-token prompt) and decode tokens/s (transformers
    greedy `generate`, eager, 64 new tokens after a 128-token prompt), random weights, bf16 on
    CUDA: the costs docs/reasoning.md projects SpecReason's speed from."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype, quick)
    prompt, new = (64, 8) if quick else (1024, 64)
    ids = torch.randint(3, 500, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        model(ids)  # warm
        _sync(device)
        start = time.perf_counter()
        model(ids)
        _sync(device)
        prefill = time.perf_counter() - start
        short = ids[:, : min(128, prompt)]
        model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=4, do_sample=False, pad_token_id=0)
        _sync(device)
        start = time.perf_counter()
        model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        _sync(device)
        decode = time.perf_counter() - start
    return {"prefill_tokens_per_s": round(prompt / prefill, 1), "decode_tokens_per_s": round(new / decode, 1),
            "prompt": prompt, "new_tokens": new, "dtype": str(dtype).removeprefix("torch.")}
