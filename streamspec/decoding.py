"""Decoding a streamed model.

`generate_autoregressive` is plain greedy decoding of a `StreamedModel`, one token per forward
pass, with the main-stream KV cache: the reference that speculative decoding must reproduce. The
carrying rule (`streamspec.layout.carrying_positions`) holds here too: the last prompt position
and every generated position carry γ streams, so in shared mode the main stream sees them
exactly as in training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from .cache import MainStreamCache
from .layout import causal, main_allowed
from .model import StreamedModel
from .tree import DraftTree, build_tree, prune_by_transition, tree_shape


class Sampler:
    """Picks the next token from logits: argmax when `temperature` is 0, else a draw from the
    softmax of logits/temperature restricted to `top_k` and nucleus `top_p`, with its own RNG."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

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

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """One token (0-dim) from [V] logits."""
        if self.greedy:
            return logits.argmax(-1)
        return torch.multinomial(self.probs(logits), 1, generator=self.generator)[0]


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
    _check_generate_args(model, input_ids, max_new_tokens, 1, None, None, speculative=False,
                         caller="generate_autoregressive")
    return _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler).tokens


def _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler, profile: bool = False) -> "GenerateOutput":
    """One token per pass; the arguments were checked by the caller (`_check_generate_args`)."""
    choose = sampler or Sampler(device=input_ids.device)
    stop = _stop_set(eos_token_id)
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
        token = choose(model.head(main[0, -1])).view(1, 1)
        generated.append(int(token))
        end = clock()
        out.seconds_per_pass.append(end - start)
        out.forward_seconds_per_pass.append(forward_done - start)
        out.head_seconds_per_pass.append(end - forward_done)
        past += n
        tokens = token
        if int(token) in stop:
            break
    out.tokens = torch.tensor([generated], dtype=input_ids.dtype, device=device)
    out.forward_passes = len(generated)
    out.accepted_per_pass = [1] * len(generated)
    return out


def _stop_set(eos_token_id) -> set[int]:
    return set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])


@dataclass
class GenerateOutput:
    """Generated tokens and what it took.

    Attributes:
        tokens: [1, n] the new tokens (EOS included when it ended the text).
        forward_passes: model calls, prefill included.
        accepted_per_pass: tokens each call added (prefill: 1).
        nodes_per_pass: draft-tree nodes before and after pruning, per call after prefill.
        seconds_per_pass: wall time of each call, prefill included.
        lengths: for a batch, the number of real tokens of each row of `tokens`.
        forward_seconds_per_pass / head_seconds_per_pass: of each call's time, the part in the
            transformer layers and the part in the LM head and early-exit head (speculative decoding
            of one sequence, or one token per pass; on an accelerator only with ``profile=True``).
            The rest is `overhead_seconds_per_pass`.
    """

    tokens: torch.Tensor
    forward_passes: int
    accepted_per_pass: list[int] = field(default_factory=list)
    nodes_per_pass: list[tuple[int, int]] = field(default_factory=list)
    seconds_per_pass: list[float] = field(default_factory=list)
    lengths: list[int] | None = None
    forward_seconds_per_pass: list[float] = field(default_factory=list)
    head_seconds_per_pass: list[float] = field(default_factory=list)

    @property
    def overhead_seconds_per_pass(self) -> list[float]:
        """Per call, the time outside the transformer layers and the LM/early-exit heads: tree
        building, masks, verification bookkeeping, cache moves."""
        return [max(t - f - h, 0.0) for t, f, h in zip(self.seconds_per_pass, self.forward_seconds_per_pass,
                                                         self.head_seconds_per_pass)]

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens.shape[1] / max(self.forward_passes, 1)


@lru_cache(maxsize=16)
def _tree(shape: tuple[int, ...]) -> DraftTree:
    return build_tree(shape, len(shape))


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
            depths; see `streamspec.tree`). A batch (B > 1, padded through `attention_mask`) uses
            the single best path per sequence (tree_top_k 1).
        prune_threshold: drop draft children whose early-exit transition probability is below it.
        on_tokens: called with each call's accepted tokens as they come (one sequence only), cut
            at max_new_tokens and after EOS like the returned tokens. If it returns True, decoding
            stops after this call (a stop string was seen, a client went away); the returned
            tokens then end with the ones it was last given.
        profile: on an accelerator, wait for the device around each timed part so that the
            forward / head / overhead split is true (slower; on a CPU the split is always true).
    """
    batched = input_ids.dim() == 2 and input_ids.shape[0] > 1
    if tree_top_k is None:
        tree_top_k = 1 if batched else 3
    _check_generate_args(model, input_ids, max_new_tokens, tree_top_k, prune_threshold, attention_mask, speculative)
    sampler = Sampler(temperature, top_p, top_k, seed, device=input_ids.device)
    if batched:
        from .batching import generate_batch

        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        return generate_batch(model, input_ids, mask, max_new_tokens, sampler, _stop_set(eos_token_id), GenerateOutput)
    if attention_mask is not None and not attention_mask.bool().all():
        input_ids = input_ids[:, attention_mask[0].bool()]  # one sequence: drop its padding
    if not speculative:
        out = _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler, profile)
        if on_tokens is not None:
            on_tokens(out.tokens[0].tolist())
        return out
    g = model.stream_config.num_streams
    shape = tree_shape(tree_top_k, g)
    cache = MainStreamCache(len(model.layers), capacity=input_ids.shape[1] + max_new_tokens + _tree(shape).size * (g + 1))
    out, _ = speculate(model, cache, 0, input_ids, max_new_tokens, sampler, shape, prune_threshold,
                       _stop_set(eos_token_id), on_tokens, _Clock(input_ids.device, profile))
    return out


def speculate(model: StreamedModel, cache: MainStreamCache, past: int, new_ids: torch.Tensor, max_new_tokens: int,
              sampler: Sampler, shape: tuple[int, ...], prune_threshold: float | None, stop: set[int],
              on_tokens: Callable[[list[int]], bool | None] | None, clock: "_Clock") -> tuple[GenerateOutput, int]:
    """The speculative-streaming loop of one sequence, from a cache that already holds `past`
    entries and the tokens `new_ids` [1, n >= 1] that follow them (the prompt, for a fresh cache).
    Arguments are checked by the caller. Returns the output and how many entries the cache then
    holds: every token up to, not including, the last one generated (whose entries the next
    pass would write), before any cut by `max_new_tokens` or a stop token; a caller that keeps
    the cache crops it to the tokens it keeps (`DecodingSession` does)."""
    device = new_ids.device
    tree = _tree(shape).to(device)
    width = max(shape)
    full_children = tree.children()
    lower_layers = range(model.num_lower_layers)
    upper_layers = range(model.num_lower_layers, len(model.layers))
    out = GenerateOutput(tokens=new_ids.new_zeros(1, 0), forward_passes=0)

    # Prefill: streams at the last new position give the root and the first draft.
    start = clock()
    length = new_ids.shape[1]
    positions = torch.arange(past, past + length, device=device)[None]
    main_ok = main_allowed(causal(length, device), torch.ones(1, past + length, dtype=torch.bool, device=device))
    last = torch.full((1, 1), length - 1, dtype=torch.long, device=device)
    lower = model.run_lower(new_ids, positions, main_ok, cache)
    main, streams = model.run_upper(lower, positions, main_ok, last, torch.ones_like(last, dtype=torch.bool), cache)
    forward_done = clock()
    _, root, candidates = _walk(model, main[:, -1:], streams, [[]], [0], sampler, width, tree.depth_limit)
    generated = [int(root)]
    stopped = on_tokens is not None and bool(on_tokens([int(root)]))
    end = clock()
    out.forward_passes, out.accepted_per_pass, out.seconds_per_pass = 1, [1], [end - start]
    out.forward_seconds_per_pass, out.head_seconds_per_pass = [forward_done - start], [end - forward_done]
    past += length
    everything = torch.arange(tree.size, device=device)
    every_slot_valid = torch.ones(1, tree.size, dtype=torch.bool, device=device)
    ones = torch.ones(1, past + max_new_tokens + tree.size, dtype=torch.bool, device=device)
    tree_ok = tree.ancestors[None]

    ended = int(root) in stop or stopped
    while len(generated) < max_new_tokens and not ended:
        start = clock()
        head_seconds = 0.0
        tokens = tree.tokens(root, candidates)
        positions = (past + tree.depth)[None]
        lower = model.run_lower(tokens[None], positions, main_allowed(tree_ok, ones[:, : past + tree.size]), cache)
        kept, sub, children, sub_ok = everything, tree, full_children, tree_ok
        if prune_threshold is not None:
            # Only parents' transition rows are read: no full-vocabulary logits for the leaves.
            mark = clock()
            early = model.early_exit_head(lower[0, : tree.num_parents]).log_softmax(-1)
            kept = prune_by_transition(tree, tokens, early, prune_threshold)
            head_seconds += clock() - mark
            if len(kept) < tree.size:
                sub = tree.subset(kept.cpu()).to(device)
                children, sub_ok = sub.children(), sub.ancestors[None]
                lower, positions = lower[:, kept], positions[:, kept]
        n = sub.size
        slots = everything[None, :n]
        main, streams = model.run_upper(
            lower, positions, main_allowed(sub_ok, ones[:, : past + n]), slots, every_slot_valid[:, :n], cache
        )
        forward_done = clock()
        node_tokens = tokens[kept]
        path, root, candidates = _walk(model, main, streams, children, node_tokens.tolist(), sampler, width,
                                       tree.depth_limit)
        new = node_tokens[path[1:]].tolist() + [int(root)]
        head_done = clock()
        path_index = torch.tensor(path, device=device)
        cache.keep(past, kept[path_index], lower_layers)
        cache.keep(past, path_index, upper_layers)
        past += len(path)
        stopped = on_tokens is not None and bool(on_tokens(_within_limits(new, len(generated), max_new_tokens, stop)))
        generated.extend(new)
        ended = stopped or any(t in stop for t in new)
        end = clock()
        out.forward_passes += 1
        out.accepted_per_pass.append(len(new))
        out.nodes_per_pass.append((tree.size, n))
        out.seconds_per_pass.append(end - start)
        out.forward_seconds_per_pass.append(forward_done - start - head_seconds)
        out.head_seconds_per_pass.append(head_done - forward_done + head_seconds)

    out.tokens = torch.tensor([_within_limits(generated, 0, max_new_tokens, stop)], dtype=new_ids.dtype, device=device)
    return out, past


class _Clock:
    """perf_counter, after waiting for the device when profiling on an accelerator (there kernels
    run asynchronously, so unsynchronised times only say when work was queued)."""

    def __init__(self, device: torch.device, profile: bool) -> None:
        self.sync = profile and device.type == "cuda"

    def __call__(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


def accept_path(children: list[list[int]], node_tokens: list[int], choose_at: Callable[[int], torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """Verify a draft from the root down: at each node `choose_at(node)` gives the token chosen
    from the main stream's distribution there (argmax under greedy, else a draw); if a child
    holds it the walk moves there, else that token is the correction and the node is the deepest
    accepted one. Returns the accepted path (node indices from the root) and that token."""
    node, path = 0, [0]
    while True:
        token = choose_at(node)
        chosen = int(token)
        child = next((c for c in children[node] if node_tokens[c] == chosen), None)
        if child is None:
            return path, token
        node = child
        path.append(node)


def _walk(model: StreamedModel, main: torch.Tensor, streams: torch.Tensor, children: list[list[int]],
          node_tokens: list[int], sampler: Sampler, top_k: int, depth: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """`accept_path` on one sequence's tree. The LM head runs only on the nodes of the walk, each
    call on a node's main row and its first `depth` stream rows (those the next draft reads; on a
    CPU with packed kernels as cheap as the main row alone), never on the whole tree. Returns the
    path, the token chosen at its last node, and the top-k candidates [depth, k] of that node's
    streams (the next draft)."""
    last: dict[str, torch.Tensor] = {}

    def choose_at(node: int) -> torch.Tensor:
        logits = model.head(torch.cat([main[0, node : node + 1], streams[0, node, :depth]], dim=0))  # [1 + depth, V]
        last["streams"] = logits[1:]
        return sampler(logits[0])

    path, token = accept_path(children, node_tokens, choose_at)
    return path, token, last["streams"].topk(top_k, dim=-1).indices


def _within_limits(new: list[int], before: int, max_new_tokens: int, stop: set[int]) -> list[int]:
    """The part of `new` that the output keeps: up to max_new_tokens in all, and through the first
    stop token."""
    new = new[: max(max_new_tokens - before, 0)]
    for i, token in enumerate(new):
        if token in stop:
            return new[: i + 1]
    return new


def _check_generate_args(
    model, input_ids, max_new_tokens, tree_top_k, prune_threshold, attention_mask, speculative, caller="generate"
) -> None:
    if not isinstance(model, StreamedModel):
        raise TypeError(f"{caller} needs a StreamedModel (see add_streams), got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got {shape}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    g = model.stream_config.num_streams
    shape = tree_shape(tree_top_k, g)  # raises on a bad shape
    if input_ids.shape[0] > 1:
        if shape != (1,) * g or prune_threshold is not None:
            raise ValueError(
                "a batch decodes the single best path per sequence: tree_top_k must be 1 (or unset) and "
                "prune_threshold None"
            )
        if not speculative:
            raise ValueError("speculative=False decodes one sequence at a time; pass a batch of 1")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] + max_new_tokens + g > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) + the {g} stream positions "
            f"after the last token exceed the model's context of {limit} positions"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prune_threshold is not None and not 0 <= prune_threshold < 1:
        raise ValueError(f"prune_threshold must be in [0, 1) or None, got {prune_threshold}")
