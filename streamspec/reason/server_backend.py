"""SpecReason's backends behind an OpenAI-compatible server: `ServerBackend` (vLLM, SGLang,
`streamspec serve`) and `LlamaCppBackend` (a llama.cpp server this process starts on a GGUF)."""

from __future__ import annotations

import math
import os
import time

from .backend_base import (
    Backend,
    BackendError,
    ChatFrame,
    Generation,
    Judgement,
    Sampling,
    TextStop,
    _render_problem,
    chat_frame,
)
from .judging import DEFAULT_REQUEST, JudgeRequest, answer_of, judge_request


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
