"""Speculative streaming for a batch of prompts: the single best path per sequence.

Following the paper's batching appendix, a batch drops the tree: each sequence drafts one chain,
the argmax of each stream (γ tokens after the root). Sequences accept different lengths; each row
keeps its own entries contiguous in a `RowCache` and writes the next pass's entries right after
the ones it accepted, so rejected drafts are overwritten rather than kept masked. Position ids
count each row's real tokens only, so a padded row decodes exactly as it would alone.

A pass runs on the device from the chains to the next ones; the host reads one [B, 2+γ] matrix
per pass (each row's accepted count and tokens) to know which rows have ended.
"""

from __future__ import annotations

import time

import torch

from .cache import RowCache
from .output import _within_limits, read_to_host
from .verify import chain_verify
from ..patch.layout import causal, last_real_positions, main_allowed, position_ids_from_mask, row_allowed


@torch.no_grad()
def generate_batch(model, input_ids, attention_mask, max_new_tokens, sampler, stop, output_cls, fuse_head: bool = True,
                   compile_backend: str | None = None):
    """See `streamspec.decoding.generate`; returns an `output_cls` whose tokens are [B, n]
    (rows shorter than n padded with their last token's EOS, or 0) and `lengths` per row.

    With `fuse_head`, a pass makes one LM-head call over every row's chain and stream rows (the
    fewest calls: what suits an accelerator); without, two calls, the second over each row's
    accepted node's stream rows only (the fewest rows: what suits a CPU, where every call reads
    the whole LM-head weight from memory).

    With `compile_backend`, every pass after the prefill is one compiled `batch_pass` call
    (`streamspec.decoding.compiled`: static shapes over the whole cache buffers, one graph per
    model, batch size, sampler settings and cache capacity); the tokens equal the uncompiled
    loop's (greedy; sampled with the same seed) up to the compiled kernels' float rounding."""
    batch, length = input_ids.shape
    device = input_ids.device
    g = model.num_drafts
    n = 1 + g
    # A row stores at most n entries per pass and passes stop once every row has max_new_tokens.
    if compile_backend is not None:
        from .graphs import compiled_capacity

        # one graph for the whole generation: the buffers never grow (a multiple of 256 entries,
        # so prompts of similar lengths share it)
        capacity = compiled_capacity(length + max_new_tokens, 2 * n)
    else:
        capacity = length + max_new_tokens + 2 * n
    cache = RowCache(len(model.layers), capacity=capacity)
    prompt_real = attention_mask.bool()
    if not prompt_real.any(dim=1).all():
        raise ValueError("every row of attention_mask needs at least one real token")
    out = output_cls(tokens=input_ids.new_zeros(batch, 0), forward_passes=0)
    rows = torch.arange(batch, device=device)
    steps = torch.arange(n, device=device)

    start = time.perf_counter()
    positions = position_ids_from_mask(prompt_real)
    main_ok = main_allowed(causal(length, device), prompt_real)
    last = last_real_positions(prompt_real)[:, None]
    main, streams = model.step(input_ids, positions, main_ok, last, cache)
    # One LM-head call: each row's main row at its last position and its stream rows.
    logits = model.head(torch.cat([main[rows, last[:, 0]][:, None], streams[:, 0]], dim=1))  # [B, 1+γ, V]
    next_position = prompt_real.sum(dim=1)  # [B] each row's next position id
    roots = sampler(logits[:, 0], next_position, rows)  # [B]
    drafts = logits[:, 1:].argmax(-1)  # [B, γ]
    cache.advance(torch.full((batch,), length, device=device), length)
    widths = [length] * batch  # each row's stored entries, as the host knows them
    generated = [[t] for t in read_to_host(roots)]
    out.forward_passes, out.accepted_per_pass, out.seconds_per_pass = 1, [batch], [time.perf_counter() - start]

    ended = {b for b in range(batch) if generated[b][0] in stop}

    def finished(b):
        return len(generated[b]) >= max_new_tokens or b in ended

    compiled = None
    if compile_backend is not None:
        from .compiled import _compiled_batch_pass
        from .graphs import CompileNotice as _CompileNotice, checked_once as _checked_once, graph_key as _graph_key

        compiled = _compiled_batch_pass(compile_backend, device.type)
        key = torch.tensor(0 if sampler.greedy else sampler.key(), dtype=torch.long, device=device)
        capacity = cache.capacity
        key_real = torch.cat([prompt_real, prompt_real.new_ones(batch, capacity - length)], dim=1)  # [B, C]
        graph = _graph_key(model, ("batch", batch, g, fuse_head), capacity, sampler, compile_backend)
        what = f"a batch of {batch}, chains of {n}, cache of {capacity}"
    checked = False
    live_rows, live = None, None
    # (the other compiled loops' limit: a process may hold a graph per batch size and capacity)
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        while not all(finished(b) for b in range(batch)):
            start = time.perf_counter()
            # Rows that have ended stop storing entries (their passes are discarded); a host-to-
            # device copy, not a read, made again only when a row has ended.
            rows_now = tuple(not finished(b) for b in range(batch))
            if rows_now != live_rows:
                live_rows, live = rows_now, torch.tensor(rows_now, device=device)
            if compiled is not None:
                with _CompileNotice(graph, what), _checked_once(checked):
                    summary, roots, drafts, row_lengths, next_position = compiled(
                        model, *cache.buffers, cache.row_lengths, key_real, roots, drafts, next_position, live, sampler,
                        key, fuse_head)
                checked = True
            else:
                chain = torch.cat([roots[:, None], drafts], dim=1)  # [B, 1+γ]
                positions = next_position[:, None] + steps
                ok = row_allowed(prompt_real, cache.row_lengths, cache.width, n)
                main, streams = model.step(chain, positions, ok, steps.expand(batch, n), cache)
                summary, roots, drafts = chain_verify(model, main, streams, chain, positions, sampler, None, fuse_head)
                stored = (summary[:, 0] + 1) * live
                next_position = next_position + stored
            summary = read_to_host(summary)
            accepted_total = 0
            for b, (d, *tokens) in enumerate(summary):
                if not finished(b):
                    widths[b] += d + 1
                    accepted = tokens[: d + 1]
                    generated[b].extend(accepted)
                    accepted_total += d + 1
                    if any(t in stop for t in accepted):
                        ended.add(b)
            if compiled is not None:
                cache.count_rows(row_lengths, max(widths))
            else:
                cache.advance(stored, max(widths))
            out.forward_passes += 1
            out.accepted_per_pass.append(accepted_total)
            out.nodes_per_pass.append((batch * n, batch * n))
            out.seconds_per_pass.append(time.perf_counter() - start)

    results = [
        torch.tensor(_within_limits(generated[b], 0, max_new_tokens, stop), dtype=input_ids.dtype, device=device)
        for b in range(batch)
    ]
    out.lengths = [len(r) for r in results]
    width = max(out.lengths)
    fill = min(stop) if stop else 0
    out.tokens = torch.stack([torch.cat([r, r.new_full((width - len(r),), fill)]) for r in results])
    return out
