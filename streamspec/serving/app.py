"""The HTTP side of `streamspec serve`: an OpenAI-compatible FastAPI app around an `Engine`.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (with ``stream`` as server-sent events), and ``GET /metrics``
(speculation totals). Every error is an OpenAI error body with status 400 (a bad or over-long
request, validation errors included), 404 (an unknown model or path) or 500.

Each request decodes in a thread of its own (the engine's lock lets one at a time through the
model), so the event loop keeps answering health checks, streams and new requests meanwhile. A
client that disconnects ends its decoding after the current pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..devices import dtype_name
from ..loading import LoadedModel
from .engine import Engine, Job, Piece, Result, TokenScore
from .protocol import (
    APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, ChatResponseMessage, CompletionChoice, CompletionChunk, CompletionLogprobs,
    CompletionRequest, CompletionResponse, ErrorInfo, ErrorResponse, ModelCard, ModelList, TokenLogprob, TopLogprob,
    Usage, dump,
)

logger = logging.getLogger(__name__)
_DONE = object()


def create_app(loaded: LoadedModel, *, served_model_name: str | None = None, tree_top_k: int | tuple[int, ...] = 3,
               prune_threshold: float | None = None, max_model_len: int | None = None, lookup=None,
               tree_budget: int | None = None, config=None, api_key: str | None = None) -> FastAPI:
    """The app serving `loaded` (see `streamspec.loading.load_for_inference`) under the name
    `served_model_name` (default: its source). With `api_key`, every ``/v1/`` request must carry
    ``Authorization: Bearer <api_key>`` (as OpenAI's clients send it) or is answered 401;
    ``/health`` and ``/metrics`` stay open, as vLLM's do."""
    engine = Engine(loaded, tree_top_k=tree_top_k, prune_threshold=prune_threshold, max_model_len=max_model_len,
                    lookup=lookup, tree_budget=tree_budget, config=config)
    name = served_model_name or loaded.source
    app = FastAPI(title="streamspec serve", description="OpenAI-compatible speculative-streaming server")
    app.state.engine = engine

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1/") and not secrets.compare_digest(given, expected):
                engine.metrics.count("errors")
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's "
                                   "--api-key)", type="authentication_error", code="invalid_api_key")
            return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        engine.metrics.count("errors")
        return JSONResponse(dump(err.body), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 with its own body; OpenAI clients expect 400 and an error object.
        engine.metrics.count("errors")
        problems = err.errors()
        first = problems[0] if problems else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = None if first.get("type") == "json_invalid" else ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in problems) or "invalid request"
        return _error(400, message, param=where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error(err.status_code, str(err.detail), type=kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.exception("request failed")
        engine.metrics.count("errors")
        return _error(500, f"internal error: {type(err).__name__}: {err}", type="internal_error")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": name}

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=name, max_model_len=engine.max_model_len, streamed=engine.streamed)
        return dump(ModelList(data=[card]))

    @app.get("/metrics")
    async def metrics() -> dict:
        config = {"model": name, "streamed": engine.streamed, "device": str(loaded.device),
                  "dtype": dtype_name(loaded.dtype), "max_model_len": engine.max_model_len}
        if engine.streamed:
            decode, found = engine.config, engine.config.lookup
            top_k = decode.tree_top_k if decode.tree_top_k is not None else 3
            config.update(tree_top_k=list(top_k) if isinstance(top_k, tuple) else top_k,
                          prune_threshold=decode.prune_threshold, tree_budget=decode.tree_budget,
                          lookup=None if found is None else [found.tokens, found.matches, found.ngram],
                          verify=decode.verify, compile=decode.compile,
                          num_streams=engine.model.num_drafts)
        return {**config, **engine.metrics.snapshot()}

    def check(body) -> None:
        engine.metrics.count("requests")
        body.unsupported()
        if body.model is not None and body.model not in (name, loaded.source):
            raise APIError(f"The model `{body.model}` does not exist; this server serves `{name}`.", status=404,
                           param="model", code="model_not_found", type="not_found_error")

    def job_for(body, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None) -> Job:
        return Job(prompt_ids=prompt_ids, max_tokens=engine.check_length(prompt_ids, max_tokens),
                   temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                   stop=body.stop_strings(), logprobs=logprobs)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        job = job_for(body, engine.completion_ids(body.prompt), body.max_tokens, body.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            offset = [0]

            def chunk(piece: Piece | None, result: Result | None) -> dict:
                logprobs = None
                if job.logprobs is not None and piece is not None:
                    logprobs = completion_logprobs(engine, piece.scores, offset[0])
                    offset[0] += sum(len(t) for t in logprobs.tokens)
                choice = CompletionChoice(text=piece.text if piece else "", logprobs=logprobs,
                                          finish_reason=_reason(result) if result else None)
                return dump(CompletionChunk(id=rid, created=created, model=name, choices=[choice],
                                            streamspec=result.stats if result else None))

            return _stream(engine, job, request, chunk, body, start=None)
        result = await _run(engine, job, request)
        logprobs = completion_logprobs(engine, result.scores, 0) if result.scores is not None else None
        choice = CompletionChoice(text=result.text, logprobs=logprobs, finish_reason=_reason(result),
                                  stop_reason=result.stop_string)
        return dump(CompletionResponse(id=rid, created=created, model=name, choices=[choice],
                                       usage=_usage(job, result), streamspec=result.stats))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        job = job_for(body, engine.chat_ids(messages), body.max_completion_tokens or body.max_tokens, logprobs)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            def chunk(piece: Piece | None, result: Result | None) -> dict:
                logprobs = ChatLogprobs(content=chat_logprobs(engine, piece.scores)) \
                    if job.logprobs is not None and piece is not None else None
                delta = ChatDelta(content=piece.text) if piece is not None else ChatDelta()
                choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=_reason(result) if result else None)
                return dump(ChatCompletionChunk(id=rid, created=created, model=name, choices=[choice],
                                                streamspec=result.stats if result else None))

            first = dump(ChatCompletionChunk(id=rid, created=created, model=name,
                                             choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))
            return _stream(engine, job, request, chunk, body, start=first)
        result = await _run(engine, job, request)
        logprobs = ChatLogprobs(content=chat_logprobs(engine, result.scores)) if result.scores is not None else None
        choice = ChatChoice(message=ChatResponseMessage(content=result.text), logprobs=logprobs,
                            finish_reason=_reason(result))
        return dump(ChatCompletionResponse(id=rid, created=created, model=name, choices=[choice],
                                           usage=_usage(job, result), streamspec=result.stats))

    return app


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           type: str = "invalid_request_error") -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(dump(body), status_code=status)


def _reason(result: Result) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def _usage(job: Job, result: Result) -> Usage:
    prompt, completion = len(job.prompt_ids), len(result.tokens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_logprobs(engine: Engine, scores: list[TokenScore], offset: int) -> CompletionLogprobs:
    """The completions API's log-probabilities; `text_offset` counts from the completion's start
    (`offset` characters before these tokens)."""
    out = CompletionLogprobs()
    for score in scores:
        token = engine.token_text(score.token)
        out.tokens.append(token)
        out.token_logprobs.append(score.logprob)
        out.top_logprobs.append({engine.token_text(t): lp for t, lp in score.top})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(engine: Engine, scores: list[TokenScore]) -> list[TokenLogprob]:
    """The chat API's log-probabilities (``logprobs.content``)."""
    def entry(token: int, logprob: float) -> dict:
        text = engine.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [TokenLogprob(**entry(s.token, s.logprob), top_logprobs=[TopLogprob(**entry(t, lp)) for t, lp in s.top])
            for s in scores]


def _start(engine: Engine, job: Job, emit: Callable[[Piece], None] | None) -> tuple[asyncio.Future, threading.Event]:
    """Run the job in a thread of its own; its result (or exception) arrives in the future."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    cancel = threading.Event()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        try:
            result, error = engine.run(job, emit, cancel), None
        except BaseException as err:  # noqa: BLE001  (handed to the request, which answers 500)
            result, error = None, err
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the server shut down meanwhile
            pass

    threading.Thread(target=work, name="streamspec-decode", daemon=True).start()
    return future, cancel


async def _run(engine: Engine, job: Job, request: Request) -> Result:
    """Decode without streaming; a client that disconnects meanwhile cancels the decoding."""
    future, cancel = _start(engine, job, None)
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.5)
            if done:
                return future.result()
            if await request.is_disconnected():
                cancel.set()
    except BaseException:
        cancel.set()
        raise


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _stream(engine: Engine, job: Job, request: Request, chunk: Callable[[Piece | None, Result | None], dict],
            body, start: dict | None) -> StreamingResponse:
    """Server-sent events: `start` (if any), a chunk per pass with text, the last chunk with
    finish_reason and statistics, a usage chunk when ``stream_options.include_usage``, then
    ``data: [DONE]``. The decoding ends when the client goes away."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def events() -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        future, cancel = _start(engine, job, lambda piece: loop.call_soon_threadsafe(queue.put_nowait, piece))
        future.add_done_callback(lambda _: queue.put_nowait(_DONE))
        try:
            if start is not None:
                yield _sse(start)
            while (item := await queue.get()) is not _DONE:
                yield _sse(chunk(item, None))
            try:
                result = future.result()
            except Exception as err:  # noqa: BLE001  (the status is sent already: say it in the stream)
                logger.exception("streamed request failed")
                yield _sse(dump(ErrorResponse(error=ErrorInfo(message=f"internal error: {err}", type="internal_error"))))
            else:
                yield _sse(chunk(None, result))
                if include_usage:
                    usage = chunk(None, result)
                    usage.update(choices=[], usage=dump(_usage(job, result)), streamspec=None)
                    yield _sse(usage)
            yield _sse("[DONE]")
        finally:
            cancel.set()  # a client that went away: decoding stops after its current pass

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
