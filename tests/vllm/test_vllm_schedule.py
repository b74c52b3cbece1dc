"""Drafts by batch size (vLLM's ``num_speculative_tokens_per_batch_size``) with the streams drafter,
in vLLM itself: a schedule with K' = 0 and 0 < K' < K entries decodes exactly as vLLM without
speculation, its drafts at K' are the streams' own, a step with no drafts keeps the drafter's cache
complete when asked to; and ``streamspec vllm-calibrate`` on a tiny model writes a configuration
vLLM starts with."""

from __future__ import annotations

import json

import pytest

from streamspec.vllm.calibrate import calibrate, choose_schedule, int_list, speculative_config
from streamspec.vllm.client import run_vllm, vllm_python
from streamspec.vllm.export import export_for_vllm
from streamspec.vllm.format import ALIGNMENT_ENV
from streamspec.vllm.schedule import check_schedule

try:
    vllm_python()
except FileNotFoundError as err:  # `make test` builds the environment first
    pytest.skip(str(err), allow_module_level=True)

from test_vllm_drafter import drafts_agreement, passes_by_prompt, read_log, tiny_streams  # noqa: E402

# 3 requests at once, ending after 6, 12 and 24 tokens: 3 share a step for 6 steps (K' = 4), 2 for
# 6 more (K' = 0), and the last runs alone (K' = 2) after steps without drafts
SCHEDULE = [[1, 1, 2], [2, 2, 0], [3, 8, 4]]
MAX_TOKENS = [24, 12, 6]
# the DFlash layout (γ drafts a step, no filler): 1 alone, none two at once, 3 three at once
DFLASH_SCHEDULE = [[1, 1, 1], [2, 2, 0], [3, 8, 3]]


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    """One vLLM process: plain, the schedule with K' = 0 keeping the drafter's cache (``cache``)
    and skipping the drafter (``skip``, vLLM's default here), 3 at once and one at a time."""
    import torch

    root = tmp_path_factory.mktemp("vllm-schedule")
    base, drafter = tiny_streams(root, "llama")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (17, 30, 9)]
    streams = {"drafter": "streams", "folder": str(drafter), "schedule": SCHEDULE}
    dflash = {"drafter": "streams", "folder": str(export_for_vllm(root / "llama-0-streams", root / "llama-0-dflash",
                                                                   layout="dflash")), "schedule": DFLASH_SCHEDULE}
    runs = [{"name": "plain", "concurrency": 3},
            {**streams, "name": "cache", "zero_drafts": "cache", "concurrency": 3},
            {**streams, "name": "skip", "zero_drafts": "skip", "concurrency": 3},
            {**streams, "name": "skip@1", "zero_drafts": "skip", "concurrency": 1},
            {**dflash, "name": "dflash", "zero_drafts": "skip", "concurrency": 3},
            {**dflash, "name": "dflash@1", "zero_drafts": "skip", "concurrency": 1}]
    log = root / "alignment.jsonl"
    spec = {"model": str(base), "prompts": prompts, "max_tokens": MAX_TOKENS, "ignore_eos": True, "warmup": False,
            "max_model_len": 256, "runs": runs}
    done = {r["name"]: r for r in run_vllm(spec, env={ALIGNMENT_ENV: str(log)})["runs"]}
    return dict(runs=done, log=read_log(log), prompts=prompts, root=root)


def records(scheduled, name: str) -> tuple[list[dict], int]:
    """The alignment log of run `name` and the line it starts at (runs append in order)."""
    order = ["cache", "skip", "skip@1", "dflash", "dflash@1"]
    start = 0
    for other in order[:order.index(name)]:
        start = scheduled["runs"][other]["alignment_lines"][-1]
    return scheduled["log"][start:scheduled["runs"][name]["alignment_lines"][-1]], start


def test_a_schedule_decodes_identically_at_every_k(scheduled):
    runs = scheduled["runs"]
    plain = runs["plain"]["outputs"]
    assert [len(o) for o in plain] == MAX_TOKENS
    for name in ("cache", "skip", "skip@1"):
        assert runs[name]["outputs"] == plain, name
    # one at a time: K' = 2 every step (vLLM 0.32 alone fails there); 3 at once: 4, then 0, then 2
    one = runs["skip@1"]["counters"]
    assert one["vllm:spec_decode_num_drafts"] > 0
    assert one["vllm:spec_decode_num_draft_tokens"] == 2 * one["vllm:spec_decode_num_drafts"]
    three = runs["skip"]["counters"]
    drafts, tokens = three["vllm:spec_decode_num_drafts"], three["vllm:spec_decode_num_draft_tokens"]
    assert 2 * drafts < tokens < 4 * drafts  # steps of 4 and of 2 drafts
    assert drafts < sum(MAX_TOKENS)  # and steps of none


def test_the_dflash_layout_follows_a_schedule_with_its_own_streams(scheduled):
    """The DFlash layout sizes its rows from each step's K' in vLLM itself: 1..γ drafts a step all
    come from streams (1 one at a time, 3 three at once, none two at once), outputs stay exact, and
    each logged draft equals streamspec's own stream prediction."""
    from streamspec import load_streamed

    runs, plain = scheduled["runs"], scheduled["runs"]["plain"]["outputs"]
    assert runs["dflash"]["outputs"] == plain and runs["dflash@1"]["outputs"] == plain
    one = runs["dflash@1"]["counters"]
    assert one["vllm:spec_decode_num_drafts"] > 0
    assert one["vllm:spec_decode_num_draft_tokens"] == one["vllm:spec_decode_num_drafts"]  # K' = 1
    three = runs["dflash"]["counters"]
    drafts, tokens = three["vllm:spec_decode_num_drafts"], three["vllm:spec_decode_num_draft_tokens"]
    assert drafts < tokens < 3 * drafts and drafts < sum(MAX_TOKENS)  # steps of 3, of 1 and of none
    log, start = records(scheduled, "dflash@1")
    assert log and all(r["positions_ok"] and r["agreed"] == r["checked"] for r in log)
    model = load_streamed(scheduled["root"] / "llama-0-streams")
    same, total = drafts_agreement(model, scheduled["prompts"], runs["dflash@1"]["outputs"],
                                   passes_by_prompt(scheduled["log"], runs["dflash@1"]["alignment_lines"], start))
    assert total >= 20 and same == total


def test_drafts_at_a_smaller_k_are_the_streams_own(scheduled):
    """K' = 2 of a drafter started for 4: each pass drafts stream 1 of the last accepted position,
    as streamspec's own streams predict it (the drafter's rows are those of K = 2)."""
    from streamspec import load_streamed

    log, start = records(scheduled, "skip@1")
    assert all(len(drafts) == 1 for record in log for _, drafts in record["passes"])
    model = load_streamed(scheduled["root"] / "llama-0-streams")
    same, total = drafts_agreement(model, scheduled["prompts"], scheduled["runs"]["skip@1"]["outputs"],
                                   passes_by_prompt(scheduled["log"], scheduled["runs"]["skip@1"]["alignment_lines"],
                                                    start))
    assert total >= 20 and same == total


def test_steps_without_drafts_keep_the_drafter_cache_when_asked(scheduled):
    """After the steps with K' = 0, the request left alone drafts again: with ``cache`` every main
    row at its last accepted position still predicts the sampled token (the drafter's cache holds
    the rows of the steps without drafts); with ``skip`` those rows are missing, and the check sees
    it (while the outputs stay exact)."""
    cache, _ = records(scheduled, "cache")
    assert sum(r["checked"] for r in cache) > 0
    assert sum(r["agreed"] for r in cache) == sum(r["checked"] for r in cache)
    skip, _ = records(scheduled, "skip")
    assert sum(r["agreed"] for r in skip) < sum(r["checked"] for r in skip)


def test_schedules_the_streams_cannot_follow_are_refused():
    check_schedule([[1, 4, 4], [5, 8, 0], [9, 16, 2]], 4, 3)
    check_schedule([[1, 4, 1], [5, 8, 3]], 3, 3, least=1)  # the DFlash layout: 1..γ
    with pytest.raises(ValueError, match=r"0 \(no speculation\) or 1..3"):
        check_schedule([[1, 4, 4]], 3, 3, least=1)
    with pytest.raises(ValueError, match="1 draft"):
        check_schedule([[1, 4, 1]], 4, 3)
    with pytest.raises(ValueError, match=r"0 \(no speculation\) or 2..4"):
        check_schedule([[1, 4, 5]], 4, 3)
    with pytest.raises(ValueError, match="entries must be"):
        check_schedule([[1, 4]], 4, 3)


def test_choose_schedule_takes_the_fastest_k_and_plain_where_it_wins():
    def row(size, plain, **ks):
        return {"batch_size": size, "tokens_per_s": {"plain": plain, **{f"K={k[1:]}": v for k, v in ks.items()}},
                "identical": {f"K={k[1:]}": True for k in ks}}

    rows = [row(1, 30, k0=29, k2=33, k4=35), row(8, 80, k0=79, k2=82, k4=70), row(32, 100, k0=99, k2=60, k4=50)]
    picks, schedule = choose_schedule(rows, margin=0.0)
    assert picks == {1: 4, 8: 2, 32: 0}
    assert schedule == [[1, 7, 4], [8, 31, 2], [32, 32, 0]]
    picks, schedule = choose_schedule(rows, margin=0.05)  # 82 is not 5% above 80
    assert picks == {1: 4, 8: 0, 32: 0} and schedule == [[1, 7, 4], [8, 32, 0]]
    rows[0]["identical"]["K=4"] = False  # a K whose outputs differ is never chosen
    assert choose_schedule(rows)[0][1] == 2
    config = speculative_config("drafter", [[1, 7, 0]])
    assert config["num_speculative_tokens"] == 2 and config["num_speculative_tokens_per_batch_size"] == [[1, 7, 0]]
    assert "disable_eagle_block_drop" not in config
    config = speculative_config("drafter", [[1, 7, 0]], layout="dflash")
    assert config["method"] == "dflash" and config["num_speculative_tokens"] == 1
    assert config["disable_eagle_block_drop"] is True
    with pytest.raises(ValueError, match="--batch-sizes"):
        int_list("1,x", "--batch-sizes")


def test_calibrate_writes_a_config_vllm_starts_with(scheduled, tmp_path):
    """A tiny calibration (batch sizes 1 and 2, K 0 and 2, 4 tokens): the config names the drafter
    and a schedule from batch size 1 with K 0 or 2; vLLM started with it and decoded as plain."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in scheduled["prompts"]))
    drafter, base = scheduled["root"] / "llama-0-drafter", scheduled["root"] / "llama-0"
    with pytest.raises(ValueError, match="--ks"):
        calibrate(str(drafter), tmp_path / "bad", model=str(base), prompts_file=str(prompts), ks=[0, 1])
    with pytest.raises(FileNotFoundError, match="--prompts"):
        calibrate(str(drafter), tmp_path / "bad", model=str(base), prompts_file=str(tmp_path / "none.jsonl"))
    result = calibrate(str(drafter), tmp_path / "out", model=str(base), prompts_file=str(prompts), limit=2,
                       batch_sizes=(1, 2), ks=[0, 2], max_tokens=4, repeats=1, max_model_len=256, show_progress=False)
    written = json.loads((tmp_path / "out" / "speculative_config.json").read_text())
    assert written == result["speculative_config"]
    assert written["model"] == str(drafter) and written["parallel_drafting"] is True
    schedule = written["num_speculative_tokens_per_batch_size"]
    assert schedule[0][0] == 1 and all(k in (0, 2) for _, _, k in schedule)
    check_schedule(schedule, written["num_speculative_tokens"], 3)
    rows = result["measured"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert all(set(r["tokens_per_s"]) == {"plain", "K=0", "K=2"} and all(r["identical"].values()) for r in rows)
    assert [c["identical"] for c in result["measured"]["schedule_check"]] == [True, True]
    assert "| batch size | plain | streams K=0 | streams K=2 | chosen K | schedule |" in result["table"]
    assert json.loads((tmp_path / "out" / "calibration.json").read_text())["speculative_config"] == written
    # a server's workload: prompts in the prefix cache, requests ending at their end; the same outputs
    with pytest.raises(ValueError, match="--workload must be one of steady, serving"):
        calibrate(str(drafter), tmp_path / "bad", model=str(base), prompts_file=str(prompts), workload="burst")
    served = calibrate(str(drafter), tmp_path / "served", model=str(base), prompts_file=str(prompts), limit=2,
                       batch_sizes=(1,), ks=[0, 2], max_tokens=4, repeats=1, max_model_len=256, workload="serving",
                       show_progress=False)
    assert all(served["measured"]["rows"][0]["identical"].values()) and served["measured"]["schedule_check"][0]["identical"]
    assert json.loads((tmp_path / "served" / "calibration.json").read_text())["settings"]["workload"] == "serving"
