"""The MSA layers with a KV cache: only main-stream entries are stored, and feeding a sequence
in pieces through the cache gives what one full forward gives."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.decoding.cache import MainStreamCache
from streamspec.patch.layout import causal, main_allowed, stream_slots


def _pieces_forward(model, ids, cut):
    """Feed ids[:, :cut] then ids[:, cut:] through the cache; every new position carries streams."""
    cache = MainStreamCache(len(model.layers))
    outs = []
    for start, stop in ((0, cut), (cut, ids.shape[1])):
        new = ids[:, start:stop]
        n = new.shape[1]
        pos = torch.arange(start, stop)[None].expand(ids.shape[0], -1)
        key_real = torch.ones(ids.shape[0], stop, dtype=torch.bool)
        main_ok = main_allowed(causal(n), key_real)
        index, valid = stream_slots(torch.ones_like(new, dtype=torch.bool))
        lower = model.run_lower(new, pos, main_ok, cache)
        main, streams = model.run_upper(lower, pos, main_ok, index, valid, cache)
        outs.append((model.head(main), model.head(streams)))
        assert all(k.shape[-2] == stop for k in cache.keys), "the cache must hold main positions only"
    return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_cached_pieces_equal_full_forward(arch, mode):
    model = add_streams(make_model(arch), StreamConfig(stream_layers=2, mode=mode)).eval()
    with torch.no_grad():
        model.streams.stream_embeddings.normal_()
    ids = random_ids(2, 11, seed=7)
    with torch.no_grad():
        full = model(ids)
        logits, stream_logits = _pieces_forward(model, ids, cut=6)
    torch.testing.assert_close(logits, full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stream_logits, full.stream_logits, rtol=1e-5, atol=1e-5)
