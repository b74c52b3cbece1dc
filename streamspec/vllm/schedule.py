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


def check_schedule(schedule: Iterable | None, num_speculative_tokens: int, num_streams: int) -> None:
    """Raise naming what is wrong when a schedule asks the streams drafter for drafts it cannot
    give: each entry's K must be 0 (no speculation at that batch size) or 2..`num_speculative_tokens`
    (at most γ+1). vLLM checks the ranges themselves."""
    if not schedule:
        return
    allowed = f"0 (no speculation) or 2..{num_speculative_tokens}"
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"{SCHEDULE_KEY} entries must be [first_batch_size, last_batch_size, K], got {entry!r}")
        k = int(entry[2])
        if k == 1:
            raise ValueError(f"{SCHEDULE_KEY} entry {list(entry)} asks the streams drafter for 1 draft: vLLM samples "
                             f"it from the row whose main output is the token just sampled (a filler); use {allowed}")
        if k < 0 or k > num_speculative_tokens:
            raise ValueError(f"{SCHEDULE_KEY} entry {list(entry)}: K must be {allowed} (num_speculative_tokens is "
                             f"{num_speculative_tokens}; streams with γ = {num_streams} draft at most {num_streams + 1})")


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
    """Wrap vLLM's EAGLE proposer's ``propose`` once per process (see the module docstring); other
    drafters' calls pass through unchanged."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    if getattr(EagleProposer.propose, "_streamspec_schedule", False):
        return
    original = EagleProposer.propose

    @functools.wraps(original)
    def propose(self, num_speculative_tokens, *args, **kwargs):
        model = getattr(self, "model", None)
        model = model.unwrap() if hasattr(model, "unwrap") else model
        if (not getattr(model, "drafts_by_batch_size", False) or not self.parallel_drafting
                or num_speculative_tokens == self.speculative_config.num_speculative_tokens):
            return original(self, num_speculative_tokens, *args, **kwargs)
        if num_speculative_tokens == 0 and model.zero_drafts == "skip":
            import torch

            self._last_draft_probs = None
            metadata = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[5]
            return torch.empty(metadata.batch_size(), 0, dtype=torch.int64, device=self.device)
        saved = (self.extra_slots_per_request, self.net_num_new_slots_per_request, self.needs_extra_input_slots)
        (self.extra_slots_per_request, self.net_num_new_slots_per_request,
         self.needs_extra_input_slots) = _slots(int(num_speculative_tokens))
        try:
            return original(self, num_speculative_tokens, *args, **kwargs)
        finally:
            (self.extra_slots_per_request, self.net_num_new_slots_per_request, self.needs_extra_input_slots) = saved

    propose._streamspec_schedule = True
    EagleProposer.propose = propose
