"""A decoding session: one token sequence that grows across calls, with its KV cache kept.

`streamspec.decoding.generate` decodes one prompt from an empty cache. A caller that writes a
text in pieces — SpecReason drafts a step, a judge reads it, the base rewrites it — needs more:
append tokens written elsewhere, generate a few more, read the next-token distribution, and roll
back to an earlier length, each time paying only for the tokens that are new to the cache.

`DecodingSession` does that for a `StreamedModel` (speculative streaming, greedy or sampled, the
same loop as `generate`) and for any plain transformers causal LM (one token per pass, the
baseline without streams). Invariant: ``ids[:cached]`` have their entries in the cache; the rest
are pending and go through the model with the next call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .cache import MainStreamCache
from .config import DecodeConfig, decode_config_of
from .loop import speculate
from .speculation import Clock, Speculation
from .sampling import Sampler
from .output import stop_set
from ..arch import context_positions
from .lookup import PromptLookup
from ..patch.layout import causal, main_allowed
from ..patch.decoder import DecoderParts


@dataclass
class SessionOutput:
    """What one `DecodingSession.generate` call wrote.

    Attributes:
        tokens: the new token ids (cut where the stop rule said, EOS included when it ended).
        forward_passes: model calls, the pass over pending tokens included.
        seconds: wall time of the call.
        ended: True when an EOS token ended the text.
        stopped: True when the stop rule cut the text.
        computed: tokens the model produced, before any cut (a speculative pass can accept tokens
            past the cut; they were computed but are not kept).
    """

    tokens: list[int]
    forward_passes: int
    seconds: float
    ended: bool = False
    stopped: bool = False
    computed: int = 0

    @property
    def tokens_per_pass(self) -> float:
        return self.computed / max(self.forward_passes, 1)


StopRule = Callable[[list[int]], int | None]
"""Called with all tokens generated so far in a call; returns how many of them to keep (the text
is complete there) or None to go on."""


class DecodingSession:
    """A growing token sequence of one model with its KV cache kept between calls.

    Args:
        model: a `StreamedModel` (decoded with speculative streaming) or a plain transformers
            causal LM (one token per pass).
        tree_top_k: the draft tree of a streamed model (see `streamspec.decoding.generate`);
            default 3.
        prune_threshold: early-exit pruning of the draft tree (streamed models only).
        compile: run each draft-tree pass compiled with static shapes (streamed models, without
            pruning; see `streamspec.decoding.generate`). The compiled pass is shared with
            `generate` and with other decoding sessions of the model; it compiles again only when the
            cache's buffers grow.
        lookup: prompt-lookup branches in the draft tree (`streamspec.decoding.lookup.PromptLookup`;
            streamed models, without pruning), looked up in the whole sequence.
        verify: where a pass decides what it accepts (``auto``, ``device``, ``host``; see
            `streamspec.decoding.generate`).
        tree_budget: grow each pass's tree by confidence up to this many nodes (see
            `streamspec.decoding.generate`).
        config: the decode options above in one `DecodeConfig` (instead of the keywords; not both).
    """

    def __init__(self, model: nn.Module, tree_top_k: int | tuple[int, ...] | None = None,
                 prune_threshold: float | None = None, compile: bool | str = False,
                 lookup: PromptLookup | None = None, verify: str = "auto", tree_budget: int | None = None,
                 config: DecodeConfig | None = None) -> None:
        config = decode_config_of(config, tree_top_k=tree_top_k, prune_threshold=prune_threshold, compile=compile,
                                  lookup=lookup, verify=verify, tree_budget=tree_budget)
        config = config.resolved(model)
        self.model = model
        self.streamed = isinstance(model, DecoderParts)  # streams or Medusa heads: the tree verifier
        if not self.streamed and not hasattr(model, "config"):
            raise TypeError(f"DecodingSession needs a StreamedModel or a transformers causal LM, got {type(model).__name__}")
        self.config = config.check(model)
        if self.streamed:
            self.shape = config.shape(model.num_drafts)
        self.tree_budget = config.tree_budget
        self.compile = config.compile
        self.lookup = config.lookup
        self.prune_threshold = config.prune_threshold
        self.device = next(model.parameters()).device
        self.host_walk = config.walks_on_host(self.device) if self.streamed else False
        self.ids: list[int] = []
        self.cached = 0
        self._new_cache()

    def _new_cache(self) -> None:
        if self.streamed:
            self.cache = MainStreamCache(len(self.model.layers))
        else:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=self.model.config)

    @property
    def context_limit(self) -> int | None:
        return context_positions(self.model.config)

    def __len__(self) -> int:
        return len(self.ids)

    def reset(self, ids: list[int] | None = None) -> None:
        """Start a new sequence (an empty cache), optionally with `ids`."""
        self.ids, self.cached = [], 0
        self._new_cache()
        if ids:
            self.extend(ids)

    def extend(self, ids: list[int]) -> None:
        """Append tokens written elsewhere; they go through the model with the next call."""
        ids = [int(i) for i in ids]
        limit = self.context_limit
        if limit is not None and len(self.ids) + len(ids) > limit:
            raise ValueError(f"the sequence would grow to {len(self.ids) + len(ids)} tokens, past the model's context "
                             f"of {limit}")
        self.ids.extend(ids)

    def rollback(self, length: int) -> None:
        """Keep the first `length` tokens (and their cache entries) and drop the rest."""
        if not 0 <= length <= len(self.ids):
            raise ValueError(f"cannot roll back to {length} tokens: the sequence has {len(self.ids)}")
        del self.ids[length:]
        self._crop(min(self.cached, length))

    def _crop(self, length: int) -> None:
        if self.streamed:
            self.cache.crop(length)
        elif self.cached > length:
            self.cache.crop(length - self.cached)  # transformers 5: a negative count of entries to drop
        self.cached = length

    def _pending(self) -> torch.Tensor:
        """The tokens to run next, [1, n >= 1]: the pending ones, or the last token again (its
        entry dropped) when everything is cached, since its outputs are needed once more."""
        if not self.ids:
            raise ValueError("the decoding session is empty: extend it with a prompt first")
        if self.cached == len(self.ids):
            self._crop(len(self.ids) - 1)
        return torch.tensor([self.ids[self.cached:]], dtype=torch.long, device=self.device)

    @torch.no_grad()
    def next_logits(self) -> torch.Tensor:
        """The main-stream logits [V] (float32) for the token after the sequence; the pending
        tokens enter the cache."""
        new = self._pending()
        n = new.shape[1]
        positions = torch.arange(self.cached, self.cached + n, device=self.device)[None]
        if self.streamed:
            model = self.model
            ok = main_allowed(causal(n, self.device), torch.ones(1, self.cached + n, dtype=torch.bool, device=self.device))
            last = torch.full((1, 1), n - 1, dtype=torch.long, device=self.device)
            main, _ = model.step(new, positions, ok, last, self.cache)
            logits = model.head(main[0, -1])
        else:
            logits = self.model(input_ids=new, position_ids=positions, cache=self.cache, use_cache=True,
                                logits_to_keep=1).logits[0, -1]
        self.cached += n
        return logits.float()

    @torch.no_grad()
    def generate(self, max_new_tokens: int, sampler: Sampler | None = None, eos_token_id: int | list[int] | None = None,
                 stop: StopRule | None = None) -> SessionOutput:
        """Generate up to `max_new_tokens` tokens after the sequence and append them.

        Args:
            sampler: greedy when None.
            eos_token_id: token(s) that end the text (kept).
            stop: a `StopRule`; where it returns a count, the new tokens are cut there, and the
                cache is rolled back to match (tokens accepted past the cut are dropped).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.context_limit
        extra = self.model.num_drafts if self.streamed else 0
        if limit is not None and len(self.ids) + max_new_tokens + extra > limit:
            raise ValueError(f"{len(self.ids)} tokens + max_new_tokens ({max_new_tokens}) exceed the model's context of {limit}")
        sampler = sampler or Sampler(device=self.device)
        stops = stop_set(eos_token_id)
        new = self._pending()
        start = time.perf_counter()
        seen: list[int] = []
        keep: list[int | None] = [None]

        def on_tokens(tokens: list[int]) -> bool:
            seen.extend(tokens)
            if stop is not None and keep[0] is None:
                keep[0] = stop(seen)
            return keep[0] is not None

        if self.streamed:
            run = Speculation(max_new_tokens, sampler, self.shape, stop=stops, on_tokens=on_tokens,
                              clock=Clock(self.device, False), compile=self.config.compile_backend,
                              prune_threshold=self.prune_threshold, lookup=self.lookup, tree_budget=self.tree_budget,
                              host_walk=self.host_walk, history=self.ids[: self.cached])
            out, cached, tokens = speculate(self.model, self.cache, self.cached, new, run)
            passes = out.forward_passes
            self.cached = cached
        else:
            tokens, passes = self._autoregressive(new, max_new_tokens, sampler, stops, on_tokens)
        computed = len(tokens)
        if keep[0] is not None:
            tokens = tokens[: keep[0]]
        self.ids.extend(tokens)
        self._crop(min(self.cached, len(self.ids)))
        return SessionOutput(tokens=tokens, forward_passes=passes, seconds=time.perf_counter() - start,
                             ended=bool(tokens) and tokens[-1] in stops, stopped=keep[0] is not None, computed=computed)

    def _autoregressive(self, new, max_new_tokens, sampler, stops, on_tokens) -> tuple[list[int], int]:
        tokens: list[int] = []
        while len(tokens) < max_new_tokens:
            n = new.shape[1]
            positions = torch.arange(self.cached, self.cached + n, device=self.device)[None]
            logits = self.model(input_ids=new, position_ids=positions, cache=self.cache, use_cache=True,
                                logits_to_keep=1).logits[0, -1]
            self.cached += n
            token = int(sampler(logits, torch.tensor(self.cached, device=self.device)))  # the token at index cached
            tokens.append(token)
            if on_tokens([token]) or token in stops:
                break
            new = torch.tensor([[token]], dtype=torch.long, device=self.device)
        return tokens, len(tokens)
