"""The decode loops of one sequence: one token per pass (`autoregressive`) and speculative
streaming (`speculate`): draft, one model pass, verify, one read, commit.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from typing import Callable

import torch

from ..patch.layout import causal, main_allowed
from ..patch.model import StreamedModel
from .cache import MainStreamCache
from .compiled import _compile_backend, compiled_capacity, speculate_compiled as _speculate_compiled
from .compiled import speculate_compiled_host as _speculate_compiled_host
from .config import DecodeConfig
from .lookup import NgramIndex, PromptLookup, StreamTreeOnHost
from .output import (GenerateOutput, _within_limits, commit_pass, pack_host_read, read_to_host, record_pass,
                     split_host_read, stop_set)
from .sampling import Sampler
from .tree import DraftTree, build_tree, children_of, prune_by_transition, tree_from_parents
from .verify import verify_on_device as _verify, walk_on_host as _walk

def _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler, profile: bool = False) -> "GenerateOutput":
    """One token per pass; the arguments were checked by the caller (`_check_generate_args`). One
    read from the device per pass: the token, to know whether it ends the text."""
    choose = sampler or Sampler(device=input_ids.device)
    stop = stop_set(eos_token_id)
    device = input_ids.device
    clock = _Clock(device, profile)
    cache = MainStreamCache(len(model.layers), capacity=input_ids.shape[1] + max_new_tokens)
    one_slot = torch.zeros(1, 1, dtype=torch.long, device=device)  # streams at the last new position
    valid = torch.ones(1, 1, dtype=torch.bool, device=device)
    ones = torch.ones(1, input_ids.shape[1] + max_new_tokens, dtype=torch.bool, device=device)
    out = GenerateOutput(tokens=input_ids.new_zeros(1, 0), forward_passes=0)
    tokens, generated = input_ids, []
    past = 0
    for _ in range(max_new_tokens):
        start = clock()
        n = tokens.shape[1]
        positions = torch.arange(past, past + n, device=device)[None]
        main_ok = main_allowed(causal(n, device), ones[:, : past + n])
        main, _ = model.step(tokens, positions, main_ok, one_slot + (n - 1), cache, valid)
        forward_done = clock()
        token = choose(model.head(main[0, -1:]), positions[0, -1:] + 1)  # [1], on the device
        value = read_to_host(token)[0]
        generated.append(value)
        end = clock()
        out.seconds_per_pass.append(end - start)
        out.forward_seconds_per_pass.append(forward_done - start)
        out.head_seconds_per_pass.append(end - forward_done)
        past += n
        tokens = token.view(1, 1).to(input_ids.dtype)
        if value in stop:
            break
    out.tokens = torch.tensor([generated], dtype=input_ids.dtype, device=device)
    out.forward_passes = len(generated)
    out.accepted_per_pass = [1] * len(generated)
    return out


@lru_cache(maxsize=16)
def _tree(shape: tuple[int, ...]) -> DraftTree:
    return build_tree(shape, len(shape))


@lru_cache(maxsize=16)
def _children(shape: tuple[int, ...]) -> list[list[int]]:
    """The children of each node of a shape's tree (read only: shared by every call)."""
    return _tree(shape).children()


@lru_cache(maxsize=16)
def _host_tree(shape: tuple[int, ...]) -> StreamTreeOnHost:
    return StreamTreeOnHost.of(shape)


def _lookup_nodes(stream_nodes: int, lookup: PromptLookup) -> int:
    """The most nodes a tree with lookup branches can have."""
    most = stream_nodes + lookup.matches * lookup.tokens
    return most if lookup.budget is None else max(stream_nodes, min(most, lookup.budget))


def speculate(model: StreamedModel, cache: MainStreamCache, past: int, new_ids: torch.Tensor, max_new_tokens: int,
              sampler: Sampler, shape: tuple[int, ...], prune_threshold: float | None, stop: set[int],
              on_tokens: Callable[[list[int]], bool | None] | None, clock: "_Clock",
              compile: bool | str = False, lookup: PromptLookup | None = None,
              history: list[int] | None = None, host_walk: bool = False,
              tree_budget: int | None = None) -> tuple[GenerateOutput, int, list[int]]:
    """The speculative-streaming loop of one sequence, from a cache that already holds `past`
    entries and the tokens `new_ids` [1, n >= 1] that follow them (the prompt, for a fresh cache).
    Arguments are checked by the caller. Returns the output, how many entries the cache then
    holds and the output's tokens as a list (read on the host already). The cache holds every
    token up to, not including, the last one generated (whose entries the next pass would
    write), before any cut by `max_new_tokens` or a stop token; a caller that keeps the cache
    crops it to the tokens it keeps (`DecodingSession` does).

    Each pass runs on the device from the draft tree's tokens to the next one's (see `_verify`);
    the host reads one small vector per pass, the accepted tokens and their count, to call
    `on_tokens`, test for stop tokens and set the cache's length. Early-exit pruning reads one
    thing more, the number of nodes kept, since the rest of the pass runs on that many rows.

    With `compile` (True or a backend name; see `generate`), every pass after the prefill is one
    call of the compiled `_tree_pass` over the cache's whole buffers (with lookup branches or a
    tree budget, of `_host_tree_pass` over the host's tree, padded); `prune_threshold` must then
    be None.

    With `host_walk`, a pass verifies with `_walk` instead (see `generate`'s ``verify``). With
    `tree_budget`, each pass's stream tree is grown by confidence (`grow_tree`) on the host from
    the candidates' scores, which the pass's read then carries too.

    With `lookup`, each pass's tree is the stream tree with the lookup branches merged in
    (`streamspec.decoding.lookup`), built on the host from the tokens it has read: the pass's one read
    then carries the next stream candidates too. `history` is the text before `new_ids` (the
    tokens whose entries the cache holds) for the lookup; `generate` has none.
    """
    device = new_ids.device
    tree = _tree(shape).to(device)
    num_parents = sum(math.prod(shape[:d]) for d in range(len(shape)))  # nodes above the last depth
    width = max(shape)
    depth_limit = tree.depth_limit
    lower_layers = range(model.num_lower_layers)
    upper_layers = range(model.num_lower_layers, len(model.layers))
    out = GenerateOutput(tokens=new_ids.new_zeros(1, 0), forward_passes=0)
    backend = _compile_backend(compile)
    stream_nodes = tree.size if tree_budget is None else min(tree_budget, tree.size)
    most_nodes = stream_nodes if lookup is None else _lookup_nodes(stream_nodes, lookup)
    host_tree = lookup is not None or tree_budget is not None
    rows = most_nodes * (1 + model.num_drafts)
    needed = past + new_ids.shape[1] + max_new_tokens + rows
    if backend is not None:
        DecodeConfig(compile=backend, prune_threshold=prune_threshold)  # refuses pruning with compile
        needed = compiled_capacity(past + new_ids.shape[1] + max_new_tokens, rows)  # few capacities: few compilations
    cache.reserve(needed)

    # Prefill: streams at the last new position give the root and the first draft, from one
    # LM-head call over the main row and the stream rows the draft reads.
    start = clock()
    length = new_ids.shape[1]
    positions = torch.arange(past, past + length, device=device)[None]
    main_ok = main_allowed(causal(length, device), torch.ones(1, past + length, dtype=torch.bool, device=device))
    last = torch.full((1, 1), length - 1, dtype=torch.long, device=device)
    main, streams = model.step(new_ids, positions, main_ok, last, cache)
    forward_done = clock()
    logits = model.head(torch.cat([main[0, -1:], streams[0, 0, :depth_limit]], dim=0))  # [1 + depth, V]
    root = sampler(logits[:1], positions[0, -1:] + 1)  # [1]: the token at index past + length
    candidates = logits[1:].topk(width, dim=-1).indices
    scores = logits[1:].log_softmax(-1).gather(-1, candidates) if tree_budget is not None else None
    generated = read_to_host(root)
    stopped = on_tokens is not None and bool(on_tokens(list(generated)))
    end = clock()
    out.forward_passes, out.accepted_per_pass, out.seconds_per_pass = 1, [1], [end - start]
    out.forward_seconds_per_pass, out.head_seconds_per_pass = [forward_done - start], [end - forward_done]
    past += length
    all_nodes = torch.arange(most_nodes, device=device)
    all_valid = torch.ones(1, most_nodes, dtype=torch.bool, device=device)
    everything, every_slot_valid = all_nodes[: tree.size], all_valid[:, : tree.size]
    ones = torch.ones(1, past + max_new_tokens + most_nodes, dtype=torch.bool, device=device)
    tree_ok = tree.ancestors[None]
    if lookup is not None:
        text = NgramIndex(lookup.ngram)
        text.extend(list(history or []) + new_ids[0].tolist() + generated)
    if host_tree:  # the first draft's tokens (and scores), for the host to build the tree from
        stream_tree = _host_tree(shape)
        host_candidates = read_to_host(candidates)
        host_scores = read_to_host(scores) if scores is not None else None

    ended = generated[0] in stop or stopped
    if backend is not None and host_tree:
        return _speculate_compiled_host(model, cache, past, generated, ended, max_new_tokens, sampler, shape,
                                        stream_tree, host_candidates, host_scores, tree_budget, lookup,
                                        text if lookup is not None else None, most_nodes, width, stop, on_tokens,
                                        clock, backend, out, new_ids)
    if backend is not None:
        return _speculate_compiled(model, cache, past, root, candidates, generated, ended, max_new_tokens, sampler,
                                   tree, width, stop, on_tokens, clock, backend, out, new_ids)
    step_tree = tree
    full_children = _children(shape) if host_walk else None
    children = full_children
    while len(generated) < max_new_tokens and not ended:
        start = clock()
        head_seconds = 0.0
        if not host_tree:
            tokens = tree.tokens(root[0], candidates)
        else:  # the stream tree (fixed, or grown by confidence) with any lookup branches merged in
            base = stream_tree if tree_budget is None else StreamTreeOnHost.grown(host_scores, tree_budget)
            branches = text.continuations(lookup) if lookup is not None else []
            parents, host_tokens = base.with_branches(generated[-1], host_candidates, branches,
                                                      lookup.budget if lookup is not None else None)
            fixed = base is stream_tree and len(parents) == tree.size
            step_tree = tree if fixed else tree_from_parents(parents, depth_limit, shape).to(device)
            children = full_children if step_tree is tree or not host_walk else children_of(parents)
            tokens = torch.tensor(host_tokens, dtype=new_ids.dtype, device=device)
            everything, every_slot_valid = all_nodes[: step_tree.size], all_valid[:, : step_tree.size]
            tree_ok = step_tree.ancestors[None]
        positions = (past + step_tree.depth)[None]
        lower = model.run_lower(tokens[None], positions, main_allowed(tree_ok, ones[:, : past + step_tree.size]), cache)
        kept, sub, sub_ok = everything, step_tree, tree_ok
        if prune_threshold is not None:
            # Only parents' transition rows are read: no full-vocabulary logits for the leaves.
            mark = clock()
            early = model.early_exit_head(lower[0, :num_parents]).log_softmax(-1)
            kept = prune_by_transition(tree, tokens, early, prune_threshold)  # the one extra read: its size
            head_seconds += clock() - mark
            if len(kept) < tree.size:
                sub = tree.subset(kept)
                sub_ok = sub.ancestors[None]
                lower, positions = lower[:, kept], positions[:, kept]
                if host_walk:
                    children = sub.children()
            elif host_walk:
                children = full_children
        n = sub.size
        slots = everything[None, :n]
        main, streams = model.run_upper(
            lower, positions, main_allowed(sub_ok, ones[:, : past + n]), slots, every_slot_valid[:, :n], cache
        )
        forward_done = clock()
        if host_walk:
            node_tokens = read_to_host(tokens[kept])
            walked, root, stream_logits = _walk(model, main, streams, children, node_tokens, positions[0] + 1, sampler,
                                                depth_limit)
            candidates = stream_logits.topk(width, dim=-1).indices
            new = [node_tokens[i] for i in walked[1:]] + read_to_host(root)
            path = torch.tensor(walked, device=device)
            if host_tree:
                host_candidates = read_to_host(candidates)
                if tree_budget is not None:
                    host_scores = read_to_host(stream_logits.log_softmax(-1).gather(-1, candidates))
        else:
            verified = _verify(model, main, streams, sub, tokens[kept], positions[0] + 1, sampler, width,
                               draft_depth=depth_limit, with_scores=tree_budget is not None)
            path, accepted, root, candidates = verified[:4]
            scores = verified[4] if tree_budget is not None else None
            if not host_tree:
                summary = read_to_host(accepted)  # [depth of the deepest accepted node, its path's tokens...]
            else:  # ... and the next candidates (and scores) to build the next tree from: still one read
                summary, host_candidates, next_scores = split_host_read(
                    read_to_host(pack_host_read(accepted, candidates, scores)), len(accepted), width, depth_limit,
                    scores is not None)
                if scores is not None:
                    host_scores = next_scores
            new = summary[1 : summary[0] + 2]
        head_done = clock()
        # commit: the accepted path's entries (lower layers: of the nodes kept by pruning), the tokens
        past, ended = commit_pass(cache, past, new, ((kept[path], lower_layers), (path, upper_layers)), generated,
                                  max_new_tokens, stop, on_tokens)
        if lookup is not None:
            text.extend(new)
        record_pass(out, new, (step_tree.size, n), start, forward_done, head_done, clock(), head_seconds)

    kept_tokens = _within_limits(generated, 0, max_new_tokens, stop)
    out.tokens = torch.tensor([kept_tokens], dtype=new_ids.dtype, device=device)
    return out, past, kept_tokens


class _Clock:
    """perf_counter, after waiting for the device when profiling on an accelerator (there kernels
    run asynchronously, so unsynchronised times only say when work was queued)."""

    def __init__(self, device: torch.device, profile: bool) -> None:
        self.sync = profile and device.type == "cuda"

    def __call__(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


autoregressive = _autoregressive
Clock = _Clock
