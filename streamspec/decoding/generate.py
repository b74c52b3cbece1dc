"""Decoding a streamed model.

`generate_autoregressive` is plain greedy decoding of a `StreamedModel`, one token per forward
pass, with the main-stream KV cache: the reference that speculative decoding must reproduce. The
carrying rule (`streamspec.patch.layout.carrying_positions`) holds here too: the last prompt position
and every generated position carry γ streams, so in shared mode the main stream sees them
exactly as in training.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from typing import Callable

import torch

from .cache import MainStreamCache, StaticCacheView
from .config import COMPILE_BACKENDS, VERIFY_CHOICES, DecodeConfig, decode_config_of  # noqa: F401 (re-exported)
from ..patch.layout import causal, main_allowed
from ..patch.decoder import DecoderParts
from ..patch.model import StreamedModel
from .lookup import NgramIndex, PromptLookup, StreamTreeOnHost
from .tree import (
    DraftTree,
    accepted_nodes,
    build_tree,
    children_of,
    deepest_path,
    prune_by_transition,
    tree_from_parents,
)
from .output import GenerateOutput, _within_limits, read_to_host, stop_set
from ..arch import context_positions


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor | int, c: int):
    """x·c mod 2³² for x < 2³² held in int64, without overflowing int64 (x split in 16-bit halves)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def _hash32(x):
    """A 32-bit integer hash with good avalanche (the "lowbias32" constants of C. Wellons' hash
    prospector), on Python ints or int64 tensors holding values below 2³²."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class Sampler:
    """Picks the next token from logits: argmax when `temperature` is 0, else a draw from the
    softmax of logits/temperature restricted to `top_k` and nucleus `top_p`.

    Draws are keyed, not sequential: the draw for the token at sequence index t of row r uses
    the uniform number hash(seed, r, t) (inverse-CDF sampling). Speculative decoding chooses a
    token at every draft node of a pass at once, on the device, and keeps those on the accepted
    path; keyed by the index each node's token would have, the kept draws are exactly those one-
    token-per-pass sampling makes. So with a seed, speculative sampling returns the very tokens
    one-token-per-pass sampling returns, whatever the drafts. Regenerating the same indices with
    the same Sampler repeats its draws: make a new Sampler (or seed) for independent samples.
    Without a seed, one is drawn from torch's global generator.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self._seed = seed
        self._fresh = 0  # keys handed to calls that give none (row -1: never a sequence's)

    @property
    def seed(self) -> int:
        """The seed draws are keyed by (drawn from torch's global generator at first use when
        none was given; greedy decoding never needs it)."""
        if self._seed is None:
            self._seed = int(torch.randint(0, 2**62, ()))
        return self._seed

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from ([..., V])."""
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def key(self) -> int:
        """The 32-bit key all draws are hashed with (from the seed)."""
        return _hash32((self.seed & _MASK32) ^ _hash32((self.seed >> 32) & _MASK32))

    def uniforms(self, index: torch.Tensor, row: torch.Tensor | int = 0, key: torch.Tensor | int | None = None) -> torch.Tensor:
        """The uniform numbers in (0, 1) (float64) of the draws for the tokens at sequence indices
        `index` of rows `row` (broadcast together). `key` is `key()` (computed when None; a
        compiled pass gives it as a tensor, so that a new seed does not compile again)."""
        index = torch.as_tensor(index)
        if key is None:
            key = self.key()
        h = _hash32((index & _MASK32) ^ _hash32((torch.as_tensor(row, device=index.device) & _MASK32) ^ key))
        return (h.double() + 0.5) / 2.0**32

    def __call__(self, logits: torch.Tensor, index: torch.Tensor | None = None, row: torch.Tensor | int = 0,
                 key: torch.Tensor | int | None = None) -> torch.Tensor:
        """One token per row: [..., V] logits -> [...] token ids (0-dim from [V]). `index` [...]
        (with `row`) keys each draw (see the class); without it each call gets fresh keys. On the
        device: nothing is read back to the host."""
        if self.greedy:
            return logits.argmax(-1)
        probs = self.probs(logits)
        if index is None:
            count = probs[..., 0].numel()
            index = torch.arange(count, device=logits.device).view(probs.shape[:-1]) + self._fresh
            row, self._fresh = -1, self._fresh + count
        cdf = probs.double().cumsum(-1)
        target = self.uniforms(index.to(logits.device), row, key) * cdf[..., -1]
        token = torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1)
        return token.clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def generate_autoregressive(
    model: StreamedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    sampler: Sampler | None = None,
) -> torch.Tensor:
    """One token per pass (greedy unless a `Sampler` is given). `input_ids` is [1, T]; returns
    the new tokens [1, n] (stopping after an EOS token, which is included)."""
    _check_generate_args(model, input_ids, max_new_tokens, DecodeConfig(tree_top_k=1), None, speculative=False,
                         caller="generate_autoregressive")
    return _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler).tokens


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
        lower = model.run_lower(tokens, positions, main_ok, cache)
        main, _ = model.run_upper(lower, positions, main_ok, one_slot + (n - 1), valid, cache)
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


@torch.no_grad()
def generate(
    model: StreamedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    tree_top_k: int | tuple[int, ...] | None = None,
    prune_threshold: float | None = None,
    eos_token_id: int | list[int] | None = None,
    speculative: bool = True,
    seed: int | None = None,
    attention_mask: torch.Tensor | None = None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    profile: bool = False,
    compile: bool | str = False,
    lookup: PromptLookup | None = None,
    verify: str = "auto",
    tree_budget: int | None = None,
    config: DecodeConfig | None = None,
) -> GenerateOutput:
    """Speculative-streaming decoding (batch 1): each call verifies the previous draft tree with
    the main stream and drafts the next one from the streams of the deepest accepted node.

    Greedy (temperature 0): the tokens equal `generate_autoregressive` (``speculative=False`` runs
    that). Sampling: at each node of the accepted path a token is drawn from the main stream's
    distribution; if it is one of the node's children the path goes on, else it is the correction.
    Each token is therefore drawn from exactly the distribution autoregressive sampling uses
    (lossless); the drafts only decide how many draws one call can check.

    Args:
        tree_top_k: candidates per stream; default 3 for one sequence. A tuple gives them depth by
            depth, e.g. (3, 1, 1): three candidates for the next token, one below each (at most γ
            depths; see `streamspec.decoding.tree`). A batch (B > 1, padded through `attention_mask`) uses
            the single best path per sequence (tree_top_k 1).
        prune_threshold: drop draft children whose early-exit transition probability is below it.
        on_tokens: called with each call's accepted tokens as they come (one sequence only), cut
            at max_new_tokens and after EOS like the returned tokens. If it returns True, decoding
            stops after this call (a stop string was seen, a client went away); the returned
            tokens then end with the ones it was last given.
        profile: on an accelerator, wait for the device around each timed part so that the
            forward / head / overhead split is true (slower; on a CPU the split is always true).
        compile: run each draft-tree pass (tree tokens, the model, verification and the next
            draft: everything between two host reads) through ``torch.compile`` with static
            shapes (one sequence, speculative only). The pass attends over the whole preallocated
            cache, its capacity rounded up to a multiple of 256 entries, under a mask built on
            the device from the stored length, so the cache growing never compiles again; the
            prefill (any prompt length) runs uncompiled. The first call with a given model, tree
            shape, sampler setting (temperature, top_p, top_k; not the seed) and capacity compiles
            (seconds to minutes); later ones reuse it. Tokens equal ``compile=False`` (greedy, and
            sampled with the same seed) up to float rounding of the compiled kernels. True uses
            the "inductor" backend (a C++ compiler on a CPU); a backend name ("aot_eager",
            "eager") may be given instead. Refused with ``prune_threshold`` (pruning changes the
            number of rows in the middle of a pass) and for a batch. The forward/head split of
            the timings is not made: a pass's whole compiled call counts as forward time.
        lookup: prompt-lookup branches in the stream tree (`streamspec.decoding.lookup.PromptLookup`):
            each pass, continuations of the text's latest n-gram found earlier in the prompt or
            the generated text join the tree as extra branches, verified in the same pass. Exact
            like the stream tree. One sequence, uncompiled, without pruning.
        tree_budget: shape each pass's tree by confidence instead: from the `tree_top_k`
            candidates of each stream, grow the tree best-first by path probability (the product
            of the streams' probabilities along it) until it has this many nodes
            (`streamspec.decoding.tree.grow_tree`). One sequence, uncompiled, without pruning.
        verify: where a pass decides what it accepts. ``"device"``: with tensor operations on the
            model's device, one LM-head call over every row the pass may need (each node's main
            row and stream rows) and one read to the host per pass. ``"host"``: a walk down the
            accepted path, one LM-head call per accepted node over that node's rows and a read at
            each (the fewest head rows). ``"auto"`` (default): the host walk on a CPU, where a
            read costs nothing and every head call reads the whole LM-head weight from memory
            (docs/benchmarks.md), the device step elsewhere. Outputs are the same either way.
        config: all of the above decode options in one `DecodeConfig` (instead of the keywords
            tree_top_k, prune_threshold, lookup, tree_budget, verify and compile; not both).
    """
    config = decode_config_of(config, tree_top_k=tree_top_k, prune_threshold=prune_threshold, lookup=lookup,
                              tree_budget=tree_budget, verify=verify, compile=compile)
    batched = input_ids.dim() == 2 and input_ids.shape[0] > 1
    _check_generate_args(model, input_ids, max_new_tokens, config, attention_mask, speculative)
    prune_threshold, lookup, tree_budget = config.prune_threshold, config.lookup, config.tree_budget
    backend = config.compile_backend
    host_walk = config.walks_on_host(input_ids.device)
    sampler = Sampler(temperature, top_p, top_k, seed, device=input_ids.device)
    if batched:
        from .batch import generate_batch

        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        return generate_batch(model, input_ids, mask, max_new_tokens, sampler, stop_set(eos_token_id), GenerateOutput,
                              fuse_head=not host_walk)
    if attention_mask is not None and not attention_mask.bool().all():
        input_ids = input_ids[:, attention_mask[0].bool()]  # one sequence: drop its padding
    if not speculative:
        out = _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler, profile)
        if on_tokens is not None:
            on_tokens(out.tokens[0].tolist())
        return out
    g = model.stream_config.num_streams
    shape = config.shape(g)
    cache = MainStreamCache(len(model.layers), capacity=input_ids.shape[1] + max_new_tokens + _tree(shape).size * (g + 1))
    out, _, _ = speculate(model, cache, 0, input_ids, max_new_tokens, sampler, shape, prune_threshold,
                          stop_set(eos_token_id), on_tokens, _Clock(input_ids.device, profile), compile=backend or False,
                          lookup=lookup, host_walk=host_walk, tree_budget=tree_budget)
    return out


def walks_on_host(verify: str, device: torch.device, compile_backend: str | None = None) -> bool:
    """Whether a pass verifies its draft with the host walk (see `generate`'s ``verify``)."""
    return DecodeConfig(verify=verify, compile=compile_backend or False).walks_on_host(device)


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
    call of the compiled `_tree_pass` over the cache's whole buffers; `prune_threshold` must then
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
    needed = past + new_ids.shape[1] + max_new_tokens + most_nodes * (1 + model.stream_config.num_streams)
    if backend is not None:
        DecodeConfig(compile=backend, prune_threshold=prune_threshold)  # refuses pruning with compile
        needed = -(-needed // _CAPACITY_STEP) * _CAPACITY_STEP  # few distinct capacities: few compilations
    cache.reserve(needed)

    # Prefill: streams at the last new position give the root and the first draft, from one
    # LM-head call over the main row and the stream rows the draft reads.
    start = clock()
    length = new_ids.shape[1]
    positions = torch.arange(past, past + length, device=device)[None]
    main_ok = main_allowed(causal(length, device), torch.ones(1, past + length, dtype=torch.bool, device=device))
    last = torch.full((1, 1), length - 1, dtype=torch.long, device=device)
    lower = model.run_lower(new_ids, positions, main_ok, cache)
    main, streams = model.run_upper(lower, positions, main_ok, last, torch.ones_like(last, dtype=torch.bool), cache)
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
                parts = [accepted.double(), candidates.flatten().double()] + ([scores.flatten().double()] if scores is not None else [])
                flat = read_to_host(torch.cat(parts))
                summary, rest = [int(v) for v in flat[: len(accepted)]], flat[len(accepted):]
                host_candidates = [[int(v) for v in rest[d * width : (d + 1) * width]] for d in range(depth_limit)]
                if scores is not None:
                    rest = rest[depth_limit * width :]
                    host_scores = [rest[d * width : (d + 1) * width] for d in range(depth_limit)]
            new = summary[1 : summary[0] + 2]
        head_done = clock()
        cache.keep(past, kept[path], lower_layers, length=len(new))
        cache.keep(past, path, upper_layers, length=len(new))
        past += len(new)
        stopped = on_tokens is not None and bool(on_tokens(_within_limits(new, len(generated), max_new_tokens, stop)))
        generated.extend(new)
        if lookup is not None:
            text.extend(new)
        ended = stopped or any(t in stop for t in new)
        end = clock()
        out.forward_passes += 1
        out.accepted_per_pass.append(len(new))
        out.nodes_per_pass.append((step_tree.size, n))
        out.seconds_per_pass.append(end - start)
        out.forward_seconds_per_pass.append(forward_done - start - head_seconds)
        out.head_seconds_per_pass.append(head_done - forward_done + head_seconds)

    kept_tokens = _within_limits(generated, 0, max_new_tokens, stop)
    out.tokens = torch.tensor([kept_tokens], dtype=new_ids.dtype, device=device)
    return out, past, kept_tokens


def _speculate_compiled(model, cache, past, root, candidates, generated, ended, max_new_tokens, sampler, tree, width,
                        stop, on_tokens, clock, backend, out, new_ids):
    """The loop of `speculate` after the prefill, one compiled `_tree_pass` call per pass."""
    device = new_ids.device
    step = _compiled_pass(backend)
    key = torch.tensor(0 if sampler.greedy else sampler.key(), dtype=torch.long, device=device)
    capacity = cache._keys[0].shape[-2]
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        while len(generated) < max_new_tokens and not ended:
            start = clock()
            if past + tree.size > capacity:  # pragma: no cover - the capacity was reserved for this
                raise RuntimeError(f"cache capacity {capacity} is too small for a pass at {past}")
            past_t = torch.tensor(past, dtype=torch.long, device=device)
            path, accepted, root, candidates = step(model, cache._keys, cache._values, past_t, root, candidates, tree,
                                                    sampler, key, width)
            forward_done = clock()
            summary = read_to_host(accepted)  # [depth of the deepest accepted node, its path's tokens...]
            new = summary[1 : summary[0] + 2]
            head_done = clock()
            cache.keep(past, path, length=len(new))
            past += len(new)
            stopped = on_tokens is not None and bool(on_tokens(_within_limits(new, len(generated), max_new_tokens, stop)))
            generated.extend(new)
            ended = stopped or any(t in stop for t in new)
            end = clock()
            out.forward_passes += 1
            out.accepted_per_pass.append(len(new))
            out.nodes_per_pass.append((tree.size, tree.size))
            out.seconds_per_pass.append(end - start)
            out.forward_seconds_per_pass.append(forward_done - start)
            out.head_seconds_per_pass.append(head_done - forward_done)
    kept_tokens = _within_limits(generated, 0, max_new_tokens, stop)
    out.tokens = torch.tensor([kept_tokens], dtype=new_ids.dtype, device=device)
    return out, past, kept_tokens


def _verify(model: StreamedModel, main: torch.Tensor, streams: torch.Tensor, tree: DraftTree, node_tokens: torch.Tensor,
            next_index: torch.Tensor, sampler: Sampler, width: int,
            key: torch.Tensor | None = None, draft_depth: int | None = None, with_scores: bool = False,
            ) -> tuple[torch.Tensor, ...]:
    """Verify one sequence's draft tree and draft the next, on the device.

    The LM head runs once, over every node's main row and stream rows. The main stream chooses a
    token at every node (argmax, or one draw per
    node keyed by the sequence index of the token it chooses, `next_index` [N]: draws off the
    accepted path are never used and the kept ones are those one-token-per-pass sampling
    makes); a node is accepted when its whole path
    agrees (`accepted_nodes`); the token chosen at the deepest accepted node is the correction,
    and the next draft is the top-`width` of that node's stream logits. Returns the path [D+1] (node indices, padded past the deepest node),
    ``summary`` [D+2]: that node's depth, then the path's tokens after the root and the
    correction (padded), the new root [1] and the next candidates [draft_depth, width] (the
    stream tree's depth; a tree with lookup branches may be deeper); with `with_scores`, also
    the candidates' log-probabilities [draft_depth, width]."""
    depth_limit = tree.depth_limit
    n, draft = main.shape[1], draft_depth or depth_limit
    # One LM-head call over every row the pass may need: each node's main row, then its stream rows.
    logits = model.head(torch.cat([main[0], streams[0, :, :draft].reshape(n * draft, -1)]))
    choice = sampler(logits[:n], next_index, key=key)  # [N]: node i's choice is the token at next_index[i]
    best, path = deepest_path(tree, accepted_nodes(tree, node_tokens, choice))
    depth = tree.depth.index_select(0, best)  # [1]
    correction = choice.index_select(0, best)  # [1]
    levels = torch.arange(depth_limit + 1, device=main.device)
    drafted = torch.cat([node_tokens.index_select(0, path[1:]), correction])
    tokens = torch.where(levels == depth, correction, drafted)
    stream_logits = logits[n:].view(n, draft, -1).index_select(0, best)[0]  # [D, V]: the deepest node's streams
    candidates = stream_logits.topk(width, dim=-1).indices
    if with_scores:  # the candidates' log-probabilities, for a tree grown by confidence
        scores = stream_logits.log_softmax(-1).gather(-1, candidates)
        return path, torch.cat([depth, tokens]), correction, candidates, scores
    return path, torch.cat([depth, tokens]), correction, candidates


def _walk(model: StreamedModel, main: torch.Tensor, streams: torch.Tensor, children: list[list[int]],
          node_tokens: list[int], next_index: torch.Tensor, sampler: Sampler,
          depth: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Verify one sequence's draft tree from the root down, on the host: at each node the LM head
    runs on that node's main row and its first `depth` stream rows (one call), the main stream
    chooses a token there (keyed by `next_index`, as `_verify`); if a child holds it the walk
    moves there, else it is the correction. Returns the path (node indices), the correction [1]
    and the stream logits [depth, V] of the last node (the next draft's)."""
    node, path = 0, [0]
    while True:
        logits = model.head(torch.cat([main[0, node : node + 1], streams[0, node, :depth]], dim=0))  # [1 + depth, V]
        token = sampler(logits[:1], next_index[node : node + 1])
        chosen = int(token)
        child = next((c for c in children[node] if node_tokens[c] == chosen), None)
        if child is None:
            return path, token, logits[1:]
        node = child
        path.append(node)


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
    lower = model.run_lower(tokens[None], positions, main_ok, cache)
    slots = torch.arange(tree.size, device=tokens.device)[None]
    main, streams = model.run_upper(lower, positions, main_ok, slots, torch.ones_like(slots, dtype=torch.bool), cache)
    return _verify(model, main, streams, tree, tokens, positions[0] + 1, sampler, width, key)


_CAPACITY_STEP = 256  # compiled passes attend over buffers of a multiple of this many entries


@lru_cache(maxsize=None)
def _compiled_pass(backend: str):
    """`_tree_pass` through torch.compile with static shapes (one graph per model, tree shape,
    sampler settings and cache capacity; `past`, the tokens and the seed are tensors)."""
    return torch.compile(_tree_pass, backend=backend, dynamic=False, fullgraph=True)


def _compile_backend(compile: bool | str) -> str | None:
    return DecodeConfig(compile=compile).compile_backend


class _Clock:
    """perf_counter, after waiting for the device when profiling on an accelerator (there kernels
    run asynchronously, so unsynchronised times only say when work was queued)."""

    def __init__(self, device: torch.device, profile: bool) -> None:
        self.sync = profile and device.type == "cuda"

    def __call__(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


def _check_generate_args(model, input_ids, max_new_tokens, config: DecodeConfig, attention_mask, speculative,
                         caller="generate") -> None:
    """What `generate` refuses besides the decode options' own checks (`DecodeConfig.check`)."""
    if not isinstance(model, DecoderParts):
        raise TypeError(f"{caller} needs a StreamedModel (see add_streams) or a MedusaModel (add_medusa_heads), "
                        f"got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got {shape}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    config.check(model, batch=input_ids.shape[0], speculative=speculative)
    if input_ids.shape[0] > 1 and not speculative:
        raise ValueError("speculative=False decodes one sequence at a time; pass a batch of 1")
    g = model.stream_config.num_streams
    limit = context_positions(model.config)
    if limit is not None and input_ids.shape[1] + max_new_tokens + g > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) + the {g} stream positions "
            f"after the last token exceed the model's context of {limit} positions"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
