"""Speculative streaming for a batch of prompts: the single best path per sequence.

Following the paper's batching appendix, a batch drops the tree: each sequence drafts one chain,
the argmax of each stream (γ tokens after the root). Sequences accept different lengths, so the
KV cache is not compacted; instead each row keeps a validity mask over its cached entries, and
rejected entries are masked out for good. Position ids count each row's real tokens only, so a
padded row decodes exactly as it would alone.
"""

from __future__ import annotations

import time

import torch

from .cache import MainStreamCache
from .decoding import _tree, _within_limits, accept_path
from .layout import causal, last_real_positions, main_allowed, position_ids_from_mask


@torch.no_grad()
def generate_batch(model, input_ids, attention_mask, max_new_tokens, sampler, stop, output_cls):
    """See `streamspec.decoding.generate`; returns an `output_cls` whose tokens are [B, n]
    (rows shorter than n padded with their last token's EOS, or 0) and `lengths` per row."""
    batch, length = input_ids.shape
    device = input_ids.device
    g = model.stream_config.num_streams
    cache = MainStreamCache(len(model.layers))
    key_real = attention_mask.bool()
    if not key_real.any(dim=1).all():
        raise ValueError("every row of attention_mask needs at least one real token")
    out = output_cls(tokens=input_ids.new_zeros(batch, 0), forward_passes=0)

    start = time.perf_counter()
    positions = position_ids_from_mask(key_real)
    main_ok = main_allowed(causal(length, device), key_real)
    last = last_real_positions(key_real)[:, None]
    lower = model.run_lower(input_ids, positions, main_ok, cache)
    main, streams = model.run_upper(lower, positions, main_ok, last, torch.ones_like(last, dtype=torch.bool), cache)
    roots = torch.stack([sampler(logits) for logits in model.head(main[torch.arange(batch), last[:, 0]])])
    drafts = model.head(streams[:, 0]).argmax(-1)  # [B, γ]
    chain_children = _tree((1,) * g).children()
    generated = [[root] for root in roots.clone().unbind()]  # a copy: `roots` is updated in place below
    lengths = key_real.sum(dim=1)  # the next position id of each row
    out.forward_passes, out.accepted_per_pass, out.seconds_per_pass = 1, [batch], [time.perf_counter() - start]

    ended = {b for b in range(batch) if int(roots[b]) in stop}

    def finished(b):
        return len(generated[b]) >= max_new_tokens or b in ended

    while not all(finished(b) for b in range(batch)):
        start = time.perf_counter()
        n = 1 + g
        chain = torch.cat([roots[:, None], drafts], dim=1)  # [B, 1+γ]
        positions = lengths[:, None] + torch.arange(n, device=device)
        key_real = torch.cat([key_real, torch.ones(batch, n, dtype=torch.bool, device=device)], dim=1)
        ok = main_allowed(causal(n, device), key_real)
        slots = torch.arange(n, device=device).expand(batch, n)
        lower = model.run_lower(chain, positions, ok, cache)
        main, streams = model.run_upper(lower, positions, ok, slots, torch.ones_like(slots, dtype=torch.bool), cache)
        # Every row's main logits in one LM-head call, the same walk as one sequence's on each
        # chain, then one call on the stream rows of each row's deepest accepted node.
        logits = model.head(main)  # [B, 1+γ, V]
        accepted_total = 0
        depths = []
        for b in range(batch):
            path, token = accept_path(chain_children, chain[b].tolist(), lambda node: sampler(logits[b, node]))
            depth = len(path) - 1
            depths.append(depth)
            if not finished(b):
                new = list(chain[b, 1 : depth + 1]) + [token]
                generated[b].extend(new)
                accepted_total += depth + 1
                if any(int(t) in stop for t in new):
                    ended.add(b)
            key_real[b, key_real.shape[1] - n + depth + 1 :] = False  # rejected drafts leave the cache for good
            lengths[b] += depth + 1
            roots[b] = token
        drafts = model.head(streams[torch.arange(batch), torch.tensor(depths, device=device)]).argmax(-1)
        out.forward_passes += 1
        out.accepted_per_pass.append(accepted_total)
        out.nodes_per_pass.append((batch * n, batch * n))
        out.seconds_per_pass.append(time.perf_counter() - start)

    results = [
        torch.tensor(_within_limits([int(t) for t in generated[b]], 0, max_new_tokens, stop), dtype=input_ids.dtype,
                     device=device)
        for b in range(batch)
    ]
    out.lengths = [len(r) for r in results]
    width = max(out.lengths)
    fill = min(stop) if stop else 0
    out.tokens = torch.stack([torch.cat([r, r.new_full((width - len(r),), fill)]) for r in results])
    return out
