"""Lookup drafts merged into the streams' drafts in vLLM (a drafter folder exported with
``--lookup MIN:MAX``).

Prompt lookup drafts for free what the text already holds (SQL copies the schema's names, code its
identifiers); the streams draft what it does not. Each step, for each request, the last n tokens
of the request's text (prompt, output and the token just sampled; n from MAX down to MIN) are
looked up earlier in that text; at the latest earlier occurrence, the tokens that followed it
replace the streams' first drafts, and the streams keep the positions the lookup does not reach.
A step whose text has no such n-gram keeps the streams' drafts. The drafter's pass runs as
before, so its cache stays complete.

vLLM verifies lookup drafts as it verifies any drafter's: outputs stay exactly vLLM's. Drafts
replaced so are deterministic proposals, as vLLM's n-gram drafter's are; a drafter pass that
reports draft probabilities (sampling that uses them) keeps its own drafts unmerged.

`install_lookup_hook` wraps the model runner's ``propose_draft_token_ids`` (once a process, without
changing vLLM's files); `request_texts` reads each request's text there.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

# a file: a JSON line for each drafting request each step, {"text": [its ids], "drafts": [the step's drafts]}
LOOKUP_ENV = "STREAMSPEC_VLLM_LOOKUP_LOG"
LONGEST_NGRAM = 16


def parse_lookup(value: str | list | tuple | None) -> list[int] | None:
    """``[min, max]`` n-gram lengths from ``"MIN:MAX"`` (or a pair); None stays None. Raises
    naming what is allowed: 1 <= MIN <= MAX <= `LONGEST_NGRAM`."""
    if value is None:
        return None
    try:
        pair = [int(x) for x in (value.split(":") if isinstance(value, str) else value)]
    except (TypeError, ValueError):
        pair = []
    if len(pair) != 2 or not 1 <= pair[0] <= pair[1] <= LONGEST_NGRAM:
        raise ValueError(f"lookup must be MIN:MAX n-gram lengths with 1 <= MIN <= MAX <= {LONGEST_NGRAM} "
                         f"(e.g. 2:4), got {value!r}")
    return pair


def lookup_drafts(text: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of `text`'s last n tokens, for
    the longest n in `max_n`..`min_n` that occurs earlier; empty when none does."""
    text = np.asarray(text)
    size = len(text)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows that start early enough to be followed by at least one token of the text
        windows = np.lib.stride_tricks.sliding_window_view(text[:size - 1], n)
        hits = np.flatnonzero((windows == text[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return text[start:start + k]
    return text[:0]


def merge_lookup(drafts: Any, texts: list[np.ndarray | None], min_n: int, max_n: int) -> int:
    """Write each request's lookup drafts over the first of its streams' drafts, in place
    (`drafts`: [requests, K] tensor; `texts`: each request's text, None where it drafts nothing
    this step); returns how many requests took lookup drafts. The merged rows are built on the host
    and reach `drafts`' device in one copy."""
    import torch

    k = drafts.shape[1]
    found = [None if text is None else lookup_drafts(text, k, min_n, max_n) for text in texts]
    taken = [i for i, f in enumerate(found) if f is not None and f.size]
    if not taken:
        return 0
    # one host array, one copy: [request index | K lookup tokens | K keep-the-stream's-draft flags]
    packed = np.zeros((len(taken), 2 * k + 1), dtype=np.int64)
    packed[:, 0] = taken
    packed[:, k + 1:] = 1
    for row, i in enumerate(taken):
        packed[row, 1:1 + found[i].size], packed[row, k + 1:k + 1 + found[i].size] = found[i], 0
    packed = torch.as_tensor(packed).to(drafts.device)
    index = packed[:, 0]
    merged = torch.where(packed[:, k + 1:].bool(), drafts.index_select(0, index), packed[:, 1:k + 1].to(drafts.dtype))
    drafts.index_copy_(0, index, merged)
    return len(taken)


def request_texts(input_batch, sampled_token_ids, requests: int) -> list[np.ndarray | None]:
    """Each request's text as the step leaves it (None: it drafts nothing this step, e.g. it is
    still reading its prompt). vLLM hands the step's sampled tokens either as a tensor, ``[requests,
    K+1]`` with -1 where rejected, before the runner appends them to its token copy (the default,
    padded drafter batch), or as lists, after it has (``disable_padded_drafter_batch``): the text
    is the copy's tokens plus the valid sampled ones in the first case, the copy alone in the second."""
    appended = not hasattr(sampled_token_ids, "cpu")
    sampled = sampled_token_ids if appended else sampled_token_ids.cpu().numpy()
    texts: list[np.ndarray | None] = []
    for i in range(requests):
        new = np.asarray(sampled[i], dtype=np.int64) if i < len(sampled) else np.empty(0, dtype=np.int64)
        new = new[new >= 0]
        if new.size == 0:
            texts.append(None)
            continue
        known = input_batch.token_ids_cpu[i, :int(input_batch.num_tokens_no_spec[i])].astype(np.int64)
        texts.append(known if appended else np.concatenate([known, new]))
    return texts


def install_lookup_hook() -> None:
    """Wrap vLLM's model runner's ``propose_draft_token_ids`` once per process (see the module
    docstring); drafters without lookup pass through unchanged."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "_streamspec_lookup", False):
        return

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts = original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        model = getattr(getattr(self, "drafter", None), "model", None)
        model = model.unwrap() if hasattr(model, "unwrap") else model
        lookup = getattr(model, "lookup", None)
        if (lookup is None or getattr(self, "_draft_probs", None) is not None or not hasattr(drafts, "shape")
                or drafts.dim() != 2 or drafts.shape[1] == 0):
            return drafts
        texts = request_texts(self.input_batch, sampled_token_ids, drafts.shape[0])
        merge_lookup(drafts, texts, *lookup)
        log = os.environ.get(LOOKUP_ENV)
        if log:
            import json

            with open(log, "a", encoding="utf-8") as handle:
                for text, row in zip(texts, drafts.tolist()):
                    if text is not None:
                        handle.write(json.dumps({"text": text.tolist(), "drafts": row}) + "\n")
        return drafts

    propose_draft_token_ids._streamspec_lookup = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
