"""Autoregressive decoding of streamed models (the reference for speculative decoding), and the
SQL quality metrics."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, hf_greedy, make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding import generate_autoregressive
from streamspec.evaluation.metrics import extract_sql, normalize_sql, sql_exact_match, sql_is_valid

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lossless_greedy_equals_transformers_generate(arch, seed):
    base = make_model(arch, seed=seed)
    model = add_streams(base, StreamConfig(stream_layers=2, mode="lossless")).eval()
    prompt = random_ids(1, 3 + 4 * seed, seed=seed)
    ours = generate_autoregressive(model, prompt, max_new_tokens=12)
    assert torch.equal(ours, hf_greedy(base, prompt, 12))


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_greedy_equals_full_forward_with_the_carrying_rule(arch):
    """Each generated token equals the argmax of one full forward over prompt + generated tokens in
    which, as in training, the last prompt position and every generated position carry streams."""
    torch.manual_seed(5)
    model = add_streams(make_model(arch, seed=3), StreamConfig(stream_layers=2)).eval()
    with torch.no_grad():
        model.streams.stream_embeddings.normal_()
    prompt = random_ids(1, 6, seed=9)
    ours = generate_autoregressive(model, prompt, max_new_tokens=8)
    tokens = prompt
    for step in range(ours.shape[1]):
        # A trailing dummy token lets labels mark the current last position as carrying streams.
        ids = torch.cat([tokens, torch.zeros(1, 1, dtype=torch.long)], dim=1)
        labels = ids.clone()
        labels[:, : prompt.shape[1]] = -100
        with torch.no_grad():
            logits = model(ids, labels=labels, return_logits=True).logits
        expected = logits[:, -2].argmax(-1, keepdim=True)
        assert torch.equal(ours[:, step : step + 1], expected), step
        tokens = torch.cat([tokens, expected], dim=1)


def test_eos_and_max_new_tokens_are_honoured():
    model = add_streams(make_model("llama"), StreamConfig(stream_layers=2, mode="lossless")).eval()
    prompt = random_ids(1, 5, seed=4)
    free = generate_autoregressive(model, prompt, max_new_tokens=10)
    assert free.shape == (1, 10)
    eos = int(free[0, 3])
    stopped = generate_autoregressive(model, prompt, max_new_tokens=10, eos_token_id=eos)
    first = int((free[0] == eos).nonzero()[0])
    assert torch.equal(stopped, free[:, : first + 1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_autoregressive(model, prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="input_ids"):
        generate_autoregressive(model, prompt[:, :0], max_new_tokens=3)
    with pytest.raises(TypeError, match="StreamedModel"):
        generate_autoregressive(make_model("llama"), prompt, max_new_tokens=3)


def test_sql_metrics():
    schema = 'CREATE TABLE "singer" ("Singer_ID" INTEGER, "Name" TEXT, "Age" INTEGER);'
    gold = "SELECT count(*) FROM singer"
    assert sql_exact_match("select COUNT(*)  from singer;", gold.upper().replace("COUNT", "count"))
    assert sql_exact_match("```sql\nSELECT count(*) FROM singer\n```\nThis counts singers.", gold)
    assert not sql_exact_match("SELECT count(*) FROM singer WHERE Age > 3", gold)
    assert normalize_sql("SELECT name FROM singer WHERE name = \"Joe\"") == normalize_sql("select name from singer where name='joe'")
    assert extract_sql("SELECT 1; SELECT 2") == "SELECT 1"
    assert sql_is_valid("SELECT Name FROM singer WHERE Age > 30", schema)
    assert not sql_is_valid("SELECT Height FROM singer", schema)
    assert not sql_is_valid("We have 11 singers.", schema)
