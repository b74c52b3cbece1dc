"""`DecodingSession`: a sequence that grows across calls keeps its cache, and every call decodes
exactly what decoding the whole sequence at once would."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding import Sampler, generate
from streamspec.decoding.session import DecodingSession

pytestmark = pytest.mark.usefixtures("single_thread")


def streamed(arch, mode, seed=1):
    return add_streams(make_model(arch, seed), StreamConfig(stream_layers=2, mode=mode)).eval()


def one_token(model, ids, n):
    return generate(model, torch.tensor([ids]), n, speculative=False).tokens[0].tolist()


@pytest.mark.parametrize("mode", ["shared", "lossless"])
@pytest.mark.parametrize("tree", [3, (2, 1, 1), 1])
def test_pieces_equal_one_token_per_pass(arch, mode, tree):
    """Generate, append foreign tokens, generate again: each piece equals one-token-per-pass
    decoding of the whole sequence so far (tokens written elsewhere enter as a prompt would)."""
    model = streamed(arch, mode)
    prompt = random_ids(1, 7, 3)[0].tolist()
    session = DecodingSession(model, tree_top_k=tree)
    session.extend(prompt)
    first = session.generate(6)
    assert first.tokens == one_token(model, prompt, 6)
    session.extend([5, 6, 7])
    second = session.generate(8)
    assert second.tokens == one_token(model, prompt + first.tokens + [5, 6, 7], 8)
    assert session.ids == prompt + first.tokens + [5, 6, 7] + second.tokens


@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_rollback_restores_the_state_it_had(arch, mode):
    model = streamed(arch, mode)
    prompt = random_ids(1, 7, 4)[0].tolist()
    session = DecodingSession(model)
    session.extend(prompt)
    whole = session.generate(12).tokens
    session.rollback(len(prompt) + 3)
    assert session.cached <= len(prompt) + 3
    assert session.generate(9).tokens == whole[3:]
    # the next-token distribution after a rollback is the one decoding computes there
    session.rollback(len(prompt) + 5)
    assert int(session.next_logits().argmax()) == whole[5]


def test_stop_rule_cuts_tokens_and_cache(arch):
    model = streamed(arch, "lossless")
    prompt = random_ids(1, 6, 5)[0].tolist()
    session = DecodingSession(model)
    session.extend(prompt)
    whole = session.generate(12).tokens
    session.rollback(len(prompt))
    out = session.generate(12, stop=lambda tokens: 5 if len(tokens) >= 5 else None)
    assert out.stopped and out.tokens == whole[:5] and out.computed >= 5
    assert len(session) == len(prompt) + 5 and session.cached <= len(session)
    assert session.generate(4).tokens == whole[5:9]  # nothing past the cut leaked into the cache


def test_plain_model_session_equals_transformers_generate(arch):
    base = make_model(arch, 1)
    prompt = random_ids(1, 7, 6)[0].tolist()
    session = DecodingSession(base)
    session.extend(prompt)
    first = session.generate(6)
    session.extend([5, 6])
    second = session.generate(5)
    assert second.tokens == hf_greedy(base, torch.tensor([prompt + first.tokens + [5, 6]]), 5)[0].tolist()
    session.rollback(len(prompt) + 1)
    assert session.generate(4).tokens == hf_greedy(base, torch.tensor([prompt + first.tokens[:1]]), 4)[0].tolist()
    logits = session.next_logits()
    with torch.no_grad():
        expected = base(torch.tensor([session.ids])).logits[0, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_lossless_session_matches_its_base_under_sampling(arch):
    """Same seed, same draws: a lossless streamed decoding session samples what its plain base samples
    one token at a time (the stream tree only decides how many draws a pass checks)."""
    model = streamed(arch, "lossless", seed=2)
    prompt = random_ids(1, 5, 7)[0].tolist()
    a = DecodingSession(model)
    a.extend(prompt)
    b = DecodingSession(model.hf_model)
    b.extend(prompt)
    sa = a.generate(10, Sampler(temperature=0.8, seed=3))
    sb = b.generate(10, Sampler(temperature=0.8, seed=3))
    assert sa.tokens == sb.tokens


def test_bad_use_is_refused():
    model = streamed("llama", "lossless")
    session = DecodingSession(model)
    with pytest.raises(ValueError, match="empty"):
        session.generate(3)
    session.extend([3, 4])
    with pytest.raises(ValueError, match="roll back"):
        session.rollback(5)
    with pytest.raises(ValueError, match="context"):
        session.generate(10_000)
    with pytest.raises(ValueError, match="no streams"):
        DecodingSession(model.hf_model, tree_top_k=3)


@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_forward_with_streams_at_last_is_what_decoding_computes(arch, mode):
    """model(ids, streams_at="last") gives decoding's next-token logits at the last position; the
    default (streams at every position) differs from it in shared mode, as documented."""
    model = streamed(arch, mode, seed=3)
    with torch.no_grad():  # make the stream identifiers large, so that streams matter to main rows
        model.streams.stream_embeddings.mul_(20)
    prompt = random_ids(1, 9, 8)
    session = DecodingSession(model)
    session.extend(prompt[0].tolist())
    decoded = session.next_logits()
    with torch.no_grad():
        last = model(prompt, streams_at="last").logits[0, -1].float()
        every = model(prompt).logits[0, -1].float()
    torch.testing.assert_close(last, decoded, rtol=1e-4, atol=1e-4)
    if mode == "shared":
        assert not torch.allclose(every, decoded, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(every, decoded, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="streams_at"):
        model(prompt, streams_at="first")
