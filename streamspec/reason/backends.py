"""Where SpecReason's models run: in process (`LocalBackend`) or behind an OpenAI-compatible
server (`ServerBackend`: vLLM, SGLang, `streamspec serve`).

A backend holds one growing conversation: the solving prompt of the current problem, then the
steps kept so far. Text is what the roles exchange (drafter and base may have different
tokenizers); inside a backend, token ids are kept between calls and only new text is tokenised.
Every backend can

- `generate` the next piece of text (a step, stopping at the delimiter; the answer, stopping when
  the ``\\boxed{`` closes) and keep it,
- `judge` a step: keep it and read the model's probabilities of the digits 0..9 as the next token
  after the judging request, in one pass whose request tokens are then dropped again,
- `append` text written elsewhere, and `rollback` to a `mark`.

A local backend keeps the KV cache of everything kept (`streamspec.decoding.session.DecodingSession`), so
a judgement reads only the new step and the request; a step kept after its judgement keeps the
entries the judge pass wrote.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache


from ..decoding.config import DecodeConfig, decode_config_of
from ..decoding.sampling import Sampler
from ..decoding.session import DecodingSession
from ..loading import eos_ids
from .config import BackendConfig
from ..data.reasoning import solve_message
from .judging import DEFAULT_REQUEST, JudgeRequest, answer_of, answer_token_ids, in_process_refusal, judge_request

logger = logging.getLogger(__name__)
_SENTINEL = "\u2063STREAMSPEC-STEP\u2063"


class BackendError(RuntimeError):
    """A model backend failed (a server that cannot be reached or answers with an error)."""


@dataclass
class Generation:
    """Text a backend generated and kept.

    Attributes:
        text: the kept text.
        tokens: tokens generated for it (the budget counts these).
        passes: forward passes (speculative streaming: fewer than tokens; servers: None).
        seconds: wall time.
        ended: the model ended its turn (EOS) inside this text.
    """

    text: str
    tokens: int
    passes: int | None
    seconds: float
    ended: bool = False


@dataclass
class Judgement:
    """The judge's view of a step, read from its next-token distribution after the request
    (`streamspec.reason.judging`): the probability of each of the request's answers
    (`answer_probs`), the answer its single most likely token stands for (`top_answer`, None
    when none), tokens read, time. For the paper's ``score_0_9`` request also as `digit_probs`
    (P(d) for d in 0..9) and `top_digit`."""

    digit_probs: list[float]
    top_digit: int | None
    tokens_read: int
    seconds: float
    answer_probs: dict[str, float] | None = None
    top_answer: str | None = None
    request: str = "score_0_9"  # a judgement made from digits is a 0-9 score

    def __post_init__(self) -> None:
        if self.answer_probs is None:  # made from digits (score_0_9)
            self.answer_probs = {str(d): float(p) for d, p in enumerate(self.digit_probs)}
            self.top_answer = None if self.top_digit is None else str(self.top_digit)

    @classmethod
    def of_answers(cls, request: JudgeRequest, answer_probs: dict[str, float], top_answer: str | None,
                   tokens_read: int, seconds: float) -> "Judgement":
        digits = request.name == "score_0_9"
        return cls([answer_probs.get(str(d), 0.0) for d in range(10)] if digits else [],
                   int(top_answer) if digits and top_answer is not None else None, tokens_read, seconds,
                   answer_probs=dict(answer_probs), top_answer=top_answer, request=request.name)

    def score(self, how: str) -> float:
        """The reading `how` of the answer (`JudgeRequest.score`): for ``score_0_9``
        ``"argmax"`` (the most likely token's digit; a non-digit counts as 0) or ``"expected"``
        (Σ d·p(d) over the digits, renormalised); for the yes/no requests P(the step is right)
        or the log-odds."""
        return judge_request(self.request).score(self.answer_probs, self.top_answer, how)


@dataclass
class Sampling:
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int | None = None


class Backend(ABC):
    """One role's model with the conversation of the current problem (see the module docstring)."""

    name: str = "model"

    @abstractmethod
    def start(self, problem: str) -> None:
        """Begin a new problem: the conversation is the solving prompt, no steps yet."""

    @abstractmethod
    def mark(self) -> int:
        """An opaque position in the conversation, for `rollback`."""

    @abstractmethod
    def rollback(self, mark: int) -> None:
        """Drop everything after `mark`."""

    @abstractmethod
    def append(self, text: str) -> None:
        """Add text written elsewhere (a step another model wrote)."""

    @abstractmethod
    def generate(self, max_tokens: int, sampling: Sampling, stop: "TextStop") -> Generation:
        """Generate and keep text until `stop` says it is complete or `max_tokens` are spent."""

    @abstractmethod
    def judge(self, step: str, request: str | JudgeRequest | None = None) -> Judgement:
        """Keep `step` and read the answer distribution after the judging `request` (a name of
        `streamspec.reason.judging.JUDGE_REQUESTS`; default `judging.DEFAULT_REQUEST`,
        ``error_yes_no_fewshot``; ``"score_0_9"`` for the paper's 0-9 score); the request itself
        is not kept."""

    def close(self) -> None:
        """Release what the backend holds (connections)."""


class TextStop:
    """Where a generated text is complete: after the first `delimiter` (as servers apply stop
    strings: a text that starts with it is an empty step), or, with `boxed`, when the ``\\boxed{``
    that the text continues closes."""

    def __init__(self, delimiter: str | None = None, boxed: bool = False) -> None:
        if (delimiter is None) == (not boxed):
            raise ValueError("TextStop takes a delimiter or boxed=True")
        self.delimiter, self.boxed = delimiter, boxed

    def end(self, text: str) -> int | None:
        """The length of the complete text, or None if it is not complete yet."""
        if self.delimiter is not None:
            at = text.find(self.delimiter)
            return None if at < 0 else at + len(self.delimiter)
        depth = 1
        for i, ch in enumerate(text):
            depth += (ch == "{") - (ch == "}")
            if depth == 0:
                return i + 1
        return None


# -- chat framing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatFrame:
    """The text around the steps: `prefix(problem)` opens the assistant's turn after the solving
    prompt; `judge_suffix` closes the turn, asks for the score and opens the judge's reply."""

    head: str
    tail: str
    judge_suffix: str

    def prefix(self, problem: str) -> str:
        return self.head + solve_message(problem) + self.tail


def chat_frame(tokenizer, request: str | JudgeRequest = DEFAULT_REQUEST) -> ChatFrame:
    """Render the tokenizer's chat template once around sentinels: the conversation the judge
    sees is exactly the template's rendering of [user: problem, assistant: steps, user: request]
    (`request`: a `streamspec.reason.judging.JudgeRequest` or its name)."""
    request = judge_request(request)
    if getattr(tokenizer, "chat_template", None):
        problem_mark = "\u2063STREAMSPEC-PROBLEM\u2063"
        messages = [{"role": "user", "content": problem_mark}, {"role": "assistant", "content": _SENTINEL},
                    {"role": "user", "content": request.text}]
        if request.preamble:  # before the conversation: a system message
            messages = [{"role": "system", "content": request.preamble}] + messages
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template without a system role: the preamble opens the problem's message
            if not request.preamble:
                raise
            messages = messages[1:]
            messages[0] = {"role": "user", "content": request.preamble + "\n\n" + problem_mark}
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if text.count(_SENTINEL) != 1 or text.count(problem_mark) != 1:
            raise ValueError("the chat template does not render the assistant's turn verbatim; SpecReason needs it to")
        before, after = text.split(_SENTINEL)
        head, tail = before.split(problem_mark)
        # the solving prompt's user message is what solve_message makes of the problem
        return ChatFrame(head=head, tail=tail, judge_suffix=after + request.reply_opening)
    head = request.preamble + "\n\n" if request.preamble else ""
    return ChatFrame(head=head, tail="\n\nSolution:\n", judge_suffix=f"\n\n{request.text}\n{request.reply_opening}")


def _render_problem(frame: ChatFrame, problem: str) -> str:
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("the problem is empty")
    return frame.prefix(problem)


def _digit_ids(tokenizer) -> tuple[tuple[int, ...], ...]:
    """Every vocabulary entry that renders as one digit, with or without surrounding space, per
    digit 0..9 (the ``score_0_9`` request's answers)."""
    found = answer_token_ids(tokenizer, judge_request("score_0_9"))
    return tuple(found[str(d)] for d in range(10))


# -- in process -----------------------------------------------------------------------------------
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


# -- behind a server ------------------------------------------------------------------------------
class ServerBackend(Backend):
    """A model behind an OpenAI-compatible server, through ``POST {url}/completions``.

    The conversation is kept as text and sent whole with each request (servers with prefix
    caching, such as vLLM's, reuse their cache for it); the chat template comes from a local
    tokenizer (`tokenizer`, default the model name). The judge reads ``logprobs`` (top 20) of one
    generated token. One request checks the server and the model at start; none lists models per
    call. Failed requests (connection errors, 5xx, 429) are retried `retries` times with backoff.
    """

    def __init__(self, url: str, model: str, tokenizer=None, timeout: float = 300.0, retries: int = 2,
                 api_key: str | None = None, name: str = "model", client=None) -> None:
        import httpx

        self.name, self.model_name = name, model
        self.url = url.rstrip("/")
        self.retries = retries
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = client or httpx.Client(timeout=timeout, headers=headers)
        if tokenizer is None or isinstance(tokenizer, str):
            from ..assets import load_tokenizer

            source = tokenizer or model
            try:
                tokenizer = load_tokenizer(source)
            except (OSError, ValueError) as err:
                raise ValueError(f"the {name} at {url} needs a tokenizer for its chat template; {source!r} did not load "
                                 f"({str(err).splitlines()[0]}); pass tokenizer= (a folder or hub id)") from err
        self.frame = chat_frame(tokenizer)
        self._tokenizer = tokenizer
        self._frames: dict[str, ChatFrame] = {}
        # llama.cpp's slots by role (`LlamaCppBackend`): judgements keep their own prompt cache
        self.slots: dict[str, int] | None = None
        self._check_server()
        self.text = ""
        self._problem = ""
        self._steps_from = 0
        self._calls = 0

    def _check_server(self) -> None:
        import httpx

        try:
            response = self.client.get(f"{self.url}/models")
        except httpx.HTTPError as err:
            raise BackendError(f"cannot reach the {self.name} server at {self.url}: {err}") from err
        if response.status_code != 200:
            raise BackendError(f"the {self.name} server at {self.url} answered {response.status_code} to GET /models")
        served = [m.get("id") for m in response.json().get("data", [])]
        if served and self.model_name not in served:
            raise BackendError(f"the {self.name} server at {self.url} serves {served}, not {self.model_name!r}")

    def _complete(self, body: dict) -> dict:
        import httpx

        body = {"model": self.model_name, **body}
        for attempt in range(self.retries + 1):
            try:
                response = self.client.post(f"{self.url}/completions", json=body)
            except httpx.HTTPError as err:
                failure = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    return response.json()
                failure = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code < 500 and response.status_code != 429:
                    break  # a bad request does not get better by asking again
            if attempt < self.retries:
                time.sleep(0.5 * 2**attempt)
        raise BackendError(f"the {self.name} server at {self.url} failed: {failure}")

    def start(self, problem: str) -> None:
        self.text = _render_problem(self.frame, problem)
        self._problem, self._steps_from = problem, len(self.text)
        self._calls = 0

    def _slot(self, role: str) -> dict:
        return {"id_slot": self.slots[role]} if self.slots else {}

    def mark(self) -> int:
        return len(self.text)

    def rollback(self, mark: int) -> None:
        self.text = self.text[:mark]

    def append(self, text: str) -> None:
        self.text += text

    def generate(self, max_tokens: int, sampling: Sampling, stop: TextStop) -> Generation:
        start = time.perf_counter()
        body = {"prompt": self.text, "max_tokens": max_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, **self._slot("generate")}
        if sampling.seed is not None:
            body["seed"] = sampling.seed + self._calls
        self._calls += 1
        if stop.delimiter is not None:
            body["stop"] = [stop.delimiter]
        reply = self._complete(body)
        choice = reply["choices"][0]
        text = choice.get("text") or ""
        stopped = choice.get("finish_reason") == "stop"
        if "stop_reason" in choice:  # vLLM and streamspec serve say which stop string ended the text
            hit = stopped and choice["stop_reason"] == stop.delimiter
        else:  # others do not: an end-of-text token that follows a complete step is taken for it
            hit = stopped and bool(text.strip())
        if stop.delimiter is not None and hit and not text.endswith(stop.delimiter):
            text += stop.delimiter  # servers leave the stop string out of the text
        end = stop.end(text)
        if end is not None:
            text = text[:end]
        tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
        ended = stopped and not hit
        self.text += text
        return Generation(text=text, tokens=tokens, passes=None, seconds=time.perf_counter() - start, ended=ended)

    def judge(self, step: str, request: str | JudgeRequest | None = None) -> Judgement:
        start = time.perf_counter()
        request = judge_request(request or DEFAULT_REQUEST)
        self.text += step
        if request.name not in self._frames:  # rendered once per request
            self._frames[request.name] = chat_frame(self._tokenizer, request)
        frame = self._frames[request.name]
        if request.preamble:  # the judge's own conversation: its preamble, the problem, the steps
            prompt = frame.prefix(self._problem) + self.text[self._steps_from:] + frame.judge_suffix
        else:
            prompt = self.text + frame.judge_suffix
        reply = self._complete({"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 20,
                                **self._slot("judge")})
        choice = reply["choices"][0]
        answer_probs = dict.fromkeys(request.answers, 0.0)
        for token, logprob in top_logprobs(choice):
            answer = answer_of(token, request)
            if answer is not None:
                answer_probs[answer] += math.exp(float(logprob))
        top_answer = answer_of(choice.get("text") or "", request)
        usage, timings = reply.get("usage") or {}, reply.get("timings") or {}
        # the tokens the judgement prefilled: llama.cpp reports them past its prompt cache
        read = int(timings.get("prompt_n") if "prompt_n" in timings else usage.get("prompt_tokens") or 0)
        return Judgement.of_answers(request, answer_probs, top_answer, read, time.perf_counter() - start)

    def close(self) -> None:
        self.client.close()


class LlamaCppBackend(ServerBackend):
    """A GGUF on llama.cpp, run in this process: `streamspec.llamacpp.LlamaCppServer` (the
    ``xllamacpp`` wheel) bound to 127.0.0.1 on a free port with `threads` threads and prompt
    caching on, read as a `ServerBackend`; `close` stops it. It has two slots, each with its own
    prompt cache: the role's text (slot 0) and its judgements (slot 1), so judging never evicts
    the text's cache; with a request whose examples come first (``error_yes_no_fewshot_first``)
    a judgement prefills only the new step and the question. Those two caches are the only ones:
    llama.cpp's host-memory cache of earlier prompts is off, and `start` empties both slots, so
    every problem starts cold, as an in-process `LocalBackend` does (with that cache on, a method
    run after another on the same problem found the other's identical judgements cached: 1
    token prefilled where the first run prefilled ~270).

    Args:
        gguf: a ``.gguf`` path or a built-in name (`role_gguf`): the default model
            (``streamspec:SmolLM2-135M-Instruct``) or a reasoning model of
            `streamspec.reason.assets` (``streamspec:Qwen2.5-Coder-1.5B-Instruct``: the joined,
            verified GGUF that ``make reason-assets`` checks).
        threads: llama.cpp's CPU threads (keep every job's threads within the cores).
        tokenizer: where the chat template comes from (default: the built-in model's, or the
            GGUF's own through transformers).
        context: tokens of context.
    """

    def __init__(self, gguf: str, threads: int = 1, tokenizer=None, context: int = 8192, name: str = "model",
                 timeout: float = 600.0, retries: int = 0) -> None:
        from ..llamacpp import LlamaCppServer, server_model_id

        path = role_gguf(gguf)
        tokenizer = tokenizer if tokenizer is not None else _gguf_tokenizer(gguf, path)
        # two slots: the role's own text, and its judgements (each keeps its prompt cache)
        self.server = LlamaCppServer(path, threads=threads, context=context, parallel=2, ram_cache_mib=0,
                                     slot_actions=True).__enter__()
        try:
            super().__init__(self.server.url + "/v1", server_model_id(self.server.url), tokenizer=tokenizer,
                             timeout=timeout, retries=retries, name=name)
        except Exception:
            self.server.__exit__(None, None, None)
            raise
        self.slots = {"generate": 0, "judge": 1}
        self.gguf = path

    def start(self, problem: str) -> None:
        super().start(problem)
        self.server.erase_slots()  # a cold cache for every problem (and every method of one)

    def close(self) -> None:
        super().close()
        self.server.__exit__(None, None, None)


def role_gguf(name: str):
    """The GGUF file a ``llama.cpp:`` role names: a path, the default model's name, or a
    reasoning model's ``streamspec:`` id (joined and verified by `streamspec.reason.assets`)."""
    from ..assets import BUILTIN_PREFIX, DEFAULT_MODEL_ID
    from ..llamacpp import gguf_path
    from .assets import REASON_MODELS, check_gguf, join_gguf

    key = name[len(BUILTIN_PREFIX):].lower() if name.startswith(BUILTIN_PREFIX) else None
    if name != DEFAULT_MODEL_ID and key in REASON_MODELS:
        path = join_gguf(name)
        check_gguf(path, name)
        return path
    return gguf_path(name)


def _gguf_tokenizer(name: str, path):
    """The tokenizer of a ``llama.cpp:`` role: the default model's, a reasoning model's converted
    folder when it exists, else the GGUF's own (read by transformers; no model conversion)."""
    from ..assets import BUILTIN_PREFIX, DEFAULT_MODEL_ID, load_tokenizer

    if name in (DEFAULT_MODEL_ID, "default"):
        return load_tokenizer(DEFAULT_MODEL_ID)
    if name.startswith(BUILTIN_PREFIX):
        from ..assets import cache_dir
        from .assets import reason_model

        folder = cache_dir() / reason_model(name).title
        if (folder / "tokenizer_config.json").is_file():
            return load_tokenizer(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def top_logprobs(choice: dict) -> list[tuple[str, float]]:
    """The first generated token's top alternatives (token text, log-probability) from a
    ``/completions`` choice, in either shape servers answer with: the legacy
    ``logprobs.top_logprobs[0]`` mapping (vLLM, SGLang, `streamspec serve`) or the chat shape
    ``logprobs.content[0].top_logprobs`` list (llama.cpp's server)."""
    logprobs = choice.get("logprobs") or {}
    legacy = logprobs.get("top_logprobs")
    if legacy:
        return [(str(t), float(lp)) for t, lp in (legacy[0] or {}).items()]
    content = logprobs.get("content") or []
    if content:
        return [(str(e.get("token", "")), float(e.get("logprob", -math.inf))) for e in content[0].get("top_logprobs") or []]
    return []


def backend_from_config(config: BackendConfig, name: str) -> Backend:
    """Build the backend a `BackendConfig` describes (loading an in-process model, or starting a
    llama.cpp server for a ``llama.cpp:GGUF`` source)."""
    if config.llama_cpp is not None:
        return LlamaCppBackend(config.llama_cpp, threads=config.threads, tokenizer=config.tokenizer,
                               timeout=config.timeout, retries=config.retries, name=name)
    if config.is_server:
        return ServerBackend(config.source, config.model, tokenizer=config.tokenizer, timeout=config.timeout,
                             retries=config.retries, api_key=config.api_key, name=name)
    from ..loading import load_for_inference

    loaded = load_for_inference(config.source, device=config.device, dtype=config.dtype, gguf_file=config.gguf_file)
    return LocalBackend(loaded.model, loaded.tokenizer, streams=config.streams, name=name, config=config.decode_config())
