"""`streamspec serve`: the real server (uvicorn in a thread), bound to 127.0.0.1 only, on a port the
OS picks, talked to with the official `openai` client and httpx.

The model: conftest's tiny Llama (SmolLM2's tokenizer and chat template) taught, in a few
seconds, to recite three sentences in a loop, so that its text varies and its streams draft well
(whole paths accepted); served as a streamed checkpoint (speculative streaming) and as a plain
transformers folder (one token per pass).
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from transformers import AutoConfig, LlamaForCausalLM

from conftest import hf_greedy
from streamspec import StreamConfig, add_streams
from streamspec.data.build import format_prompt
from streamspec.decoding import generate
from streamspec.decoding.text import generate_text
from streamspec.loading import load_for_inference
from streamspec.serving import create_app

LOOPBACK = "127.0.0.1"  # every server here binds the loopback interface only
NAME = "tiny-streamed"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models decode much faster on one intra-op thread; the server's threads share it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    return sock


class _Server:
    """uvicorn serving `app` in a thread, on a loopback socket bound beforehand (no port race)."""

    def __init__(self, app) -> None:
        self.sock = _loopback_socket()
        host, port = self.sock.getsockname()
        assert host == LOOPBACK
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "_Server":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


SENTENCES = ("SELECT name, age FROM singer WHERE country = 'France' ORDER BY age DESC;",
             " The quick brown fox jumps over a lazy dog near our river bank.",
             " Streams draft future tokens while one model verifies them in a single pass!")


@pytest.fixture(scope="module")
def reciter(tiny_dir, tmp_path_factory) -> tuple:
    """(base folder, streamed checkpoint folder) of a tiny Llama that recites `SENTENCES` in a loop.

    Trained on a vocabulary of just the sentences' tokens (fast), then put into a model of the
    tokenizer's full vocabulary: those tokens' embedding and LM-head rows, every other head row
    zero (never predicted). Random models only repeat a token, and their streams draft nothing."""
    root = tmp_path_factory.mktemp("reciter")
    tokenizer = load_for_inference(tiny_dir, cpu_kernels=False).tokenizer
    vocab, cycles = [], []
    for sentence in SENTENCES:
        ids = [t for t in tokenizer(sentence, add_special_tokens=False).input_ids if t not in vocab]
        vocab += ids
        cycles.append(torch.tensor([vocab.index(t) for t in ids]))
    config = AutoConfig.from_pretrained(tiny_dir)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    small = add_streams(LlamaForCausalLM(type(config)(**{**config.to_dict(), "vocab_size": len(vocab)})),
                        StreamConfig(stream_layers=2)).train()
    optimizer = torch.optim.AdamW(small.parameters(), lr=5e-3)
    for _ in range(100):
        rows = [cycles[i][(torch.randint(len(cycles[i]), ()) + torch.arange(20)) % len(cycles[i])]
                for i in torch.randint(len(cycles), (8,)).tolist()]
        loss = small(torch.stack(rows), labels=torch.stack(rows)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    base = LlamaForCausalLM(config)
    base.load_state_dict({k: v for k, v in small.base.state_dict().items() if "embed" not in k and "lm_head" not in k},
                         strict=False)
    rows = torch.tensor(vocab)
    with torch.no_grad():
        base.model.embed_tokens.weight[rows] = small.base.model.embed_tokens.weight
        base.lm_head.weight.zero_()
        base.lm_head.weight[rows] = small.base.lm_head.weight
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    streamed = add_streams(LlamaForCausalLM.from_pretrained(root / "base"), StreamConfig(stream_layers=2))
    streamed.streams.load_state_dict(small.streams.state_dict())
    streamed.save_pretrained(root / "streamed")
    return root / "base", root / "streamed"


@pytest.fixture(scope="module")
def checkpoint(reciter):
    return reciter[1]


@pytest.fixture(scope="module")
def streamed(checkpoint):
    with _Server(create_app(load_for_inference(checkpoint), served_model_name=NAME)) as server:
        yield server


@pytest.fixture(scope="module")
def plain(reciter):
    with _Server(create_app(load_for_inference(reciter[0]), served_model_name="tiny-plain")) as server:
        yield server


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(server, text: str, model: str = NAME, **kwargs):
    return _client(server).chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **kwargs)


# -- answers ----------------------------------------------------------------------------------
def test_models_health_and_metrics(streamed):
    models = _client(streamed).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(f"{streamed.url}/health").json() == {"status": "ok", "model": NAME}
    _chat(streamed, "Hello", max_tokens=6, temperature=0)
    metrics = httpx.get(f"{streamed.url}/metrics").json()
    assert metrics["streamed"] and metrics["dtype"] == "float32" and metrics["tree_top_k"] == 3
    assert metrics["completed"] >= 1 and metrics["forward_passes"] >= 1 and metrics["tokens_per_pass"] >= 1


def test_greedy_equals_streamspec_generate(streamed, checkpoint):
    prompt = "How many singers do we have?"
    expected = generate_text(checkpoint, prompt, out=io.StringIO(), max_new_tokens=24)
    reply = _chat(streamed, prompt, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 24 and reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stats = reply.streamspec  # the extra top-level field
    assert stats["speculative"] and stats["forward_passes"] <= stats["generated_tokens"]
    assert sum(stats["accepted_per_pass"]) >= reply.usage.completion_tokens

    # the completions endpoint: the same prompt formatted by hand, as a string and as token ids
    client = _client(streamed)
    text = format_prompt(load_for_inference(checkpoint, cpu_kernels=False).tokenizer, {"prompt": prompt})
    as_text = client.completions.create(model=NAME, prompt=text, max_tokens=24, temperature=0)
    assert as_text.choices[0].text == expected
    ids = load_for_inference(checkpoint, cpu_kernels=False).tokenizer(text, add_special_tokens=False).input_ids
    as_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0)
    assert as_ids.choices[0].text == expected and as_ids.usage.prompt_tokens == len(ids)
    assert client.completions.create(model=NAME, prompt=[text], max_tokens=24, temperature=0).choices[0].text == expected


def test_streaming_equals_the_whole_answer(streamed):
    client = _client(streamed)
    whole = _chat(streamed, "Write about the sea.", max_tokens=30, temperature=0)
    chunks = list(_chat(streamed, "Write about the sea.", max_tokens=30, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].streamspec["generated_tokens"] == whole.streamspec["generated_tokens"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices

    plain = client.completions.create(model=NAME, prompt="The sea is", max_tokens=30, temperature=0)
    pieces = client.completions.create(model=NAME, prompt="The sea is", max_tokens=30, temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def test_sse_wire_format(streamed):
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{streamed.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def _prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """A chat prompt's ids, as `streamspec generate` and the chat endpoint format it."""
    return tokenizer(format_prompt(tokenizer, {"prompt": text}), return_tensors="pt", add_special_tokens=False).input_ids


def test_logprobs_are_the_main_streams(streamed, checkpoint):
    client = _client(streamed)
    reply = client.completions.create(model=NAME, prompt="SELECT name", max_tokens=12, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == token and top[token] == pytest.approx(logprob)
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]

    chat = _chat(streamed, "Count to five.", max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 10 and "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)

    # the values: the main stream's log-softmax at each generated position, as a scoring forward
    # computes it with streams carried where decoding carries them (the generated positions)
    loaded = load_for_inference(checkpoint, cpu_kernels=False)
    prompt = _prompt_ids(loaded.tokenizer, "Count to five.")
    tokens = generate(loaded.model, prompt, 10, eos_token_id=loaded.tokenizer.eos_token_id).tokens
    assert [loaded.tokenizer.decode([t]) for t in tokens[0].tolist()] == [c.token for c in content]
    ids = torch.cat([prompt, tokens], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, prompt.shape[1]:] = tokens
    with torch.no_grad():
        logits = loaded.model(ids, labels=labels, return_logits=True).logits[0, prompt.shape[1] - 1 : -1]
    expected = logits.log_softmax(-1).gather(1, tokens[0][:, None])[:, 0]
    assert [c.logprob for c in content] == pytest.approx(expected.tolist(), abs=1e-4)

    # streamed: the same tokens and values, piece by piece
    chunks = list(_chat(streamed, "Count to five.", max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                        stream=True))
    pieces = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in pieces] == [c.token for c in content]
    assert [e.logprob for e in pieces] == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_stop_strings(streamed):
    full = _chat(streamed, "Tell me a story.", max_tokens=40, temperature=0).choices[0].message.content
    assert len(full) > 12, full
    stop = full[8:11]
    cut = full[: full.index(stop)]
    reply = _chat(streamed, "Tell me a story.", max_tokens=40, temperature=0, stop=[stop, "never-there"])
    assert reply.choices[0].message.content == cut and reply.choices[0].finish_reason == "stop"
    streamed_text = "".join(c.choices[0].delta.content or "" for c in
                            _chat(streamed, "Tell me a story.", max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed_text == cut


def test_seeded_sampling_is_reproducible(streamed):
    a, b = (_chat(streamed, "Say something.", max_tokens=16, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
            for _ in range(2))
    assert a == b
    c = _client(streamed).completions.create(model=NAME, prompt="Once", max_tokens=16, temperature=0.8, seed=3)
    d = _client(streamed).completions.create(model=NAME, prompt="Once", max_tokens=16, temperature=0.8, seed=3, stream=True)
    assert "".join(p.choices[0].text for p in d) == c.choices[0].text


def test_concurrent_requests_are_all_answered(streamed):
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(4)]
    alone = [_chat(streamed, p, max_tokens=16, temperature=0).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: _chat(streamed, p, max_tokens=16, temperature=0).choices[0].message.content,
                                 prompts))
        streams = list(pool.map(lambda p: "".join(c.choices[0].delta.content or "" for c in
                                                  _chat(streamed, p, max_tokens=16, temperature=0, stream=True)), prompts))
    assert together == alone == streams


def test_a_client_that_goes_away_stops_its_decoding(streamed):
    before = httpx.get(f"{streamed.url}/metrics").json()["cancelled"]
    body = {"model": NAME, "prompt": "Go on forever", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{streamed.url}/v1/completions", json=body, timeout=60) as response:
        next(response.iter_lines())
    deadline = time.time() + 20
    while httpx.get(f"{streamed.url}/metrics").json()["cancelled"] == before:
        assert time.time() < deadline, "the decoding of a disconnected client did not stop"
        time.sleep(0.1)
    assert _chat(streamed, "Still there?", max_tokens=4, temperature=0).choices[0].message.content is not None


# -- refusals ---------------------------------------------------------------------------------
def _refused(server, path: str, body, status: int = 400) -> dict:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = httpx.post(f"{server.url}{path}", headers={"content-type": "application/json"}, timeout=60, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_requests_get_openai_errors(streamed):
    chat, completions = "/v1/chat/completions", "/v1/completions"
    assert _refused(streamed, chat, {"model": NAME})["param"] == "messages"
    assert _refused(streamed, chat, {"model": NAME, "messages": []})["param"] == "messages"
    assert _refused(streamed, completions, {"model": NAME, "prompt": "x", "temperature": 5})["param"] == "temperature"
    assert _refused(streamed, completions, {"model": NAME, "prompt": "x", "max_tokens": 0})["param"] == "max_tokens"
    assert _refused(streamed, completions, {"model": NAME, "prompt": "x", "logprobs": 21})["param"] == "logprobs"
    assert _refused(streamed, completions, {"model": NAME, "prompt": "x", "echo": True})["param"] == "echo"
    assert _refused(streamed, completions, {"model": NAME, "prompt": "x", "n": 2})["param"] == "n"
    assert _refused(streamed, completions, {"model": NAME, "prompt": ["a", "b"]})["param"] == "prompt"
    assert _refused(streamed, completions, {"model": NAME, "prompt": [5, 10 ** 9]})["param"] == "prompt"
    assert _refused(streamed, completions, {"model": NAME, "prompt": ""})["param"] == "prompt"
    assert _refused(streamed, completions, "{not json")["message"]
    assert _refused(streamed, completions, {"model": "other", "prompt": "x"}, status=404)["code"] == "model_not_found"
    assert _refused(streamed, "/v1/nowhere", {}, status=404)["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as err:
        _chat(streamed, "x", temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"


def test_over_long_prompts_are_refused(streamed):
    limit = _client(streamed).models.list().data[0].max_model_len
    assert limit == 2048 - 3  # the tiny model's positions, less the 3 stream positions after the last token
    error = _refused(streamed, "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": limit})
    assert error["code"] == "context_length_exceeded" and str(limit) in error["message"]
    error = _refused(streamed, "/v1/completions", {"model": NAME, "prompt": [42] * (limit + 1), "max_tokens": 1})
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        _chat(streamed, "word " * 2100, max_tokens=4)


# -- a plain model (no streams) -------------------------------------------------------------------
def test_plain_model(plain, reciter):
    loaded = load_for_inference(reciter[0], cpu_kernels=False)
    prompt = _prompt_ids(loaded.tokenizer, "How many singers do we have?")
    expected = loaded.tokenizer.decode(hf_greedy(loaded.model, prompt, 16)[0], skip_special_tokens=True)
    reply = _chat(plain, "How many singers do we have?", model="tiny-plain", max_tokens=16, temperature=0,
                  logprobs=True, top_logprobs=1)
    assert reply.choices[0].message.content == expected  # the same tokens as transformers generate
    assert not reply.streamspec["speculative"] and reply.streamspec["tokens_per_pass"] == 1.0
    assert all(c.top_logprobs[0].token == c.token for c in reply.choices[0].logprobs.content)
    chunks = _chat(plain, "How many singers do we have?", model="tiny-plain", max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    full = _client(plain).completions.create(model="tiny-plain", prompt=" The quick", max_tokens=20, temperature=0)
    stop = full.choices[0].text[10:13]
    cut = _client(plain).completions.create(model="tiny-plain", prompt=" The quick", max_tokens=20, temperature=0,
                                            stop=stop)
    assert cut.choices[0].text == full.choices[0].text[: full.choices[0].text.index(stop)]


# -- the command ----------------------------------------------------------------------------------
def test_serve_command(checkpoint, monkeypatch):
    """`streamspec serve` as a user types it: the flags reach the loader and the app (uvicorn.run
    is replaced by serving the same app here, on a loopback socket)."""
    from streamspec.cli import main

    seen = {}

    def run(app, host, port, log_level):
        seen.update(host=host, port=port)
        with _Server(app) as server:
            seen["metrics"] = httpx.get(f"{server.url}/metrics").json()
            seen["reply"] = _client(server).completions.create(model=str(checkpoint), prompt="SELECT name",
                                                               max_tokens=8, temperature=0)

    monkeypatch.setattr(uvicorn, "run", run)
    assert main(["serve", "--checkpoint", str(checkpoint), "--dtype", "bfloat16", "--tree-top-k", "3,1,1",
                 "--max-model-len", "512", "--port", "8123"]) == 0
    assert seen["host"] == LOOPBACK and seen["port"] == 8123  # loopback unless told otherwise
    metrics = seen["metrics"]
    assert metrics["dtype"] == "bfloat16" and metrics["tree_top_k"] == [3, 1, 1] and metrics["max_model_len"] == 512
    assert seen["reply"].usage.completion_tokens == 8 and seen["reply"].streamspec["speculative"]
    # the lookup branches and confidence trees reach the engine, and decode the same greedy text (fp32)
    assert main(["serve", "--checkpoint", str(checkpoint), "--port", "8125"]) == 0
    reference = seen["reply"].choices[0].text
    assert main(["serve", "--checkpoint", str(checkpoint), "--lookup", "4,2", "--tree-budget", "5", "--port", "8126"]) == 0
    assert seen["metrics"]["lookup"] == [4, 2, 3] and seen["metrics"]["tree_budget"] == 5
    assert seen["reply"].choices[0].text == reference
    assert main(["serve", "--checkpoint", str(checkpoint), "--lookup", "4,2", "--prune-threshold", "0.1"]) == 2  # refused


def test_an_api_key_is_required_when_given(reciter):
    """--api-key: /v1/ requests without it (or with another) get OpenAI's 401, with it they are
    answered; /health stays open."""
    app = create_app(load_for_inference(reciter[0]), served_model_name="tiny-keyed", api_key="s3cret")
    with _Server(app) as server:
        keyed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        reply = keyed.completions.create(model="tiny-keyed", prompt="SELECT", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        assert httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-keyed", "prompt": "a"}).status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_serving_beyond_loopback_without_a_key_warns(monkeypatch, capsys):
    import streamspec.serving.server as server_module

    ran = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.append((app, kw)))
    monkeypatch.delenv(server_module.API_KEY_ENV, raising=False)
    server_module.serve("streamspec:SmolLM2-135M-Instruct", host="0.0.0.0", port=1)
    assert "without an API key" in capsys.readouterr().err
    server_module.serve("streamspec:SmolLM2-135M-Instruct", host="127.0.0.1", port=1)
    monkeypatch.setenv(server_module.API_KEY_ENV, "k")
    server_module.serve("streamspec:SmolLM2-135M-Instruct", host="0.0.0.0", port=1)
    assert "without an API key" not in capsys.readouterr().err
    assert len(ran) == 3
    from fastapi.testclient import TestClient

    assert TestClient(ran[1][0]).get("/v1/models").status_code == 200
    assert TestClient(ran[2][0]).get("/v1/models").status_code == 401  # the key from $STREAMSPEC_API_KEY
    assert TestClient(ran[2][0]).get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert server_module.is_loopback("::1") and server_module.is_loopback("127.0.0.2")
    assert not server_module.is_loopback("example.org") and not server_module.is_loopback("10.0.0.1")
