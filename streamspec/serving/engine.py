"""The model side of `streamspec serve`: one request at a time through the model, text and stop
strings, log-probabilities, and the speculation statistics.

A streamed checkpoint decodes with speculative streaming (`streamspec.decoding.generate`): its
``on_tokens`` callback receives each pass's accepted tokens, which become text (and server-sent
events) at once, and returning True from it ends decoding after that pass (a stop string, a client
that went away). Any other causal LM decodes one token per pass through
`streamspec.decoding.session.DecodingSession`, whose stop rule plays the same part.

Log-probabilities are those of the main stream's distribution at each generated position,
computed the way decoding computes it (`Scorer`: the same KV-cached passes, streams carried at the
last prompt position and every generated one), in float32, before temperature or top-p.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..decoding.config import DecodeConfig, decode_config_of
from ..decoding.generate import generate
from ..decoding.sampling import Sampler
from ..patch.layout import causal, main_allowed
from ..loading import LoadedModel
from .protocol import APIError, DecodeStats


@dataclass
class Job:
    """One request, ready for the model."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # alternatives per position (0..20); None: no log-probabilities


@dataclass
class TokenScore:
    """A generated token's log-probability and the `k` most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Piece:
    """What a streaming request receives after a pass: new text and the new tokens' scores."""

    text: str
    scores: list[TokenScore]


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    scores: list[TokenScore] | None
    stats: DecodeStats
    stop_string: str | None = None  # which stop string ended the text (vLLM's stop_reason)


class Text:
    """Tokens → text as they arrive: cut at the first stop string (which the text leaves out, as
    OpenAI does), and handed out in pieces that never end inside a multi-byte character or in what
    may be the start of a stop string."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _find(self, text: str, start: int) -> int | None:
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def add(self, tokens: list[int]) -> list[int]:
        """Append a pass's tokens; returns those kept (all, or up to the one completing a stop string)."""
        if self.stopped or not tokens:
            return []
        start = max(0, len(self.text) - self.hold - 2)  # a stop string may straddle the passes
        base = len(self.tokens)
        self.tokens.extend(tokens)
        text = self._decode(self.tokens)
        if not self.stop or self._find(text, start) is None:
            self.text = text
            return tokens
        for i in range(1, len(tokens) + 1):  # the first token at which the stop string is there
            text = self._decode(self.tokens[: base + i])
            hit = self._find(text, start)
            if hit is not None:
                break
        del self.tokens[base + i:]
        self.matched = next(s for s in self.stop if text.find(s, start) == hit)
        self.text, self.stopped = text[:hit], True
        return tokens[:i]

    def take(self, final: bool = False) -> str:
        """The text not handed out yet that is safe to hand out (all of it when `final`)."""
        end = len(self.text)
        if not (final or self.stopped):
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":  # an incomplete character
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece


class Scorer:
    """Main-stream log-probabilities of generated tokens, computed incrementally with a KV cache
    of its own: `prefill` the prompt, then `score` tokens as they come."""

    CHUNK = 256  # positions per call: bounds the [n, vocabulary] logits held at once

    def __init__(self, model, streamed: bool, top: int, device: torch.device) -> None:
        self.model, self.streamed, self.top, self.device = model, streamed, top, device
        self.past = 0
        if streamed:
            from ..decoding.cache import MainStreamCache

            self.cache = MainStreamCache(len(model.layers))
        else:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
        self.next: torch.Tensor | None = None  # log-probabilities [1, V] for the next token

    @torch.no_grad()
    def _feed(self, ids: list[int], every_row: bool) -> torch.Tensor:
        """Run `ids` after what is cached; log-probabilities [n or 1, V] of the token after each
        (or only the last) of them. Streams are carried at every row (generated tokens) or only
        the last (the prompt), as decoding carries them."""
        n = len(ids)
        new = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(self.past, self.past + n, device=self.device)[None]
        if self.streamed:
            model = self.model
            ok = main_allowed(causal(n, self.device), torch.ones(1, self.past + n, dtype=torch.bool, device=self.device))
            slots = positions - self.past if every_row else torch.full((1, 1), n - 1, device=self.device)
            main, _ = model.step(new, positions, ok, slots, self.cache)
            logits = model.head(main[0] if every_row else main[0, -1:])
        else:
            logits = self.model(input_ids=new, position_ids=positions, cache=self.cache, use_cache=True,
                                logits_to_keep=0 if every_row else 1).logits[0]
        self.past += n
        return logits.float().log_softmax(-1)

    def prefill(self, prompt_ids: list[int]) -> None:
        for start in range(0, len(prompt_ids), self.CHUNK):
            self.next = self._feed(prompt_ids[start : start + self.CHUNK], every_row=False)

    def score(self, tokens: list[int]) -> list[TokenScore]:
        scores: list[TokenScore] = []
        for start in range(0, len(tokens), self.CHUNK):
            chunk = tokens[start : start + self.CHUNK]
            after = self._feed(chunk, every_row=True)
            rows = torch.cat([self.next, after[:-1]])
            self.next = after[-1:]
            ids = torch.tensor(chunk, device=rows.device)[:, None]
            chosen = rows.gather(1, ids)[:, 0].tolist()
            if self.top:
                values, indices = rows.topk(self.top, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            else:
                tops = [[] for _ in chunk]
            scores += [TokenScore(t, lp, top) for t, lp, top in zip(chunk, chosen, tops)]
        return scores


class Metrics:
    """Totals since the server started (`GET /metrics`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.time()
        self.counts = dict(requests=0, completed=0, cancelled=0, errors=0, prompt_tokens=0, completion_tokens=0,
                           generated_tokens=0, forward_passes=0)
        self.decode_seconds = 0.0
        self.accepted: dict[int, int] = {}

    def add(self, prompt_tokens: int, result: Result) -> None:
        with self.lock:
            c = self.counts
            c["completed" if result.finish_reason != "cancelled" else "cancelled"] += 1
            c["prompt_tokens"] += prompt_tokens
            c["completion_tokens"] += len(result.tokens)
            c["generated_tokens"] += result.stats.generated_tokens
            c["forward_passes"] += result.stats.forward_passes
            self.decode_seconds += result.stats.decode_seconds
            for n in result.stats.accepted_per_pass[1:]:  # after the prompt's pass
                self.accepted[n] = self.accepted.get(n, 0) + 1

    def count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    def snapshot(self) -> dict:
        with self.lock:
            c = dict(self.counts)
            passes, tokens = c["forward_passes"], c["generated_tokens"]
            steps = sum(self.accepted.values())
            return {
                **c,
                "tokens_per_pass": round(tokens / passes, 4) if passes else None,
                "mean_accepted_per_step": round(sum(n * k for n, k in self.accepted.items()) / steps, 4) if steps else None,
                "accepted_per_step_histogram": {str(n): k for n, k in sorted(self.accepted.items())},
                "decode_seconds": round(self.decode_seconds, 3),
                "tokens_per_second": round(tokens / self.decode_seconds, 2) if self.decode_seconds else None,
                "uptime_seconds": round(time.time() - self.started, 1),
            }


class Engine:
    """A loaded model behind a lock: requests are decoded one at a time (the model holds one KV
    cache per request and a CPU has no cores to spare for two), each in the caller's thread.

    Args:
        tree_top_k / prune_threshold / lookup / tree_budget: the draft tree of a streamed model
            (see `streamspec.decoding.generate`), checked at start-up.
        config: every decode option in one `streamspec.decoding.DecodeConfig` (verify and compile
            too) instead of those keywords (not both).
        max_model_len: the most tokens (prompt + completion) a request may use; default, and at
            most, the model's positions (less the γ stream positions after the last token of a
            streamed model).
    """

    def __init__(self, loaded: LoadedModel, tree_top_k: int | tuple[int, ...] = 3, prune_threshold: float | None = None,
                 max_model_len: int | None = None, lookup=None, tree_budget: int | None = None,
                 config: DecodeConfig | None = None) -> None:
        self.loaded = loaded
        self.model, self.tokenizer, self.streamed = loaded.model, loaded.tokenizer, loaded.streamed
        if config is None:
            config = DecodeConfig(tree_top_k=tree_top_k if self.streamed else None, prune_threshold=prune_threshold,
                                  lookup=lookup, tree_budget=tree_budget)
        else:
            decode_config_of(config, prune_threshold=prune_threshold, lookup=lookup, tree_budget=tree_budget)
        self.config = config.check(self.model)  # a bad tree fails at start-up
        self.tree_top_k, self.prune_threshold = config.tree_top_k, config.prune_threshold
        self.lookup, self.tree_budget = config.lookup, config.tree_budget
        extra = self.model.num_drafts if self.streamed else 0
        limit = loaded.max_length - extra if loaded.max_length else None
        if max_model_len is not None and limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds what the model can hold ({limit} tokens)")
        self.max_model_len = max_model_len or limit
        self.eos = loaded.eos_ids
        self.vocab = self.model.config.vocab_size  # the ids the embedding takes
        self.lock = threading.Lock()
        self.metrics = Metrics()

    # -- prompts ----------------------------------------------------------------------------------
    def completion_ids(self, prompt) -> list[int]:
        """A completions prompt: a string, a list of one string, or token ids (one list)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True).input_ids
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise APIError(f"token ids must be in [0, {self.vocab}); got {bad[:5]}", param="prompt")
        else:
            raise APIError("prompt must be a string, a list of one string, or a list of token ids "
                           "(one prompt per request)", param="prompt")
        if not ids:
            raise APIError("the prompt is empty", param="prompt")
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Chat messages through the model's chat template (as `streamspec generate` formats a
        prompt; the messages joined by blank lines for a model without one)."""
        from ..data.build import format_prompt

        try:
            text = format_prompt(self.tokenizer, {"messages": messages})
        except Exception as err:  # a template that refuses the roles or their order
            raise APIError(f"the chat template refused the messages: {err}", param="messages") from err
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise APIError("the messages are empty", param="messages")
        return ids

    def check_length(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """`max_tokens` (default: what the context leaves), refused when prompt + completion do not fit."""
        limit, used = self.max_model_len, len(prompt_ids)
        if limit is None:
            if max_tokens is None:
                raise APIError("max_tokens is required: the model states no context length", param="max_tokens")
            return max_tokens
        if max_tokens is None:
            max_tokens = limit - used
            if max_tokens < 1:
                raise APIError(f"This model's maximum context length is {limit} tokens; the prompt alone has {used}.",
                               param="messages", code="context_length_exceeded")
        if used + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested {used + max_tokens} "
                f"tokens ({used} in the prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    # -- decoding ---------------------------------------------------------------------------------
    def run(self, job: Job, emit: Callable[[Piece], None] | None = None,
            cancel: threading.Event | None = None) -> Result:
        """Decode `job`. With `emit`, text (and scores) are handed out after every pass and the
        whole text is handed out before returning. `cancel` set ends decoding after the pass."""
        with self.lock:
            return self._run(job, emit, cancel)

    def _run(self, job: Job, emit, cancel) -> Result:
        device = self.loaded.device
        text = Text(self.tokenizer, job.stop)
        scorer = None
        if job.logprobs is not None:
            scorer = Scorer(self.model, self.streamed, job.logprobs, device)
            if emit is not None:
                scorer.prefill(job.prompt_ids)
        scores: list[TokenScore] = []
        cancelled = cancel is not None and cancel.is_set()

        def on_tokens(tokens: list[int]) -> bool:
            kept = text.add(tokens)
            if emit is not None:
                new = scorer.score(kept) if scorer is not None and kept else []
                scores.extend(new)
                piece = text.take()
                if piece or new:
                    emit(Piece(piece, new))
            return text.stopped or (cancel is not None and cancel.is_set())

        start = time.perf_counter()
        if cancelled:
            passes, generated, accepted = 0, 0, []
        elif self.streamed:
            ids = torch.tensor([job.prompt_ids], dtype=torch.long, device=device)
            out = generate(self.model, ids, job.max_tokens, temperature=job.temperature, top_p=job.top_p,
                           top_k=job.top_k, seed=job.seed, config=self.config, eos_token_id=self.eos,
                           on_tokens=on_tokens)
            passes, generated, accepted = out.forward_passes, out.tokens.shape[1], out.accepted_per_pass
        else:
            from ..decoding.session import DecodingSession

            session = DecodingSession(self.model)
            session.extend(job.prompt_ids)
            seen = [0]

            def rule(tokens: list[int]) -> int | None:  # called with all tokens so far, after each pass
                new, seen[0] = tokens[seen[0]:], len(tokens)
                return len(tokens) if on_tokens(new) else None

            sampler = Sampler(job.temperature, job.top_p, job.top_k, job.seed, device=device)
            out = session.generate(job.max_tokens, sampler, eos_token_id=self.eos, stop=rule)
            passes, generated, accepted = out.forward_passes, out.computed, [1] * out.forward_passes
        seconds = time.perf_counter() - start

        if emit is not None:
            piece = text.take(final=True)
            if piece:
                emit(Piece(piece, []))
        elif scorer is not None and text.tokens:
            scorer.prefill(job.prompt_ids)
            scores = scorer.score(text.tokens)
        if text.stopped or (text.tokens and text.tokens[-1] in self.eos):
            reason = "stop"
        elif cancel is not None and cancel.is_set() or cancelled:
            reason = "cancelled"
        else:
            reason = "length"
        stats = DecodeStats(speculative=self.streamed, forward_passes=passes, generated_tokens=generated,
                            tokens_per_pass=round(generated / passes, 4) if passes else 0.0,
                            accepted_per_pass=list(accepted), decode_seconds=round(seconds, 4),
                            tokens_per_second=round(generated / seconds, 2) if seconds > 0 else 0.0)
        result = Result(tokens=list(text.tokens), text=text.text, finish_reason=reason,
                        scores=scores if scorer is not None else None, stats=stats, stop_string=text.matched)
        self.metrics.add(len(job.prompt_ids), result)
        return result

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])
