"""How a decoding pass becomes a compiled graph, and how the loops call it: the same for every
compiled loop (one token, a tree, a host-built tree, a batch; `streamspec.decoding.compiled`).

- `compile_pass`: ``torch.compile`` with static shapes; on a CPU inductor's C++ wrapper
  (`cpp_wrapper_wanted`), on CUDA replayed as CUDA graphs (`cuda_graphs_wanted`, `GraphedStep`).
  Which of the two applies is decided with the rest of the device's formulation of the pass in
  `streamspec.devices.formulation`.
- `compiled_capacity`: the few cache sizes a compiled generation reserves (few graphs).
- `checked_once`, `CompileNotice`, `graph_key`: guards run in full only at a loop's first pass;
  a first compile is announced and timed.
"""

from __future__ import annotations

import contextlib

import torch

from .config import DecodeConfig
from ..devices import formulation


def _checked_once(checked: bool):
    """Inside a decoding loop, after its first compiled pass ran dynamo's guards in full: the
    loop's later passes call the same graphs with the same model, shapes and settings (only the
    tensors' values move), so they run only the guards that tell cached graphs apart (torch's
    ``skip_guard_eval_unsafe`` stance; ~2 ms a pass of guards on this project's CPU otherwise).
    The current stance (e.g. a user's ``force_eager``) is kept. A model changed between two
    generations meets every guard again at the next generation's first pass; one changed during
    a generation (its kernels switched from another thread) is not seen until then, and the
    stance is the process's while a pass runs (compiled code on other threads skips too)."""
    current = getattr(torch._dynamo.eval_frame, "_stance", None)  # (torch >= 2.6; older ones guard in full)
    if not checked or current is None or not hasattr(torch.compiler, "set_stance"):
        return contextlib.nullcontext()
    return torch.compiler.set_stance(current.stance, skip_guard_eval_unsafe=True, force_backend=current.backend)


_SEEN: set = set()  # the compiled graphs this process has called (one per model, shape, sampler, capacity)


def graphs_called() -> int:
    """How many compiled graphs this process has called so far (the benchmark counts the kernels
    generated per graph with it)."""
    return len(_SEEN)


class _CompileNotice:
    """Says on stderr when a pass is the first of its graph in this process (it compiles, or
    inductor's on-disk cache serves it) and how long that first call took: compile time is never
    paid silently."""

    def __init__(self, key, what: str) -> None:
        self.first = key not in _SEEN
        self.what, self.key = what, key

    def __enter__(self):
        if self.first:
            import sys
            import time

            self._start = time.perf_counter()
            print(f"streamspec: compiling the decode step ({self.what}; once per shape, then cached)",
                  file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.first and exc[0] is None:
            import sys
            import time

            _SEEN.add(self.key)
            print(f"streamspec: decode step ready in {time.perf_counter() - self._start:.1f} s ({self.what})",
                  file=sys.stderr, flush=True)


def _graph_key(model, what, capacity, sampler, backend):
    # (the bf16 copies a float32 model drafts through are part of its graphs: turning one on or off
    # traces a new graph, announced like any other)
    copies = (model.__dict__.get("_bf16_draft_head") is not None, model.__dict__.get("_bf16_stream_rows", False))
    return (id(model), what, capacity, sampler.greedy, getattr(sampler, "temperature", None),
            getattr(sampler, "top_p", None), getattr(sampler, "top_k", None), backend, copies)


_CAPACITY_STEP = 256  # compiled passes attend over buffers of a multiple of this many entries
# Entries every compiled generation reserves beyond its text, whatever its tree (one token a pass
# too): methods whose pass rows (nodes × (1 + streams)) fit in it share one cache size for a
# prompt, so a warm-up prompt of each size compiles what every such method needs.
COMPILED_ROOM = 128


def compiled_capacity(text_entries: int, pass_rows: int = 0) -> int:
    """The cache capacity a compiled generation reserves: the text (prompt and new tokens) and
    `pass_rows` (at least `COMPILED_ROOM`), in multiples of `_CAPACITY_STEP`."""
    needed = text_entries + max(pass_rows, COMPILED_ROOM)
    return -(-needed // _CAPACITY_STEP) * _CAPACITY_STEP


def cpp_wrapper_wanted(backend: str, device_type: str | None) -> bool:
    """Whether a compiled pass runs inductor's C++ wrapper: inductor on a CPU (the device type the
    decoding loops pass; none named: the Python wrapper), unless ``STREAMSPEC_CPP_WRAPPER=0``. The graph then calls its kernels and streamspec's C++ operators
    from C++ rather than from a Python function of ~300 calls. Its entry is built apart from the
    kernels (inductor's ``cpp_wrapper_build_separate``: the entry at a low optimisation level),
    which keeps the first compile of a shape as long as the Python wrapper's. Measured (bf16, one
    thread of this project's AMD EPYC, `eval/step_speed.py`, fresh inductor caches, beside one
    other one-thread job): one token a pass 12.8 ms a step against 13.6 with the Python wrapper,
    tree (2,1,1) 24.7 against 26.2; first compile 54 s / 34 s against 59 s / 46 s (with the entry
    built with its kernels at -O3: 12.4 / 23.8 ms, but 144 s / 140 s)."""
    return device_type is not None and formulation(device_type, backend).cpp_wrapper


def cuda_graphs_wanted(backend: str, device_type: str | None) -> bool:
    """Whether a compiled pass replays as a CUDA graph: inductor on CUDA (torch's
    ``mode="reduce-overhead"``: the pass's hundreds of kernel launches become one graph launch,
    the batch-1 step being launch-bound), unless ``STREAMSPEC_CUDA_GRAPHS=0``. See `GraphedStep`
    for what the loops' calls need for it."""
    return device_type is not None and formulation(device_type, backend).cuda_graphs


class GraphedStep:
    """A compiled pass called the way CUDA graphs (torch's CUDAGraph trees) need, by every decoding
    loop alike:

    - the cache buffers (every tensor in a list argument: the loops pass the buffers as lists)
      are marked static addresses (``torch._dynamo.mark_static_address``, unguarded): the pass
      writes its entries into them in place, and a graph replays in-place writes only into
      inputs whose address it may assume (others make inductor skip the graphs). A generation's
      new buffers re-record the graph (no recompile);
    - each call starts a new step (``torch.compiler.cudagraph_mark_step_begin``): the previous
      pass's outputs are then free to be overwritten by this replay;
    - so the outputs are copied out of the graph's memory pool (small tensors: tokens, a summary,
      candidates) before the loop keeps them or feeds them back as the next pass's inputs."""

    def __init__(self, compiled) -> None:
        self.compiled = compiled

    def __call__(self, *args):
        for arg in args:
            if isinstance(arg, (list, tuple)):
                for t in arg:
                    if isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) is None:
                        torch._dynamo.mark_static_address(t, guard=False)
        torch.compiler.cudagraph_mark_step_begin()
        out = self.compiled(*args)
        if isinstance(out, torch.Tensor):
            return out.clone()
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)


def compile_pass(fn, backend: str, device_type: str | None):
    """`fn` through torch.compile with static shapes, as the device's formulation asks."""
    options = None
    if cpp_wrapper_wanted(backend, device_type):
        import torch._inductor.config as inductor_config

        options = {"cpp_wrapper": True}
        if hasattr(inductor_config, "cpp_wrapper_build_separate"):  # (recent torch versions)
            options["cpp_wrapper_build_separate"] = True
    if not cuda_graphs_wanted(backend, device_type):
        return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True, options=options)
    mode = "reduce-overhead" if backend == "inductor" else None  # (another backend: the calls' protocol alone)
    return GraphedStep(torch.compile(fn, backend=backend, dynamic=False, fullgraph=True, mode=mode))


def _compile_backend(compile: bool | str) -> str | None:
    return DecodeConfig(compile=compile).compile_backend




# The names the compiled loops and the batch loop use.
_checked_once = checked_once = _checked_once
CompileNotice = _CompileNotice
graph_key = _graph_key
compile_backend = _compile_backend
