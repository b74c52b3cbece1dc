"""The compiled decode step: one pass with every shape static, through torch.compile, and the loops
that call it once a pass.

Each pass runs, inside one graph, everything between two host reads: the draft tree's tokens,
the model over them with the cache buffers seen whole (`StaticCacheView`), verification
(`verify_on_device`), the next draft, and the cache commit (the accepted path's entries moved
into place, `StaticCacheView.commit`). Its one output is a small vector the loop reads once and
feeds back as the next pass's input (`tree_pass`: the summary, the stored length, the root and
the candidates), so that nothing is built on the host between passes and a CUDA graph copies one
small tensor out of its pool. The loops read top to bottom: one pass, one read, commit.

- `speculate_compiled`: a fixed stream tree (the chain, (2,1,1), ...), one `tree_pass` a pass;
- `speculate_compiled_host`: trees built on the host each pass (lookup branches, a confidence
  budget): each tree is padded (`streamspec.decoding.tree.padded_tree`) to the smallest of a few
  sizes (`host_tree_sizes`) with a static depth, so one graph per size serves every shape; its
  tokens and the stored length go to the device in one copy;
- `autoregressive_compiled`: one token per pass (``speculative=False``), `token_pass`;
- `batch_pass`: a batch's chains (`streamspec.decoding.batch.generate_batch`).

How a pass is compiled and called (C++ wrapper on a CPU, CUDA graphs on CUDA, guards checked
once a loop, the compile notice): `streamspec.decoding.graphs`.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..patch.model import StreamedModel
from .cache import StaticCacheView
from .graphs import (COMPILED_ROOM, GraphedStep, CompileNotice, _SEEN, checked_once, compile_pass,  # noqa: F401
                     compiled_capacity, cpp_wrapper_wanted, cuda_graphs_wanted, graph_key)
from .output import GenerateOutput, pack_host_read, record_pass, split_host_read
from .sampling import Sampler
from .speculation import Prefilled, Speculation, commit_tokens, finish
from .tree import DraftTree, padded_tree
from .verify import chain_verify, verify_on_device as _verify


def _room():
    """A process may hold a graph per model, shape and capacity: more than dynamo's default."""
    return torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit))


def _seed(sampler: Sampler, device) -> torch.Tensor:
    return torch.tensor(0 if sampler.greedy else sampler.key(), dtype=torch.long, device=device)


# -- a fixed tree --------------------------------------------------------------------------------
def pass_state(past: int, root: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The first input of `tree_pass` (built once, after the prefill): ``[summary (D+2, unused) |
    past | root | candidates (D·k)]``, the layout `tree_pass` returns."""
    depth = candidates.shape[0]
    head = root.new_zeros(depth + 3)
    head[depth + 2] = past
    return torch.cat([head, root.view(1).to(head.dtype), candidates.flatten().to(head.dtype)])


def _tree_pass(model: StreamedModel, keys: list[torch.Tensor], values: list[torch.Tensor], state: torch.Tensor,
               tree: DraftTree, sampler: Sampler, key: torch.Tensor, width: int) -> torch.Tensor:
    """One draft-tree pass with every shape static (what `compile=True` compiles): from `state`
    (`pass_state`'s layout: the stored length `past`, the root, the candidates) the tree's tokens,
    the model over them with the cache buffers seen whole (the pass's main entries written at
    past..past+N), `_verify`, and the accepted path's entries moved to past..past+D. Returns the
    next state: ``[depth of the deepest accepted node, its path's tokens after the root and the
    correction (padded) | past + depth + 1 | the new root | the next candidates]``."""
    depth_limit = tree.depth_limit
    past = state[depth_limit + 2]
    root = state[depth_limit + 3 : depth_limit + 4]
    candidates = state[depth_limit + 4 :].view(depth_limit, width)
    cache = StaticCacheView(keys, values, past)
    capacity = keys[0].shape[-2]
    tokens = tree.tokens(root[0], candidates)
    positions = (past + tree.depth)[None]
    main_ok = static_main_allowed(tree.ancestors, past, capacity)
    slots = torch.arange(tree.size, device=tokens.device)[None]
    main, streams = model.step(tokens[None], positions, main_ok, slots, cache)
    path, summary, root, candidates = _verify(model, main, streams, tree, tokens, positions[0] + 1, sampler, width, key)
    if tree.size > depth_limit + 1:  # a chain's accepted path is its first nodes, in place already
        cache.commit(path)
    return torch.cat([summary, (past + summary[0] + 1).view(1), root, candidates.flatten()])


@lru_cache(maxsize=None)
def _compiled_pass(backend: str, device_type: str | None = None):
    """`_tree_pass` through torch.compile with static shapes (one graph per model, tree shape,
    sampler settings and cache capacity; the state and the seed are tensors)."""
    return compile_pass(_tree_pass, backend, device_type)


def speculate_compiled(model: StreamedModel, cache, run: Speculation, first: Prefilled, tree: DraftTree,
                       width: int):
    """`speculate` after the prefill with a fixed tree: per pass one compiled `_tree_pass` call
    (draft, the model, verify, commit: on the device), one read of its state vector, and the
    host's commit (the tokens; the cache counts what the pass stored). Nothing is built on the host."""
    device = first.root.device
    step = _compiled_pass(run.compile, device.type)
    key = _seed(run.sampler, device)
    out, generated, past, ended = first.out, first.generated, first.past, first.ended
    capacity = cache.capacity
    graph = graph_key(model, ("tree", tree.size, tree.depth_limit, width), capacity, run.sampler, run.compile)
    what = f"a {tree.size}-node tree, cache of {capacity}"
    state = pass_state(past, first.root, first.candidates)
    checked = False
    with _room():
        while len(generated) < run.max_new_tokens and not ended:
            start = run.clock()
            if past + tree.size > capacity:  # pragma: no cover - the capacity was reserved for this
                raise RuntimeError(f"cache capacity {capacity} is too small for a pass at {past}")
            with CompileNotice(graph, what), checked_once(checked):
                state = step(model, *cache.buffers, state, tree, run.sampler, key, width)
            checked = True
            out.graph_calls += 1
            forward_done = run.clock()
            read = out.read(state)  # [depth, path tokens..., past, root, candidates...]
            new = read[1 : read[0] + 2]
            head_done = run.clock()
            past += len(new)
            cache.count_stored(past)
            ended = commit_tokens(run, generated, new)
            record_pass(out, new, (tree.size, tree.size), start, forward_done, head_done, run.clock())
    return finish(out, run, generated, past, first.root)


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


# -- trees built on the host ---------------------------------------------------------------------
def _host_tree_pass(model: StreamedModel, keys: list[torch.Tensor], values: list[torch.Tensor], feed: torch.Tensor,
                    tree: DraftTree, sampler: Sampler, key: torch.Tensor, width: int, draft_depth: int,
                    with_scores: bool) -> torch.Tensor:
    """One pass over a tree built on the host (`padded_tree`: its structure is tensors), every
    shape static: `feed` is the tree's tokens [N] then the stored length `past` (one copy from the
    host), the model over the tree with the cache buffers seen whole, `_verify`, and the accepted
    path's entries moved into place. Returns, flat in one vector for the pass's one read,
    `_verify`'s summary [D+2], the next candidates [draft_depth * width] and, `with_scores`,
    their log-probabilities."""
    tokens, past = feed[:-1], feed[-1]
    cache = StaticCacheView(keys, values, past)
    capacity = keys[0].shape[-2]
    positions = (past + tree.depth)[None]
    main_ok = static_main_allowed(tree.ancestors, past, capacity)
    slots = torch.arange(tree.size, device=tokens.device)[None]
    main, streams = model.step(tokens[None], positions, main_ok, slots, cache)
    verified = _verify(model, main, streams, tree, tokens, positions[0] + 1, sampler, width, key,
                       draft_depth=draft_depth, with_scores=with_scores)
    cache.commit(verified[0])
    return pack_host_read(verified[1], verified[3], verified[4] if with_scores else None)


@lru_cache(maxsize=None)
def _compiled_host_pass(backend: str, device_type: str | None = None):
    """`_host_tree_pass` through torch.compile with static shapes (one graph per model, padded
    size, depth, sampler settings and cache capacity; the tree's structure is data)."""
    return compile_pass(_host_tree_pass, backend, device_type)


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


def speculate_compiled_host(model: StreamedModel, cache, run: Speculation, first: Prefilled, stream_tree,
                            most_nodes: int, width: int):
    """`speculate` after the prefill for trees built on the host (lookup branches, a confidence
    budget), one compiled `_host_tree_pass` call per pass: the host builds the tree as the
    uncompiled loop does, pads it to the smallest size of `host_tree_sizes`, sends its tokens
    and the stored length in one copy, and reads the accepted tokens and the next candidates
    (and scores) in one read."""
    from .lookup import StreamTreeOnHost

    device = first.root.device
    step = _compiled_host_pass(run.compile, device.type)
    key = _seed(run.sampler, device)
    out, generated, past, ended, text = first.out, first.generated, first.past, first.ended, first.text
    host_candidates, host_scores = first.host_candidates, first.host_scores
    lookup, shape = run.lookup, run.shape
    capacity = cache.capacity
    draft_depth = len(shape)
    # One graph per padded size for lookup branches and confidence trees alike (`HOST_GRAPH_WIDTH`,
    # `HOST_GRAPH_DEPTH`): each pass reads back the candidates and scores either needs, and the host
    # keeps this loop's `width` of them.
    graph_width = max(width, HOST_GRAPH_WIDTH)
    depth_limit = max(draft_depth, lookup.tokens if lookup is not None else 0, HOST_GRAPH_DEPTH)
    full = len(stream_tree.parent)
    sizes = host_tree_sizes(full if run.tree_budget is None else min(run.tree_budget, full), lookup, most_nodes)
    checked: set[int] = set()  # the sizes whose graph a pass of this loop has called

    def graph_of(size):
        return graph_key(model, ("host tree", size, depth_limit, draft_depth, graph_width), capacity, run.sampler,
                         run.compile)

    def feed(tokens: list[int], size: int) -> torch.Tensor:
        return torch.tensor(tokens + tokens[:1] * (size - len(tokens)) + [past], dtype=torch.long, device=device)

    with _room():
        # Every size's graph first (a root padded to that size, its cache writes past the stored
        # entries overwritten by the next pass), so that no later pass of this or another
        # generation stops to compile when its tree first reaches a size.
        for size in sizes:
            if ended or graph_of(size) in _SEEN:
                continue
            with CompileNotice(graph_of(size), f"trees of up to {size} nodes, cache of {capacity}"):
                step(model, *cache.buffers, feed(generated[-1:], size), _padded_tree_on((-1,), size, depth_limit, shape,
                     device), run.sampler, key, graph_width, draft_depth, True)
        while len(generated) < run.max_new_tokens and not ended:
            start = run.clock()
            base = stream_tree if run.tree_budget is None else StreamTreeOnHost.grown(host_scores, run.tree_budget)
            branches = text.continuations(lookup) if lookup is not None else []
            parents, host_tokens = base.with_branches(generated[-1], host_candidates, branches,
                                                      lookup.budget if lookup is not None else None)
            size = next(s for s in sizes if s >= len(parents))
            tree = _padded_tree_on(tuple(parents), size, depth_limit, shape, device)
            if past + size > capacity:  # pragma: no cover - the capacity was reserved for this
                raise RuntimeError(f"cache capacity {capacity} is too small for a pass at {past}")
            with checked_once(size in checked):  # each size's first pass of this loop: every guard
                flat = step(model, *cache.buffers, feed(host_tokens, size), tree, run.sampler, key, graph_width,
                            draft_depth, True)
            checked.add(size)
            out.graph_calls += 1
            forward_done = run.clock()
            summary, host_candidates, host_scores = split_host_read(out.read(flat), depth_limit + 2, graph_width,
                                                                    draft_depth, True)
            if graph_width > width:  # this loop's own candidates (the best first), as uncompiled
                host_candidates = [row[:width] for row in host_candidates]
                host_scores = [row[:width] for row in host_scores]
            new = summary[1 : summary[0] + 2]
            head_done = run.clock()
            past += len(new)
            cache.count_stored(past)
            ended = commit_tokens(run, generated, new)
            if lookup is not None:
                text.extend(new)
            record_pass(out, new, (size, size), start, forward_done, head_done, run.clock())
    return finish(out, run, generated, past, first.root)


# -- one token a pass ----------------------------------------------------------------------------
def _token_pass(model: StreamedModel, keys: list[torch.Tensor], values: list[torch.Tensor], state: torch.Tensor,
                sampler: Sampler, key: torch.Tensor) -> torch.Tensor:
    """One token per pass with every shape static (``speculative=False`` with ``compile``):
    `state` is ``[past, token]``: the token at position `past` through the model over the whole
    cache buffers, its entry written at `past`, and the next token chosen by `sampler` (keyed by
    its sequence index, as the uncompiled loop). Returns the next state ``[past + 1, token]``."""
    past, token = state[0], state[1:]
    cache = StaticCacheView(keys, values, past)
    capacity = keys[0].shape[-2]
    positions = past.view(1, 1)
    main_ok = static_main_allowed(torch.ones(1, 1, dtype=torch.bool, device=token.device), past, capacity)
    slot = torch.zeros(1, 1, dtype=torch.long, device=token.device)  # the streams at the new position, as uncompiled
    main, _ = model.step(token.view(1, 1), positions, main_ok, slot, cache)
    chosen = sampler(model.head(main[0, -1:]), positions[0] + 1, key=key)
    return torch.cat([(past + 1).view(1), chosen.to(state.dtype)])


@lru_cache(maxsize=None)
def _compiled_token_pass(backend: str, device_type: str | None = None):
    """`_token_pass` through torch.compile with static shapes (one graph per model, sampler
    settings and cache capacity)."""
    return compile_pass(_token_pass, backend, device_type)


def autoregressive_compiled(model, input_ids, max_new_tokens, stop: set[int], sampler: Sampler, backend: str,
                            clock) -> GenerateOutput:
    """One token per pass with every pass after the prefill one compiled `_token_pass` call. The
    tokens equal the uncompiled loop's (greedy; sampled with the same seed) up to the compiled
    kernels' float rounding. One read per pass: the state ``[past, token]``."""
    from ..patch.cache import MainStreamCache
    from ..patch.layout import causal, main_allowed

    device = input_ids.device
    cache = MainStreamCache(len(model.layers))
    cache.reserve(compiled_capacity(input_ids.shape[1] + max_new_tokens))
    out = GenerateOutput(tokens=input_ids.new_zeros(1, 0), forward_passes=0)
    step = _compiled_token_pass(backend, input_ids.device.type)
    key = _seed(sampler, device)
    start = clock()
    n = input_ids.shape[1]
    positions = torch.arange(n, device=device)[None]
    main_ok = main_allowed(causal(n, device), torch.ones(1, n, dtype=torch.bool, device=device))
    main, _ = model.step(input_ids, positions, main_ok, torch.full((1, 1), n - 1, dtype=torch.long, device=device), cache)
    forward_done = clock()
    token = sampler(model.head(main[0, -1:]), positions[0, -1:] + 1)
    state = torch.cat([positions[0, -1:] + 1, token.to(torch.long)])  # [past, token]: built once
    generated = [out.read(token)[0]]
    record_pass(out, generated[-1:], (1, 1), start, forward_done, forward_done, clock())
    capacity = cache.capacity  # fixed by the reservation: one graph for the whole generation
    graph, what = graph_key(model, "token", capacity, sampler, backend), f"one token per pass, cache of {capacity}"
    checked = False
    with _room():
        while len(generated) < max_new_tokens and generated[-1] not in stop:
            start = clock()
            with CompileNotice(graph, what), checked_once(checked):
                state = step(model, *cache.buffers, state, sampler, key)
            checked = True
            out.graph_calls += 1
            forward_done = clock()
            past, token_id = out.read(state)
            generated.append(token_id)
            cache.count_stored(past)
            record_pass(out, generated[-1:], (1, 1), start, forward_done, forward_done, clock())
    out.tokens = torch.tensor([generated], dtype=input_ids.dtype, device=device)
    return out


# -- a batch -------------------------------------------------------------------------------------
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
    return compile_pass(_batch_pass, backend, device_type)



tree_pass = _tree_pass
compiled_pass = _compiled_pass
host_tree_pass = _host_tree_pass
token_pass = _token_pass
batch_pass = _batch_pass
compiled_batch_pass = _compiled_batch_pass
