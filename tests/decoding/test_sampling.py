"""Sampling is lossless: speculative sampling draws from the same distribution as one-token-per-
pass sampling, checked against the exact distribution of the first two tokens on a tiny vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamspec import StreamConfig, add_streams
from streamspec.decoding import Sampler, generate

VOCAB = 6
SAMPLES = 1500
# TV(empirical, exact) over m outcomes from n draws: E[TV] <= 0.5·sqrt(m/n) (Cauchy-Schwarz), and
# one draw moves TV by at most 1/n, so P(TV > E + t) <= exp(-2·n·t²) (McDiarmid).
MARGIN = 0.05  # exp(-2 · 1500 · 0.05²) ≈ 6e-4
BOUND = 0.5 * math.sqrt(VOCAB**2 / SAMPLES) + MARGIN


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False)
    base = LlamaForCausalLM(config)
    base.config._attn_implementation = "sdpa"
    with torch.no_grad():
        base.lm_head.weight.mul_(8.0)  # peaked distributions, so that a wrong sampler is detectable
    model = add_streams(base.eval(), StreamConfig(num_streams=2, stream_layers=2)).eval()
    with torch.no_grad():
        model.streams.stream_embeddings.normal_(std=2.0)
    return model


def _exact(model, prompt, sampler):
    """P(x1, x2): x1 from the last prompt position, x2 after it, both carrying streams."""
    def last_probs(ids):
        ids = torch.cat([ids, torch.zeros(1, 1, dtype=torch.long)], dim=1)  # dummy: makes the last real position carry
        labels = ids.clone()
        labels[:, : prompt.shape[1]] = -100
        with torch.no_grad():
            return sampler.probs(model(ids, labels=labels, return_logits=True).logits[0, -2])

    first = last_probs(prompt)
    table = {}
    for x1 in range(VOCAB):
        second = last_probs(torch.cat([prompt, torch.tensor([[x1]])], dim=1))
        for x2 in range(VOCAB):
            table[(x1, x2)] = float(first[x1] * second[x2])
    return table


def _tv(counts, exact):
    return 0.5 * sum(abs(counts.get(k, 0) / SAMPLES - p) for k, p in exact.items())


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, None), (0.8, 0.9, 4)])
def test_speculative_sampling_matches_the_exact_distribution(tiny, temperature, top_p, top_k):
    prompt = torch.tensor([[1, 4, 2]])
    exact = _exact(tiny, prompt, Sampler(temperature, top_p, top_k))
    assert abs(sum(exact.values()) - 1) < 1e-5
    results = {}
    for speculative in (True, False):
        counts, accepted_drafts = {}, 0
        for seed in range(SAMPLES):
            out = generate(tiny, prompt, 2, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           tree_top_k=2, speculative=speculative)
            key = tuple(out.tokens[0].tolist())
            counts[key] = counts.get(key, 0) + 1
            accepted_drafts += int(max(out.accepted_per_pass) > 1)
        results[speculative] = (_tv(counts, exact), accepted_drafts)
    for speculative, (tv, _) in results.items():
        assert tv < BOUND, (speculative, tv, BOUND)
    assert results[True][1] > SAMPLES // 10, "the speculative runs must accept drafted tokens, or nothing was tested"
    # The test has power: a wrong temperature gives a distribution the bound tells apart.
    wrong = _exact(tiny, prompt, Sampler(temperature * 1.6, top_p, top_k))
    assert 0.5 * sum(abs(wrong[k] - exact[k]) for k in exact) > BOUND


def test_same_seed_same_output(tiny):
    prompt = torch.tensor([[2, 3]])
    outs = [generate(tiny, prompt, 12, temperature=1.0, seed=7).tokens for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    others = {tuple(generate(tiny, prompt, 12, temperature=1.0, seed=s).tokens[0].tolist()) for s in range(8)}
    assert len(others) > 1


@pytest.mark.parametrize("tree", [1, (2, 1), 3])
def test_seeded_speculative_sampling_returns_the_one_token_per_pass_tokens(tiny, tree):
    """Draws are keyed by the token's index, so the drafts change how many tokens a pass keeps,
    never which: same seed, same tokens as one token per pass, and a batch's first row too."""
    prompt = torch.tensor([[2, 3, 1]])
    accepted = 0
    for seed in range(12):
        kwargs = dict(temperature=0.9, top_p=0.95, seed=seed)
        reference = generate(tiny, prompt, 14, speculative=False, **kwargs).tokens
        out = generate(tiny, prompt, 14, tree_top_k=tree, **kwargs)
        assert torch.equal(out.tokens, reference), seed
        accepted += sum(n - 1 for n in out.accepted_per_pass)
        batch = generate(tiny, torch.cat([prompt, torch.tensor([[4, 4, 1]])]), 14, **kwargs)
        assert batch.tokens[0, : batch.lengths[0]].tolist() == reference[0].tolist()
    assert accepted > 10, "drafts must be accepted, or the property was not exercised"


def test_sampler_validates_and_warps():
    with pytest.raises(ValueError, match="temperature"):
        Sampler(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampler(temperature=1, top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        Sampler(temperature=1, top_k=0)
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    probs = Sampler(temperature=1.0, top_k=2).probs(logits)
    assert probs[2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    nucleus = Sampler(temperature=1.0, top_p=float(full[0]) + 1e-4).probs(logits)
    assert nucleus[0] > 0 and nucleus[1] > 0 and nucleus[2:].sum() == 0
