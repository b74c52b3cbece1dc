"""The compiled decode step: one draft-tree pass with every shape static, through torch.compile.

`tree_pass` runs a pass from the draft tree's tokens to the next draft (the model over the tree
with the cache buffers seen whole, then `verify_on_device`); `compiled_pass` compiles it once per
backend (one graph per model, tree shape, sampler settings and cache capacity); `speculate_compiled`
is the loop of `streamspec.decoding.loop.speculate` after the prefill, one compiled call a pass.
`autoregressive_compiled` is one token per pass (``speculative=False``) the same way: the prefill
uncompiled, then one compiled `token_pass` per token over the whole cache buffers.

Trees built on the host each pass (lookup branches, a confidence budget) compile too
(`speculate_compiled_host`): each pass's tree is padded (`streamspec.decoding.tree.padded_tree`)
to the smallest of a few sizes (`host_tree_sizes`: the stream tree, then one lookup branch more
per size) with a static depth, and its structure and tokens are tensors the compiled
`host_tree_pass` takes, so one graph per size serves every shape.

A batch (B > 1) compiles its chains (`batch_pass`, `streamspec.decoding.batch.generate_batch`):
each row writes its entries after its own stored ones in the whole row-cache buffers
(`StaticRowCacheView`), one graph per batch size and capacity.

On a CPU the graphs run inductor's C++ wrapper (`cpp_wrapper_wanted`): with streamspec's kernels
as C++ operators (``streamspec_native``), nothing between a pass's call and its kernels is Python.
On CUDA they replay as CUDA graphs (`cuda_graphs_wanted`, `GraphedStep`: inductor's
``reduce-overhead`` mode, the cache buffers static addresses, the outputs copied out of the
graphs' pool).
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache

import torch

from ..patch.model import StreamedModel
from .cache import StaticCacheView
from .config import DecodeConfig
from .output import _within_limits, commit_pass, pack_host_read, read_to_host, record_pass, split_host_read
from .sampling import Sampler
from .tree import DraftTree, padded_tree
from .verify import chain_verify, verify_on_device as _verify

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


def _speculate_compiled(model, cache, past, root, candidates, generated, ended, max_new_tokens, sampler, tree, width,
                        stop, on_tokens, clock, backend, out, new_ids):
    """The loop of `speculate` after the prefill, one compiled `_tree_pass` call per pass."""
    device = new_ids.device
    step = _compiled_pass(backend, new_ids.device.type)
    key = torch.tensor(0 if sampler.greedy else sampler.key(), dtype=torch.long, device=device)
    capacity = cache.capacity
    # the graph's identity for the compile notice (host values only: no read from the device per pass)
    graph = _graph_key(model, ("tree", tree.size, tree.depth_limit, width), capacity, sampler, backend)
    what = f"a {tree.size}-node tree, cache of {capacity}"
    checked = False
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        while len(generated) < max_new_tokens and not ended:
            start = clock()
            if past + tree.size > capacity:  # pragma: no cover - the capacity was reserved for this
                raise RuntimeError(f"cache capacity {capacity} is too small for a pass at {past}")
            past_t = torch.tensor(past, dtype=torch.long, device=device)
            with _CompileNotice(graph, what), _checked_once(checked):
                path, accepted, root, candidates = step(model, *cache.buffers, past_t, root, candidates, tree,
                                                        sampler, key, width)
            checked = True
            forward_done = clock()
            summary = read_to_host(accepted)  # [depth of the deepest accepted node, its path's tokens...]
            new = summary[1 : summary[0] + 2]
            head_done = clock()
            past, ended = commit_pass(cache, past, new, ((path, None),), generated, max_new_tokens, stop, on_tokens)
            record_pass(out, new, (tree.size, tree.size), start, forward_done, head_done, clock())
    kept_tokens = _within_limits(generated, 0, max_new_tokens, stop)
    out.tokens = torch.tensor([kept_tokens], dtype=new_ids.dtype, device=device)
    return out, past, kept_tokens


def static_main_allowed(ancestors: torch.Tensor, past: torch.Tensor, capacity: int) -> torch.Tensor:
    """`main_allowed` for a pass of a compiled decoding step: [1, N, capacity] over a whole cache
    buffer whose first `past` (a 0-dim device tensor) entries are stored and whose next N are
    this pass's tree nodes (`ancestors` [N, N]). Key j is visible to node i iff j < past, or
    past <= j < past + N and ancestors[i, j - past]; the rest of the buffer is hidden."""
    n = ancestors.shape[0]
    rel = torch.arange(capacity, device=ancestors.device) - past  # key j relative to the first node
    in_tree = (rel >= 0) & (rel < n)
    tree_part = ancestors.index_select(1, rel.clamp(0, n - 1)) & in_tree  # [N, C]
    return ((rel < 0) | tree_part)[None]


def _tree_pass(model: StreamedModel, keys: list[torch.Tensor], values: list[torch.Tensor], past: torch.Tensor,
               root: torch.Tensor, candidates: torch.Tensor, tree: DraftTree, sampler: Sampler, key: torch.Tensor,
               width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft-tree pass with every shape static (what `compile=True` compiles): the tree's
    tokens from the root and the candidates, the model over them with the cache buffers seen
    whole (`StaticCacheView`, `past` a 0-dim device tensor), and `_verify`. Writes the pass's main
    entries into the buffers at past..past+N; returns `_verify`'s outputs."""
    cache = StaticCacheView(keys, values, past)
    capacity = keys[0].shape[-2]
    tokens = tree.tokens(root[0], candidates)
    positions = (past + tree.depth)[None]
    main_ok = static_main_allowed(tree.ancestors, past, capacity)
    slots = torch.arange(tree.size, device=tokens.device)[None]
    main, streams = model.step(tokens[None], positions, main_ok, slots, cache)
    return _verify(model, main, streams, tree, tokens, positions[0] + 1, sampler, width, key)


def _host_tree_pass(model: StreamedModel, keys: list[torch.Tensor], values: list[torch.Tensor], past: torch.Tensor,
                    tokens: torch.Tensor, tree: DraftTree, sampler: Sampler, key: torch.Tensor, width: int,
                    draft_depth: int, with_scores: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over a tree built on the host (`padded_tree`: its structure and `tokens` [N] are
    tensors), every shape static: the model over the tree with the cache buffers seen whole, then
    `_verify`. Returns the accepted path [D+1] and, flat in one vector for the pass's one read,
    `_verify`'s summary [D+2], the next candidates [draft_depth * width] and, `with_scores`,
    their log-probabilities."""
    cache = StaticCacheView(keys, values, past)
    capacity = keys[0].shape[-2]
    positions = (past + tree.depth)[None]
    main_ok = static_main_allowed(tree.ancestors, past, capacity)
    slots = torch.arange(tree.size, device=tokens.device)[None]
    main, streams = model.step(tokens[None], positions, main_ok, slots, cache)
    verified = _verify(model, main, streams, tree, tokens, positions[0] + 1, sampler, width, key,
                       draft_depth=draft_depth, with_scores=with_scores)
    return verified[0], pack_host_read(verified[1], verified[3], verified[4] if with_scores else None)


@lru_cache(maxsize=None)
def _compiled_host_pass(backend: str, device_type: str | None = None):
    """`_host_tree_pass` through torch.compile with static shapes (one graph per model, padded
    size, depth, sampler settings and cache capacity; the tree's structure is data)."""
    return _compile(_host_tree_pass, backend, device_type)


#: Passes over host-built trees (lookup branches, confidence budgets) share one compiled graph per
#: padded size: each reads back at least this many candidates per stream, with their scores, and
#: verifies paths of up to at least this many tokens, so that a lookup row (`PromptLookup`'s
#: default 8-token branches on a narrower stream tree) and a confidence row (3 candidates a stream)
#: whose trees pad to the same size compile once. The extra read is a few numbers a pass.
HOST_GRAPH_WIDTH = 3
HOST_GRAPH_DEPTH = 8


def host_tree_sizes(stream_nodes: int, lookup, most_nodes: int) -> list[int]:
    """The padded sizes a compiled pass over host-built trees takes (one graph each): the stream
    tree alone, then room for one more lookup branch per size, up to `most_nodes`."""
    if lookup is None:
        return [stream_nodes]
    return sorted({min(stream_nodes + k * lookup.tokens, most_nodes) for k in range(lookup.matches + 1)} | {most_nodes})


@lru_cache(maxsize=512)
def _padded_tree_on(parents: tuple[int, ...], size: int, depth_limit: int, shape: tuple[int, ...],
                    device: torch.device) -> DraftTree:
    """`padded_tree` on `device`, built once per shape: most passes repeat a few shapes (the
    stream tree alone when no branch is found), so they reuse its tensors instead of building
    and copying them again. The tensors are only read by the pass."""
    return padded_tree(list(parents), size, depth_limit, shape).to(device)


def _speculate_compiled_host(model, cache, past, generated, ended, max_new_tokens, sampler, shape, stream_tree,
                             host_candidates, host_scores, tree_budget, lookup, text, most_nodes, width, stop,
                             on_tokens, clock, backend, out, new_ids):
    """The loop of `speculate` after the prefill for trees built on the host (lookup branches,
    a confidence budget), one compiled `_host_tree_pass` call per pass: the host builds the
    tree as the uncompiled loop does, pads it to the smallest size of `host_tree_sizes`, and
    reads the accepted tokens and the next candidates (and scores) in one read."""
    from .lookup import StreamTreeOnHost

    device = new_ids.device
    step = _compiled_host_pass(backend, new_ids.device.type)
    key = torch.tensor(0 if sampler.greedy else sampler.key(), dtype=torch.long, device=device)
    capacity = cache.capacity
    draft_depth = len(shape)
    # One graph per padded size for lookup branches and confidence trees alike (`HOST_GRAPH_WIDTH`,
    # `HOST_GRAPH_DEPTH`): each pass reads back the candidates and scores either needs, and the host
    # keeps this loop's `width` of them.
    graph_width = max(width, HOST_GRAPH_WIDTH)
    depth_limit = max(draft_depth, lookup.tokens if lookup is not None else 0, HOST_GRAPH_DEPTH)
    stream_nodes = len(stream_tree.parent) if tree_budget is None else min(tree_budget, len(stream_tree.parent))
    sizes = host_tree_sizes(stream_nodes, lookup, most_nodes)
    with_scores = True
    summary_length = depth_limit + 2
    checked: set[int] = set()  # the sizes whose graph a pass of this loop has called

    def graph_of(size):
        return _graph_key(model, ("host tree", size, depth_limit, draft_depth, graph_width), capacity, sampler, backend)

    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        # Every size's graph first (a root padded to that size: its writes past the stored entries
        # are overwritten by the next pass), so that no later pass of this or another generation
        # stops to compile when its tree first reaches a size.
        for size in sizes:
            if ended or graph_of(size) in _SEEN:
                continue
            with _CompileNotice(graph_of(size), f"trees of up to {size} nodes, cache of {capacity}"):
                step(model, *cache.buffers, torch.tensor(past, dtype=torch.long, device=device),
                     torch.full((size,), generated[-1], dtype=new_ids.dtype, device=device),
                     _padded_tree_on((-1,), size, depth_limit, shape, device), sampler, key, graph_width, draft_depth,
                     with_scores)
        while len(generated) < max_new_tokens and not ended:
            start = clock()
            base = stream_tree if tree_budget is None else StreamTreeOnHost.grown(host_scores, tree_budget)
            branches = text.continuations(lookup) if lookup is not None else []
            parents, host_tokens = base.with_branches(generated[-1], host_candidates, branches,
                                                      lookup.budget if lookup is not None else None)
            size = next(s for s in sizes if s >= len(parents))
            tree = _padded_tree_on(tuple(parents), size, depth_limit, shape, device)
            tokens = torch.tensor(host_tokens + host_tokens[:1] * (size - len(parents)), dtype=new_ids.dtype,
                                  device=device)
            if past + size > capacity:  # pragma: no cover - the capacity was reserved for this
                raise RuntimeError(f"cache capacity {capacity} is too small for a pass at {past}")
            with _checked_once(size in checked):  # each size's first pass of this loop: every guard
                path, flat = step(model, *cache.buffers, torch.tensor(past, dtype=torch.long, device=device), tokens,
                                  tree, sampler, key, graph_width, draft_depth, with_scores)
            checked.add(size)
            forward_done = clock()
            summary, host_candidates, host_scores = split_host_read(read_to_host(flat), summary_length, graph_width,
                                                                    draft_depth, with_scores)
            if graph_width > width:  # this loop's own candidates (the best first), as uncompiled
                host_candidates = [row[:width] for row in host_candidates]
                host_scores = [row[:width] for row in host_scores]
            new = summary[1 : summary[0] + 2]
            head_done = clock()
            past, ended = commit_pass(cache, past, new, ((path, None),), generated, max_new_tokens, stop, on_tokens)
            if lookup is not None:
                text.extend(new)
            record_pass(out, new, (size, size), start, forward_done, head_done, clock())
    kept_tokens = _within_limits(generated, 0, max_new_tokens, stop)
    out.tokens = torch.tensor([kept_tokens], dtype=new_ids.dtype, device=device)
    return out, past, kept_tokens


def _token_pass(model: StreamedModel, keys: list[torch.Tensor], values: list[torch.Tensor], past: torch.Tensor,
                token: torch.Tensor, sampler: Sampler, key: torch.Tensor) -> torch.Tensor:
    """One token per pass with every shape static (``speculative=False`` with ``compile``): the
    token [1] at position `past` (a 0-dim device tensor) through the model over the whole cache
    buffers, its entry written at `past`, and the next token [1] chosen by `sampler` (keyed by its
    sequence index, as the uncompiled loop)."""
    cache = StaticCacheView(keys, values, past)
    capacity = keys[0].shape[-2]
    positions = past.view(1, 1)
    main_ok = static_main_allowed(torch.ones(1, 1, dtype=torch.bool, device=token.device), past, capacity)
    slot = torch.zeros(1, 1, dtype=torch.long, device=token.device)  # the streams at the new position, as uncompiled
    main, _ = model.step(token.view(1, 1), positions, main_ok, slot, cache)
    return sampler(model.head(main[0, -1:]), positions[0] + 1, key=key)


@lru_cache(maxsize=None)
def _compiled_token_pass(backend: str, device_type: str | None = None):
    """`_token_pass` through torch.compile with static shapes (one graph per model, sampler
    settings and cache capacity)."""
    return _compile(_token_pass, backend, device_type)


def _autoregressive_compiled(model, input_ids, max_new_tokens, stop: set[int], sampler: Sampler, backend: str,
                             clock) -> "GenerateOutput":
    """One token per pass with every pass after the prefill one compiled `_token_pass` call. The
    tokens equal the uncompiled loop's (greedy; sampled with the same seed) up to the compiled
    kernels' float rounding. One read per pass: the token."""
    from ..patch.cache import MainStreamCache
    from ..patch.layout import causal, main_allowed
    from .output import GenerateOutput

    device = input_ids.device
    cache = MainStreamCache(len(model.layers))
    cache.reserve(compiled_capacity(input_ids.shape[1] + max_new_tokens))
    out = GenerateOutput(tokens=input_ids.new_zeros(1, 0), forward_passes=0)
    step = _compiled_token_pass(backend, input_ids.device.type)
    key = torch.tensor(0 if sampler.greedy else sampler.key(), dtype=torch.long, device=device)
    start = clock()
    n = input_ids.shape[1]
    positions = torch.arange(n, device=device)[None]
    main_ok = main_allowed(causal(n, device), torch.ones(1, n, dtype=torch.bool, device=device))
    main, _ = model.step(input_ids, positions, main_ok, torch.full((1, 1), n - 1, dtype=torch.long, device=device), cache)
    forward_done = clock()
    token = sampler(model.head(main[0, -1:]), positions[0, -1:] + 1)
    generated = [read_to_host(token)[0]]
    record_pass(out, generated[-1:], (1, 1), start, forward_done, forward_done, clock())
    past = n
    capacity = cache.capacity  # fixed by the reservation: one graph for the whole generation
    graph, what = _graph_key(model, "token", capacity, sampler, backend), f"one token per pass, cache of {capacity}"
    checked = False
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        while len(generated) < max_new_tokens and generated[-1] not in stop:
            start = clock()
            with _CompileNotice(graph, what), _checked_once(checked):
                token = step(model, *cache.buffers, torch.tensor(past, dtype=torch.long, device=device), token,
                             sampler, key)
            checked = True
            forward_done = clock()
            generated.append(read_to_host(token)[0])
            past += 1
            cache.count_stored(past)
            record_pass(out, generated[-1:], (1, 1), start, forward_done, forward_done, clock())
    out.tokens = torch.tensor([generated], dtype=input_ids.dtype, device=device)
    return out


def _batch_pass(model: StreamedModel, keys: list[torch.Tensor], values: list[torch.Tensor], row_lengths: torch.Tensor,
                key_real: torch.Tensor, roots: torch.Tensor, drafts: torch.Tensor, next_position: torch.Tensor,
                live: torch.Tensor, sampler: Sampler, key: torch.Tensor, fuse_head: bool):
    """One pass of a batch's chains with every shape static (`generate_batch` with a compile
    backend): each row's chain (its root `roots` [B], then `drafts` [B, γ]) at its own positions
    (`next_position` [B] on), its main entries written right after its `row_lengths` [B] stored
    ones (`StaticRowCacheView`), attention over the whole buffers under `row_allowed` (`key_real`
    [B, C]: the prompts' padding hidden), then `chain_verify`. Rows not `live` [B] (ended) store
    nothing. Returns the pass's one read [B, 2+γ], the next roots and drafts, and each row's
    stored entries and next position after the pass."""
    from ..patch.cache import StaticRowCacheView
    from ..patch.layout import row_allowed

    batch, n = roots.shape[0], 1 + drafts.shape[1]
    capacity = keys[0].shape[-2]
    steps = torch.arange(n, device=roots.device)
    chain = torch.cat([roots[:, None], drafts], dim=1)
    positions = next_position[:, None] + steps
    ok = row_allowed(key_real, row_lengths, capacity - n, n)  # [B, n, C]
    main, streams = model.step(chain, positions, ok, steps.expand(batch, n), StaticRowCacheView(keys, values, row_lengths))
    summary, roots, drafts = chain_verify(model, main, streams, chain, positions, sampler, key, fuse_head)
    stored = (summary[:, 0] + 1) * live
    return summary, roots, drafts, row_lengths + stored, next_position + stored


@lru_cache(maxsize=None)
def _compiled_batch_pass(backend: str, device_type: str | None = None):
    """`_batch_pass` through torch.compile with static shapes (one graph per model, batch size,
    sampler settings, head split and cache capacity)."""
    return _compile(_batch_pass, backend, device_type)


_SEEN: set = set()  # the compiled graphs this process has called (one per model, shape, sampler, capacity)


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


@lru_cache(maxsize=None)
def _compiled_pass(backend: str, device_type: str | None = None):
    """`_tree_pass` through torch.compile with static shapes (one graph per model, tree shape,
    sampler settings and cache capacity; `past`, the tokens and the seed are tensors)."""
    return _compile(_tree_pass, backend, device_type)


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
    off = os.environ.get("STREAMSPEC_CPP_WRAPPER", "1").strip().lower() in ("0", "false", "off", "no")
    return backend == "inductor" and device_type == "cpu" and not off


def cuda_graphs_wanted(backend: str, device_type: str | None) -> bool:
    """Whether a compiled pass replays as a CUDA graph: inductor on CUDA (torch's
    ``mode="reduce-overhead"``: the pass's hundreds of kernel launches become one graph launch,
    the batch-1 step being launch-bound), unless ``STREAMSPEC_CUDA_GRAPHS=0``. See `GraphedStep`
    for what the loops' calls need for it."""
    off = os.environ.get("STREAMSPEC_CUDA_GRAPHS", "1").strip().lower() in ("0", "false", "off", "no")
    return backend == "inductor" and device_type == "cuda" and not off


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


def _compile(fn, backend: str, device_type: str | None):
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


tree_pass = _tree_pass
compiled_pass = _compiled_pass
speculate_compiled = _speculate_compiled
speculate_compiled_host = _speculate_compiled_host
host_tree_pass = _host_tree_pass
token_pass = _token_pass
batch_pass = _batch_pass
compiled_batch_pass = _compiled_batch_pass
autoregressive_compiled = _autoregressive_compiled
