"""Lookup drafts merged into the streams' drafts in vLLM (a drafter folder exported with
``--lookup MIN:MAX`` or ``--lookup suffix``).

Prompt lookup drafts for free what the text already holds (SQL copies the schema's names, code its
identifiers); the streams draft what it does not. Each step, for each request, the last n tokens
of the request's text (prompt, output and the token just sampled; n from MAX down to MIN) are
looked up earlier in that text; at the latest earlier occurrence, the tokens that followed it
replace the streams' first drafts, and the streams keep the positions the lookup does not reach.
A step whose text has no such n-gram keeps the streams' drafts. The drafter's pass runs as
before, so its cache stays complete.

``--lookup suffix`` looks the text's end up in suffix trees instead (suffix decoding,
arctic-inference's, which vLLM's ``"method": "suffix"`` drafter runs; `SuffixLookup`): the trees of
the request's prompt and output so far and, unless ``suffix:0``, of earlier requests' outputs
(the last ``suffix:N`` of them, vLLM's default 10,000). Its drafts continue the longest match while
the trees say the next token follows it often enough, and the streams keep the positions past them.

vLLM verifies lookup drafts as it verifies any drafter's: outputs stay exactly vLLM's. Drafts
replaced so are deterministic proposals, as vLLM's n-gram drafter's are; a drafter pass that
reports draft probabilities (sampling that uses them) keeps its own drafts unmerged.

`install_lookup_hook` wraps the model runner's ``propose_draft_token_ids`` (once a process, without
changing vLLM's files); `request_texts` reads each request's text there, and the drafter's
`lookup_source` (`PromptLookup` or `SuffixLookup`) finds each one's lookup drafts.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

# a file: a JSON line for each drafting request each step,
# {"text": [its ids], "drafts": [the step's drafts], "lookup": `lookup_name` of the folder's lookup}
LOOKUP_ENV = "STREAMSPEC_VLLM_LOOKUP_LOG"
LONGEST_NGRAM = 16


SUFFIX = "suffix"
# suffix decoding's settings (vLLM's defaults for its "suffix" method): the trees' depth (the
# longest match), the finished requests whose outputs stay in the global tree, drafts up to
# max_spec_factor x the match's length, and the least frequency of a drafted token after the match
SUFFIX_SETTINGS = {"max_tree_depth": 24, "max_cached_requests": 10000, "max_spec_factor": 1.0,
                   "min_token_prob": 0.1}
LOOKUP_FORMS = f"MIN:MAX n-gram lengths with 1 <= MIN <= MAX <= {LONGEST_NGRAM} (e.g. 2:4), or {SUFFIX}[:CACHED]"


def parse_lookup(value: str | list | tuple | dict | None) -> list[int] | dict | None:
    """The lookup a drafter folder merges: ``[min, max]`` n-gram lengths from ``"MIN:MAX"`` (or a
    pair), or suffix decoding's settings (`SUFFIX_SETTINGS` with ``"method": "suffix"``) from
    ``"suffix"``, ``"suffix:CACHED"`` (finished requests kept in the global tree; 0: none) or such
    a dict; None stays None. Raises naming the forms allowed (`LOOKUP_FORMS`)."""
    if value is None:
        return None
    if isinstance(value, dict) or (isinstance(value, str) and value.partition(":")[0] == SUFFIX):
        return _parse_suffix(value)
    try:
        pair = [int(x) for x in (value.split(":") if isinstance(value, str) else value)]
    except (TypeError, ValueError):
        pair = []
    if len(pair) != 2 or not 1 <= pair[0] <= pair[1] <= LONGEST_NGRAM:
        raise ValueError(f"lookup must be {LOOKUP_FORMS}, got {value!r}")
    return pair


def _parse_suffix(value: str | dict) -> dict:
    wrong = ValueError(f"lookup must be {LOOKUP_FORMS} (CACHED: the finished requests whose outputs suffix "
                       f"decoding keeps, an integer >= 0), got {value!r}")
    if isinstance(value, str):
        cached = value.partition(":")[2]
        settings = dict(SUFFIX_SETTINGS)
        if cached or value.endswith(":"):
            if not cached.isdigit():
                raise wrong
            settings["max_cached_requests"] = int(cached)
        return {"method": SUFFIX, **settings}
    if value.get("method") != SUFFIX or set(value) - {"method", *SUFFIX_SETTINGS}:
        raise wrong
    settings = {**SUFFIX_SETTINGS, **{k: v for k, v in value.items() if k != "method"}}
    ok = (all(isinstance(settings[k], int) and not isinstance(settings[k], bool)
              for k in ("max_tree_depth", "max_cached_requests"))
          and settings["max_tree_depth"] >= 1 and settings["max_cached_requests"] >= 0
          and all(isinstance(settings[k], (int, float)) and not isinstance(settings[k], bool)
                  for k in ("max_spec_factor", "min_token_prob"))
          and settings["max_spec_factor"] > 0 and 0 <= settings["min_token_prob"] <= 1)
    if not ok:
        raise ValueError(f"suffix lookup settings must be max_tree_depth >= 1, max_cached_requests >= 0 (integers), "
                         f"max_spec_factor > 0 and min_token_prob in [0, 1], got {value!r}")
    return {"method": SUFFIX, **settings}


def lookup_name(lookup: list | dict | None) -> str:
    """How a parsed lookup is written on the command line (``2:4``, ``suffix``, ``suffix:0``)."""
    if lookup is None:
        return "none"
    if isinstance(lookup, dict):
        cached = lookup["max_cached_requests"]
        return SUFFIX if cached == SUFFIX_SETTINGS["max_cached_requests"] else f"{SUFFIX}:{cached}"
    return f"{lookup[0]}:{lookup[1]}"


def lookup_drafts(text: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of `text`'s last n tokens, for
    the longest n in `max_n`..`min_n` that occurs earlier; empty when none does.

    One pass over the text finds where its last token occurred before (the ends of every earlier
    match); the matches are then lengthened a token at a time over those ends only, so a step
    costs one comparison per token of the text whatever MIN and MAX are."""
    text = np.asarray(text)
    size = len(text)
    ends = np.flatnonzero(text[:size - 1] == text[size - 1]) if size > 1 else text[:0]
    found = None
    for n in range(1, min(max_n, size - 1) + 1):
        if n > 1:  # the ends whose match reaches n tokens back: its start inside the text
            ends = ends[ends >= n - 1]
            ends = ends[text[ends - (n - 1)] == text[size - n]]
        if not ends.size:
            break
        if n >= min_n:
            found = int(ends[-1]) + 1
    return text[:0] if found is None else text[found:found + k]


def merge_lookup(drafts: Any, texts: list[np.ndarray | None], min_n: int, max_n: int) -> int:
    """Write each request's prompt-lookup drafts (`lookup_drafts` of its text; None: it drafts
    nothing this step) over the first of its streams' drafts, in place (`merge_drafts`)."""
    k = drafts.shape[1]
    return merge_drafts(drafts, [None if text is None else lookup_drafts(text, k, min_n, max_n) for text in texts])


def merge_drafts(drafts: Any, found: list[np.ndarray | None]) -> int:
    """Write each request's lookup drafts `found` over the first of its streams' drafts, in place
    (`drafts`: [requests, K] tensor; None or empty: the streams' drafts stay); returns how many
    requests took lookup drafts. The merged rows are built on the host and reach `drafts`' device
    in one copy."""
    import torch

    k = drafts.shape[1]
    taken = [i for i, f in enumerate(found) if f is not None and len(f)]
    if not taken:
        return 0
    # one host array, one copy: [request index | K lookup tokens | K keep-the-stream's-draft flags]
    packed = np.zeros((len(taken), 2 * k + 1), dtype=np.int64)
    packed[:, 0] = taken
    packed[:, k + 1:] = 1
    for row, i in enumerate(taken):
        size = min(len(found[i]), k)
        packed[row, 1:1 + size], packed[row, k + 1:k + 1 + size] = found[i][:size], 0
    packed = torch.as_tensor(packed).to(drafts.device)
    index = packed[:, 0]
    merged = torch.where(packed[:, k + 1:].bool(), drafts.index_select(0, index), packed[:, 1:k + 1].to(drafts.dtype))
    drafts.index_copy_(0, index, merged)
    return len(taken)


class PromptLookup:
    """Lookup drafts from the request's own text (`lookup_drafts`, n from `max_n` down to `min_n`)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def drafts(self, input_batch, texts: list[np.ndarray | None], k: int) -> list[np.ndarray | None]:
        return [None if text is None else lookup_drafts(text, k, self.min_n, self.max_n) for text in texts]


class SuffixLookup:
    """Lookup drafts from suffix decoding's trees (arctic-inference's ``SuffixDecodingCache``, the
    one vLLM's suffix drafter keeps; `SUFFIX_SETTINGS`): each request's tree is started from its
    prompt when it first drafts, given the tokens its text gained since the last step, and stopped
    when it leaves the batch (its output then joins the global tree, unless ``max_cached_requests``
    is 0). `cache`: a ``SuffixDecodingCache`` (default: a new one for the settings)."""

    def __init__(self, settings: dict, cache: Any = None):
        self.settings = settings
        if cache is None:
            try:
                from arctic_inference.suffix_decoding import SuffixDecodingCache
            except ImportError as err:
                raise RuntimeError("a drafter folder with suffix lookup (--lookup suffix) needs arctic-inference==0.3.0 "
                                   f"built into vLLM's environment: run `make vllm` ({err})") from None

            cache = SuffixDecodingCache(max_tree_depth=settings["max_tree_depth"],
                                        max_cached_requests=settings["max_cached_requests"])
        self.cache = cache
        self.known: dict[Any, int] = {}  # tokens of each active request's text the trees hold

    def drafts(self, input_batch, texts: list[np.ndarray | None], k: int) -> list[np.ndarray | None]:
        depth = self.settings["max_tree_depth"]
        found: list[np.ndarray | None] = []
        for i, text in enumerate(texts):
            if text is None:
                found.append(None)
                continue
            req_id = input_batch.req_ids[i]
            if req_id not in self.cache.active_requests:
                if req_id in self.cache.cached_requests:  # a request id seen before: its old output goes
                    self.cache.evict_cached_response(req_id)
                prompt = int(input_batch.num_prompt_tokens[i])
                self.cache.start_request(req_id, np.ascontiguousarray(text[:prompt], dtype=np.int32))
                self.known[req_id] = prompt
            new = text[self.known[req_id]:]
            if new.size:
                self.cache.add_active_response(req_id, np.ascontiguousarray(new, dtype=np.int32))
                self.known[req_id] = len(text)
            draft = self.cache.speculate(req_id, np.ascontiguousarray(text[-depth:], dtype=np.int32),
                                         max_spec_tokens=k, max_spec_factor=self.settings["max_spec_factor"],
                                         min_token_prob=self.settings["min_token_prob"])
            found.append(np.asarray(draft.token_ids, dtype=np.int64))
        running = set(input_batch.req_ids[:len(texts)])
        for req_id in set(self.cache.active_requests) - running:
            self.cache.stop_request(req_id)
            self.known.pop(req_id, None)
        return found


def lookup_source(lookup: list | dict) -> PromptLookup | SuffixLookup:
    """What finds the lookup drafts of a parsed `lookup` (`parse_lookup`)."""
    if isinstance(lookup, dict):
        return SuffixLookup(lookup)
    return PromptLookup(*lookup)


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
        known = input_batch.token_ids_cpu[i, :int(input_batch.num_tokens_no_spec[i])]  # a view: read this step only
        texts.append(known if appended else np.concatenate([known, new.astype(known.dtype)]))
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
        source = getattr(model, "lookup_source", None)
        if (source is None or getattr(self, "_draft_probs", None) is not None or not hasattr(drafts, "shape")
                or drafts.dim() != 2 or drafts.shape[1] == 0):
            return drafts
        texts = request_texts(self.input_batch, sampled_token_ids, drafts.shape[0])
        merge_drafts(drafts, source.drafts(self.input_batch, texts, drafts.shape[1]))
        log = os.environ.get(LOOKUP_ENV)
        if log:
            import json

            with open(log, "a", encoding="utf-8") as handle:
                name = lookup_name(model.lookup)
                for text, row in zip(texts, drafts.tolist()):
                    if text is not None:
                        handle.write(json.dumps({"text": text.tolist(), "drafts": row, "lookup": name}) + "\n")
        return drafts

    propose_draft_token_ids._streamspec_lookup = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
