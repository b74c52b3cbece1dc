"""The public entry of decoding: `generate` (speculative streaming, one sequence or a batch) and
`generate_autoregressive` (one token per pass: the reference speculative decoding reproduces).
The rest of the room does the work (`config`, `sampling`, `tree`, `lookup`, `loop`: draft, one
pass, verify, one read, commit; `verify`, `compiled`, `batch`, `cache`, `output`). The carrying rule
(`streamspec.patch.layout.carrying_positions`) holds when decoding too: the last prompt position
and every generated position carry γ streams, as in training.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..patch.model import StreamedModel
from .cache import MainStreamCache
from .config import COMPILE_BACKENDS, VERIFY_CHOICES, DecodeConfig, decode_config_of  # noqa: F401 (re-exported)
from .config import check_generate_args as _check_generate_args
from .lookup import PromptLookup
from .loop import _autoregressive, _Clock, speculate  # noqa: F401 (speculate, _Clock: re-exported)
from ..devices import formulation
from .speculation import Speculation
from .output import GenerateOutput, stop_set
from .sampling import Sampler  # noqa: F401 (re-exported: streamspec.decoding.generate.Sampler)


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
        on_tokens: called with each call's accepted tokens as they come (one sequence only, cut at
            max_new_tokens and after EOS); returning True stops decoding after this call.
        profile: on an accelerator, wait for the device around each timed part (a true split of
            forward / head / overhead time; slower).
        compile: run each pass after the prefill (everything between two host reads) through
            ``torch.compile`` with static shapes, over a cache whose capacity is rounded up to a
            multiple of 256 entries, so the cache growing never compiles again. The first call with a
            given model, tree shape, sampler setting and capacity compiles (seconds to minutes); later
            ones reuse it. Tokens equal ``compile=False`` up to float rounding. True uses "inductor";
            a backend name ("aot_eager", "eager") may be given instead. Refused with
            ``prune_threshold``. A pass's whole compiled call counts as forward time.
        lookup: prompt-lookup branches (`streamspec.decoding.lookup.PromptLookup`): continuations of
            the text's latest n-gram found earlier join the tree, verified in the same pass. Exact
            like the stream tree. One sequence, without pruning.
        tree_budget: shape each pass's tree by confidence instead: from the `tree_top_k`
            candidates of each stream, grow the tree best-first by path probability (the product
            of the streams' probabilities along it) until it has this many nodes
            (`streamspec.decoding.tree.grow_tree`). One sequence, without pruning.
        verify: where a pass decides what it accepts. ``"device"``: tensor operations on the
            model's device and one read to the host per pass. ``"host"``: a walk down the accepted
            path, one LM-head call per accepted node (the fewest head rows). ``"auto"`` (default):
            the host walk on a CPU, where every head call reads the whole LM-head weight, the device
            step elsewhere (`DecodeConfig.walks_on_host`). Outputs are the same either way.
        config: all of the above decode options in one `DecodeConfig` (instead of the keywords
            tree_top_k, prune_threshold, lookup, tree_budget, verify and compile; not both).
    """
    config = decode_config_of(config, tree_top_k=tree_top_k, prune_threshold=prune_threshold, lookup=lookup,
                              tree_budget=tree_budget, verify=verify, compile=compile)
    batched = input_ids.dim() == 2 and input_ids.shape[0] > 1
    config = config.resolved(model, batch=input_ids.shape[0] if batched else 1, speculative=speculative)
    _check_generate_args(model, input_ids, max_new_tokens, config, attention_mask, speculative)
    prune_threshold, lookup, tree_budget = config.prune_threshold, config.lookup, config.tree_budget
    backend = config.compile_backend
    host_walk = config.walks_on_host(input_ids.device)
    sampler = Sampler(temperature, top_p, top_k, seed, device=input_ids.device)
    if batched:
        from .batch import generate_batch

        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        # one LM-head call a pass suits an accelerator; on a CPU, where each call reads the whole
        # head weight, two calls over the fewest rows: uncompiled with the host walk, and compiled
        # always (as a compiled single sequence's device step on a CPU)
        fuse_head = not host_walk if backend is None else not formulation(input_ids.device, backend, True).head_split
        return generate_batch(model, input_ids, mask, max_new_tokens, sampler, stop_set(eos_token_id), GenerateOutput,
                              fuse_head=fuse_head, compile_backend=backend)
    if attention_mask is not None and not attention_mask.bool().all():
        input_ids = input_ids[:, attention_mask[0].bool()]  # one sequence: drop its padding
    if not speculative:
        if backend is not None:
            from .compiled import autoregressive_compiled

            out = autoregressive_compiled(model, input_ids, max_new_tokens, stop_set(eos_token_id), sampler, backend,
                                          _Clock(input_ids.device, profile))
        else:
            out = _autoregressive(model, input_ids, max_new_tokens, eos_token_id, sampler, profile)
        if on_tokens is not None:
            on_tokens(out.tokens[0].tolist())
        return out
    g = model.num_drafts
    shape = config.shape(g)
    # The text's entries; `speculate` reserves the pass's rows on top (a compiled loop a capacity
    # rounded to a multiple of 256, one graph for many prompt lengths: reserving the full tree of
    # `shape` here, larger than a budgeted or lookup pass, made some prompts' buffers a size of
    # their own, and each such prompt compiled a graph of its own).
    cache = MainStreamCache(len(model.layers), capacity=input_ids.shape[1] + max_new_tokens)
    run = Speculation(max_new_tokens, sampler, shape, stop=stop_set(eos_token_id), on_tokens=on_tokens,
                      clock=_Clock(input_ids.device, profile), compile=backend, prune_threshold=prune_threshold,
                      lookup=lookup, tree_budget=tree_budget, host_walk=host_walk)
    out, _, _ = speculate(model, cache, 0, input_ids, run)
    return out

