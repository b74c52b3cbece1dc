"""SpecReason's in-process backend (`LocalBackend`): a model loaded here, its KV cache kept
across calls (`streamspec.decoding.session.DecodingSession`), so a judgement reads only the new
step and the request."""

from __future__ import annotations

import time
import zlib

from ..decoding.config import DecodeConfig, decode_config_of
from ..decoding.sampling import Sampler
from ..decoding.session import DecodingSession
from ..loading import eos_ids
from .backend_base import Backend, BackendError, Generation, Judgement, Sampling, TextStop, _render_problem, chat_frame
from .judging import DEFAULT_REQUEST, JudgeRequest, answer_token_ids, in_process_refusal, judge_request


class LocalBackend(Backend):
    """A model in this process: a `StreamedModel` (speculative streaming) or any transformers
    causal LM (one token per pass), with its tokenizer.

    Args:
        model: the model; a `StreamedModel` with ``streams=False`` runs its base without streams.
        tokenizer: its tokenizer (chat template used when it has one).
        tree_top_k: the draft tree of a streamed model (default: `default_tree`).
        name: for messages and traces.
        config: every decode option of a streamed model in one `streamspec.decoding.DecodeConfig`
            (instead of `tree_top_k`; its tree, when unset, is `default_tree`).
    """

    def __init__(self, model, tokenizer, streams: bool = True, tree_top_k=None, name: str = "model",
                 config: DecodeConfig | None = None) -> None:
        from ..patch.model import StreamedModel

        self.name = name
        self.streamed = isinstance(model, StreamedModel) and streams
        if isinstance(model, StreamedModel) and not streams:
            model = model.hf_model
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.frame = chat_frame(tokenizer)
        config = decode_config_of(config, tree_top_k=tuple(tree_top_k) if isinstance(tree_top_k, list) else tree_top_k)
        if self.streamed and config.tree_top_k is None:
            config = config.replace(tree_top_k=default_tree(model))
        self.session = DecodingSession(model, config=config) if self.streamed else DecodingSession(model)
        self.eos = eos_ids(model, tokenizer)
        self._suffixes: dict[str, list[int]] = {}
        self._sampler: Sampler | None = None
        self._sampler_key = None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def start(self, problem: str) -> None:
        prompt = _render_problem(self.frame, problem)
        ids = self._encode(prompt)
        if self.tokenizer.unk_token_id is not None and self.tokenizer.unk_token_id in ids:
            raise ValueError(f"the {self.name}'s tokenizer cannot render the prompt (unknown tokens in it)")
        self.session.reset(ids)
        self._sampler = None

    def mark(self) -> int:
        return len(self.session)

    def rollback(self, mark: int) -> None:
        self.session.rollback(mark)

    def append(self, text: str) -> None:
        self.session.extend(self._encode(text))

    def _sampler_for(self, sampling: Sampling) -> Sampler:
        key = (sampling.temperature, sampling.top_p, sampling.seed)
        if self._sampler is None or key != self._sampler_key:
            # one generator per problem: the draws of a run follow from the seed. Draws are keyed by
            # token index (streamspec.decoding.Sampler), so each backend mixes its name into the
            # seed: a base rewriting a drafter's step must not reuse the drafter's numbers.
            seed = None if sampling.seed is None else sampling.seed ^ (zlib.crc32(self.name.encode()) << 31)
            self._sampler = Sampler(sampling.temperature, sampling.top_p, seed=seed, device=self.session.device)
            self._sampler_key = key
        return self._sampler

    def generate(self, max_tokens: int, sampling: Sampling, stop: TextStop) -> Generation:
        decode = self.tokenizer.decode
        checked = [0]

        def rule(tokens: list[int]) -> int | None:
            # the fewest tokens whose text is complete (a chunk of accepted tokens can run past it)
            for k in range(checked[0] + 1, len(tokens) + 1):
                if stop.end(decode(tokens[:k])) is not None:
                    return k
            checked[0] = len(tokens)
            return None

        limit = self.session.context_limit
        if limit is not None:
            extra = self.model.num_drafts if self.streamed else 0
            max_tokens = min(max_tokens, limit - len(self.session) - extra)
            if max_tokens < 1:
                raise BackendError(f"the {self.name}'s context of {limit} tokens is full")
        out = self.session.generate(max_tokens, self._sampler_for(sampling), self.eos, rule)
        if out.ended:
            # the end-of-turn token stays out of the conversation: an answer cue may follow it
            self.session.rollback(len(self.session) - 1)
        text = decode(out.tokens, skip_special_tokens=True)
        return Generation(text=text, tokens=len(out.tokens), passes=out.forward_passes, seconds=out.seconds,
                          ended=out.ended)

    def _suffix_ids(self, request: JudgeRequest) -> list[int]:
        if request.name not in self._suffixes:
            self._suffixes[request.name] = self._encode(chat_frame(self.tokenizer, request).judge_suffix)
        return self._suffixes[request.name]

    def judge(self, step: str, request: str | JudgeRequest | None = None) -> Judgement:
        start = time.perf_counter()
        request = judge_request(request or DEFAULT_REQUEST)
        if request.preamble:
            raise in_process_refusal(request.name)
        answers = answer_token_ids(self.tokenizer, request)
        self.append(step)
        keep = self.mark()
        self.session.extend(self._suffix_ids(request))
        read = len(self.session) - self.session.cached
        probs = self.session.next_logits().softmax(-1)
        self.session.rollback(keep)
        answer_probs = {a: float(probs[list(ids)].sum()) for a, ids in answers.items()}
        top = int(probs.argmax())
        top_answer = next((a for a, ids in answers.items() if top in ids), None)
        return Judgement.of_answers(request, answer_probs, top_answer, read, time.perf_counter() - start)


def default_tree(model) -> tuple[int, ...]:
    """The draft tree a streamed drafter uses unless told: on a CPU two candidates for the next
    token and one below each, (2, 1, ..., 1) — each tree node costs about as much as a token there,
    and this narrow shape was the fastest on validation prompts (SmolLM2 reasoning drafter, 3
    GSM8K validation problems: tokens/s plain 9.1, chain 8.5, (2,1,1) 8.5, 3 per depth 5.6; see
    docs/reasoning.md); on an accelerator, where width is nearly free, three per depth."""
    g = model.num_drafts
    device = next(model.parameters()).device
    return (2,) + (1,) * (g - 1) if device.type == "cpu" else (3,) * g
