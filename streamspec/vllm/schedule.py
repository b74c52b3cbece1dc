"""Drafts by batch size (vLLM's ``num_speculative_tokens_per_batch_size``) for the streams drafter.

vLLM's scheduler looks the number of drafts a step, K', up in the schedule by the number of
requests it runs (``vllm/v1/core/sched/scheduler.py``), and hands K' to the proposer's
``propose``. Its parallel-drafting path (P-EAGLE, the one the streams drafter runs in) sizes the
drafter's rows once, at start-up, for K = ``num_speculative_tokens``: K slots per request (the row at
the last accepted position p and K−1 mask rows), K sampled rows per request, and then views the
sampled tokens as ``[-1, K']``. In vLLM 0.32:

- K' = K: as without a schedule.
- 0 < K' < K: the K·batch sampled tokens do not fit ``[batch, K']``: the view fails (K' not
  dividing K·batch) or yields K/K' rows per request, and the runner's copy of the drafts fails
  (``_copy_draft_token_ids_to_cpu``: size of tensor a (batch) must match b (K·batch/K')). Either
  way the engine stops.
- K' = 0: works (no drafts; the proposer still runs the whole K-slot drafter pass and returns an
  empty draft), so a step without speculation still pays for a full draft pass.

`install_proposer_hook` wraps vLLM's EAGLE proposer's ``propose`` (without changing vLLM's files)
so that, for the streams drafter only, each call runs with the slots of the step's K':

- K' ≥ 2: K' slots (the row at p and K'−1 mask rows): the same rows, drafts and cache writes as a
  drafter started with ``num_speculative_tokens`` = K'.
- K' = 0, ``STREAMSPEC_VLLM_ZERO_DRAFTS=skip`` (the default): no drafter pass at all, so a step
  without speculation costs what it costs vLLM without a drafter. The drafter's cache then lacks
  the rows of the positions decoded so (the prompt too, when its prefill step had K' = 0): a
  request that drafts again later attends to those gaps (its main rows there predict the sampled
  token less often, the measure of the alignment check), and its outputs stay exact.
- K' = 0, ``STREAMSPEC_VLLM_ZERO_DRAFTS=cache``: one slot, vLLM's plain EAGLE layout: the accepted
  rows only (all main rows), which write the drafter's cache for the positions the target just
  accepted, so later drafts attend to a complete cache. No mask rows and no LM head, but still a
  pass of the Ns layers and the proposer's bookkeeping (about 15% of a SmolLM2-135M step here).

K' = 1 is refused (`check_schedule`): vLLM asks that one draft of the row at p, whose main output
is the token just sampled, so it would draft a filler every step.

The DFlash layout (`streamspec.vllm.dflash`, the default) needs no resizing: vLLM's DFlash
proposer sizes its query rows (the bonus row and K' mask rows a request) from each call's K'
itself, so 1..γ drafts a step all draft from streams; the hook tells the drafter the step's K'
(its rows a request) and, at K' = 0, skips the drafter as above (``cache``: the context rows'
keys and values are written and one query row a request runs).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
ZERO_DRAFTS_ENV = "STREAMSPEC_VLLM_ZERO_DRAFTS"
ZERO_DRAFTS = ("skip", "cache")


def zero_drafts_mode() -> str:
    """What a step with K' = 0 does (`ZERO_DRAFTS_ENV`; see the module docstring)."""
    mode = os.environ.get(ZERO_DRAFTS_ENV, "skip") or "skip"
    if mode not in ZERO_DRAFTS:
        raise ValueError(f"${ZERO_DRAFTS_ENV} must be one of {', '.join(ZERO_DRAFTS)}, got {mode!r}")
    return mode


def check_schedule(schedule: Iterable | None, num_speculative_tokens: int, num_streams: int, least: int = 2) -> None:
    """Raise naming what is wrong when a schedule asks the streams drafter for drafts it cannot
    give: each entry's K must be 0 (no speculation at that batch size) or `least`..
    `num_speculative_tokens` (the P-EAGLE layout: 2..γ+1; the DFlash layout: 1..γ). vLLM checks
    the ranges themselves."""
    if not schedule:
        return
    allowed = f"0 (no speculation) or {least}..{num_speculative_tokens}"
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"{SCHEDULE_KEY} entries must be [first_batch_size, last_batch_size, K], got {entry!r}")
        k = int(entry[2])
        if 0 < k < least:
            raise ValueError(f"{SCHEDULE_KEY} entry {list(entry)} asks the streams drafter for {k} draft(s): in this "
                             "layout vLLM samples draft 1 from the row whose main output is the token just sampled "
                             f"(a filler); use {allowed}")
        if k < 0 or k > num_speculative_tokens:
            raise ValueError(f"{SCHEDULE_KEY} entry {list(entry)}: K must be {allowed} (num_speculative_tokens is "
                             f"{num_speculative_tokens}, for streams with γ = {num_streams})")


def load_schedule(path: str) -> list[list[int]]:
    """A schedule from a file: the ``--speculative-config`` JSON `streamspec vllm-calibrate` writes
    (its `SCHEDULE_KEY`), or the bare list ``[[first, last, K], ...]``; raises naming what is wrong."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"schedule file {path}: no such file (write one with `streamspec vllm-calibrate`)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"schedule file {path} is not JSON ({err})") from None
    schedule = data.get(SCHEDULE_KEY) if isinstance(data, dict) else data
    ok = isinstance(schedule, list) and schedule and all(
        isinstance(e, list) and len(e) == 3 and all(isinstance(x, int) for x in e) and 1 <= e[0] <= e[1] and e[2] >= 0
        for e in schedule)
    if not ok or schedule[0][0] != 1:
        raise ValueError(f"schedule file {path}: expected {SCHEDULE_KEY} as [[first batch size, last, K], ...] with "
                         "integer sizes from 1 and K >= 0 (or a speculative config holding it)")
    return [list(e) for e in schedule]


def _slots(k: int) -> tuple[int, int, bool]:
    """The proposer's per-request slot sizing for K' = `k`: (slots, new slots, any new); K' = 0
    (cache mode) gets one slot: the accepted rows, no mask rows."""
    slots = max(k, 1)
    return slots, slots - 1, slots > 1


def install_proposer_hook() -> None:
    """Wrap the ``propose`` of vLLM's EAGLE and DFlash proposers once per process (see the module
    docstring); other drafters' calls pass through unchanged."""
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.eagle import EagleProposer

    _wrap(EagleProposer, resize_slots=True)
    # DFlash sizes its query rows from each call's K' itself: the drafter only needs to know K'
    _wrap(DFlashProposer, resize_slots=False)


def _wrap(proposer_class, resize_slots: bool) -> None:
    if getattr(proposer_class.propose, "_streamspec_schedule", False):
        return
    original = proposer_class.propose

    @functools.wraps(original)
    def propose(self, num_speculative_tokens, *args, **kwargs):
        model = getattr(self, "model", None)
        model = model.unwrap() if hasattr(model, "unwrap") else model
        if not getattr(model, "drafts_by_batch_size", False) or not self.parallel_drafting:
            return original(self, num_speculative_tokens, *args, **kwargs)
        model.step_drafts = int(num_speculative_tokens)  # this step's K' (the DFlash layout's rows a request)
        try:
            return _scheduled(original, self, model, int(num_speculative_tokens), args, kwargs, resize_slots)
        finally:
            model.step_drafts = None  # a pass outside a step (vLLM's dummy runs) has the configured K

    propose._streamspec_schedule = True
    proposer_class.propose = propose


def _scheduled(original, proposer, model, k: int, args, kwargs, resize_slots: bool):
    """One ``propose`` call at K' = `k` for the streams drafter (see the module docstring)."""
    if k == proposer.speculative_config.num_speculative_tokens:
        return original(proposer, k, *args, **kwargs)
    if k == 0 and model.zero_drafts == "skip":
        import torch

        proposer._last_draft_probs = None
        metadata = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[5]
        return torch.empty(metadata.batch_size(), 0, dtype=torch.int64, device=proposer.device)
    if not resize_slots:
        return original(proposer, k, *args, **kwargs)
    saved = (proposer.extra_slots_per_request, proposer.net_num_new_slots_per_request, proposer.needs_extra_input_slots)
    (proposer.extra_slots_per_request, proposer.net_num_new_slots_per_request,
     proposer.needs_extra_input_slots) = _slots(k)
    try:
        return original(proposer, k, *args, **kwargs)
    finally:
        (proposer.extra_slots_per_request, proposer.net_num_new_slots_per_request,
         proposer.needs_extra_input_slots) = saved
