"""The decode loops of one sequence: one token per pass (`autoregressive`) and speculative
streaming (`speculate`). Each pass reads top to bottom as gpt-fast's loop does: draft, one model
pass, verify, one read, commit.

`speculate` prefills, then hands the passes to one of three loops: the compiled fixed tree
(`streamspec.decoding.compiled.speculate_compiled`: everything of a pass on the device in one
graph call, one read), the compiled host-built tree (lookup branches, confidence budgets:
`speculate_compiled_host`) or the uncompiled loop here (`_speculate_eager`: pruning, the host
walk, and trees built on the host too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..patch.layout import causal, main_allowed
from ..patch.model import StreamedModel
from .cache import MainStreamCache
from .compiled import speculate_compiled, speculate_compiled_host
from .config import DecodeConfig
from .graphs import compiled_capacity
from .lookup import NgramIndex, PromptLookup, StreamTreeOnHost
from .output import GenerateOutput, pack_host_read, record_pass, split_host_read, stop_set
from .sampling import Sampler
from .speculation import Clock, Prefilled, Speculation, commit_tokens, finish
from .tree import DraftTree, build_tree, children_of, prune_by_transition, tree_from_parents
from .verify import verify_on_device as _verify, walk_on_host as _walk

def _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler, profile: bool = False) -> "GenerateOutput":
    """One token per pass; the arguments were checked by the caller (`_check_generate_args`). One
    read from the device per pass: the token, to know whether it ends the text."""
    choose = sampler or Sampler(device=input_ids.device)
    stop = stop_set(eos_token_id)
    device = input_ids.device
    clock = Clock(device, profile)
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
        value = out.read(token)[0]
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


def speculate(model: StreamedModel, cache: MainStreamCache, past: int, new_ids: torch.Tensor,
              run: Speculation) -> tuple[GenerateOutput, int, list[int]]:
    """The speculative-streaming loop of one sequence, from a cache that already holds `past`
    entries and the tokens `new_ids` [1, n >= 1] that follow them (the prompt, for a fresh cache),
    decoding as `run` says (checked by the caller). Returns the output, how many entries the
    cache then holds and the output's tokens as a list (read on the host already). The cache
    holds every token up to, not including, the last one generated (whose entries the next pass
    would write), before any cut by `max_new_tokens` or a stop token; a caller that keeps the
    cache crops it to the tokens it keeps (`DecodingSession` does).

    Each pass runs on the device from the draft tree's tokens to the next one's; the host reads
    one small vector per pass (the accepted tokens and their count, and for a tree built on the
    host the next candidates and scores) to call `on_tokens`, test for stop tokens and count the
    cache's entries. Early-exit pruning reads one thing more, the number of nodes kept; the host
    walk reads at each node it visits.
    """
    tree = _tree(run.shape).to(new_ids.device)
    width = max(run.shape)
    stream_nodes = tree.size if run.tree_budget is None else min(run.tree_budget, tree.size)
    most_nodes = stream_nodes if run.lookup is None else _lookup_nodes(stream_nodes, run.lookup)
    text_entries = past + new_ids.shape[1] + run.max_new_tokens
    rows = most_nodes * (1 + model.num_drafts)
    if run.compile is not None:
        DecodeConfig(compile=run.compile, prune_threshold=run.prune_threshold)  # refuses pruning with compile
        cache.reserve(compiled_capacity(text_entries, rows))  # few capacities: few compilations
    else:
        cache.reserve(text_entries + rows)
    first = _prefill(model, cache, past, new_ids, run, tree.depth_limit, width)
    if run.compile is not None and run.host_tree:
        return speculate_compiled_host(model, cache, run, first, _host_tree(run.shape), most_nodes, width)
    if run.compile is not None:
        return speculate_compiled(model, cache, run, first, tree, width)
    return _speculate_eager(model, cache, run, first, tree, width, most_nodes)


def _prefill(model: StreamedModel, cache: MainStreamCache, past: int, new_ids: torch.Tensor, run: Speculation,
             depth: int, width: int) -> Prefilled:
    """The first pass: the new tokens through the model, streams at the last one; one LM-head
    call over its main row and the stream rows the draft reads gives the root and the first
    draft. One read: the root (with the candidates and scores when the host builds the trees)."""
    device = new_ids.device
    out = GenerateOutput(tokens=new_ids.new_zeros(1, 0), forward_passes=0)
    start = run.clock()
    length = new_ids.shape[1]
    positions = torch.arange(past, past + length, device=device)[None]
    main_ok = main_allowed(causal(length, device), torch.ones(1, past + length, dtype=torch.bool, device=device))
    last = torch.full((1, 1), length - 1, dtype=torch.long, device=device)
    main, streams = model.step(new_ids, positions, main_ok, last, cache)
    forward_done = run.clock()
    logits = model.head(torch.cat([main[0, -1:], streams[0, 0, :depth]], dim=0))  # [1 + depth, V]
    root = run.sampler(logits[:1], positions[0, -1:] + 1)  # [1]: the token at index past + length
    candidates = logits[1:].topk(width, dim=-1).indices
    first = Prefilled(out, [], past + length, root, candidates, ended=False)
    if run.host_tree:  # the first draft's tokens (and scores) too, for the host to build the tree from
        scores = logits[1:].log_softmax(-1).gather(-1, candidates) if run.tree_budget is not None else None
        summary, first.host_candidates, first.host_scores = split_host_read(
            out.read(pack_host_read(root, candidates, scores)), 1, width, depth, scores is not None)
    else:
        summary = out.read(root)
    first.ended = commit_tokens(run, first.generated, summary[:1])
    if run.lookup is not None:
        first.text = NgramIndex(run.lookup.ngram)
        first.text.extend(list(run.history or []) + new_ids[0].tolist() + first.generated)
    end = run.clock()
    out.forward_passes, out.accepted_per_pass, out.seconds_per_pass = 1, [1], [end - start]
    out.forward_seconds_per_pass, out.head_seconds_per_pass = [forward_done - start], [end - forward_done]
    return first


@dataclass
class _Draft:
    """The uncompiled loop's draft between passes: on the device the root and candidates, on the
    host (trees built there) their copies and scores."""

    root: torch.Tensor
    candidates: torch.Tensor
    host_candidates: list[list[int]] | None = None
    host_scores: list[list[float]] | None = None
    children: list[list[int]] | None = field(default=None)


def _speculate_eager(model: StreamedModel, cache: MainStreamCache, run: Speculation, first: Prefilled,
                     tree: DraftTree, width: int, most_nodes: int):
    """`speculate` after the prefill, uncompiled: per pass the draft tree (fixed, or built on the
    host), the lower layers, pruning, the MSA layers, verification (on the device, one read; or
    the host walk), and the commit of the accepted path's entries and tokens."""
    device = first.root.device
    out, generated, past, ended, text = first.out, first.generated, first.past, first.ended, first.text
    draft = _Draft(first.root, first.candidates, first.host_candidates, first.host_scores)
    lower_layers = range(model.num_lower_layers)
    upper_layers = range(model.num_lower_layers, len(model.layers))
    all_nodes = torch.arange(most_nodes, device=device)
    all_valid = torch.ones(1, most_nodes, dtype=torch.bool, device=device)
    ones = torch.ones(1, past + run.max_new_tokens + most_nodes, dtype=torch.bool, device=device)
    while len(generated) < run.max_new_tokens and not ended:
        start = run.clock()
        step_tree, tokens = _draft_tree(run, tree, draft, generated, text)
        positions = (past + step_tree.depth)[None]
        lower = model.run_lower(tokens[None], positions, main_allowed(step_tree.ancestors[None],
                                                                      ones[:, : past + step_tree.size]), cache)
        kept, sub, head_seconds = all_nodes[: step_tree.size], step_tree, 0.0
        if run.prune_threshold is not None:
            # Only parents' transition rows are read: no full-vocabulary logits for the leaves.
            mark = run.clock()
            num_parents = sum(math.prod(run.shape[:d]) for d in range(len(run.shape)))
            early = model.early_exit_head(lower[0, :num_parents]).log_softmax(-1)
            kept = prune_by_transition(tree, tokens, early, run.prune_threshold)  # the one extra read: its size
            head_seconds += run.clock() - mark
            if len(kept) < tree.size:
                sub = tree.subset(kept)
                lower, positions = lower[:, kept], positions[:, kept]
                if run.host_walk:
                    draft.children = sub.children()
        n = sub.size
        main, streams = model.run_upper(lower, positions, main_allowed(sub.ancestors[None], ones[:, : past + n]),
                                        all_nodes[None, :n], all_valid[:, :n], cache)
        forward_done = run.clock()
        new, path = _verify_and_read(model, run, out, draft, main, streams, sub, tokens[kept], positions[0] + 1, width,
                                     tree.depth_limit)
        head_done = run.clock()
        cache.keep(past, kept[path], lower_layers, length=len(new))  # lower layers: of the nodes kept by pruning
        cache.keep(past, path, upper_layers, length=len(new))
        past += len(new)
        ended = commit_tokens(run, generated, new)
        if text is not None:
            text.extend(new)
        record_pass(out, new, (step_tree.size, n), start, forward_done, head_done, run.clock(), head_seconds)
    return finish(out, run, generated, past, first.root)


def _draft_tree(run: Speculation, tree: DraftTree, draft: _Draft, generated: list[int], text):
    """This pass's tree and its tokens [N]: the fixed stream tree on the device, or the stream
    tree (fixed, or grown by confidence) with any lookup branches merged in, built on the host.
    Sets the tree's children for the host walk."""
    full_children = _children(run.shape) if run.host_walk else None
    if not run.host_tree:
        draft.children = full_children
        return tree, tree.tokens(draft.root[0], draft.candidates)
    stream_tree = _host_tree(run.shape)
    base = stream_tree if run.tree_budget is None else StreamTreeOnHost.grown(draft.host_scores, run.tree_budget)
    lookup = run.lookup
    branches = text.continuations(lookup) if lookup is not None else []
    parents, host_tokens = base.with_branches(generated[-1], draft.host_candidates, branches,
                                              lookup.budget if lookup is not None else None)
    fixed = base is stream_tree and len(parents) == tree.size
    device = draft.root.device
    step_tree = tree if fixed else tree_from_parents(parents, tree.depth_limit, run.shape).to(device)
    draft.children = full_children if step_tree is tree or not run.host_walk else children_of(parents)
    return step_tree, torch.tensor(host_tokens, dtype=torch.long, device=device)


def _verify_and_read(model, run: Speculation, out: GenerateOutput, draft: _Draft, main, streams, tree: DraftTree,
                     tokens: torch.Tensor, next_index: torch.Tensor, width: int, depth: int):
    """Verify a pass and read what the host needs: on the device (`_verify`, one read) or by the
    host walk. Updates `draft` with the next root and candidates; returns the new tokens and the
    accepted path (node indices of `tree`)."""
    with_scores = run.tree_budget is not None
    if run.host_walk:
        node_tokens = out.read(tokens)
        walked, draft.root, stream_logits = _walk(model, main, streams, draft.children, node_tokens, next_index,
                                                  run.sampler, depth)
        draft.candidates = stream_logits.topk(width, dim=-1).indices
        new = [node_tokens[i] for i in walked[1:]] + out.read(draft.root)
        if run.host_tree:
            draft.host_candidates = out.read(draft.candidates)
            if with_scores:
                draft.host_scores = out.read(stream_logits.log_softmax(-1).gather(-1, draft.candidates))
        return new, torch.tensor(walked, device=tokens.device)
    verified = _verify(model, main, streams, tree, tokens, next_index, run.sampler, width, draft_depth=depth,
                       with_scores=with_scores)
    path, accepted, draft.root, draft.candidates = verified[:4]
    if not run.host_tree:
        summary = out.read(accepted)  # [depth of the deepest accepted node, its path's tokens...]
    else:  # ... and the next candidates (and scores) to build the next tree from: still one read
        summary, draft.host_candidates, scores = split_host_read(
            out.read(pack_host_read(accepted, draft.candidates, verified[4] if with_scores else None)), len(accepted),
            width, depth, with_scores)
        if with_scores:
            draft.host_scores = scores
    return summary[1 : summary[0] + 2], path


autoregressive = _autoregressive
_Clock = Clock
