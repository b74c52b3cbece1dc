"""The streams as vLLM's drafter, run in vLLM itself (its CPU build, in `make vllm`'s environment):
greedy outputs identical to vLLM without speculation, the drafter aligned with the target, its
drafts equal to streamspec's own stream predictions, vLLM's acceptance counters read back, and a
drafter for another base refused. vLLM's suffix decoding (the ``vllm_suffix`` row) beside them, and
the EAGLE-3 / P-EAGLE drafters vLLM's training library (speculators) trains on the CPU
(``vllm_eagle3``, ``vllm_peagle``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from streamspec import StreamConfig, add_streams, load_streamed
from streamspec.vllm.client import VLLMRunError, check_suffix_decoding, run_vllm, vllm_python
from streamspec.vllm.format import ALIGNMENT_ENV
from streamspec.vllm.lookup import LOOKUP_ENV, lookup_drafts
from streamspec.vllm.export import export_for_vllm

try:
    vllm_python()
except FileNotFoundError as err:  # `make test` builds the environment first
    pytest.skip(str(err), allow_module_level=True)

NEW_TOKENS = 24


def tiny_config(arch: str):
    """Small, but wide enough for vLLM's CPU attention kernels (head size 32)."""
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **shape)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **shape)
    return LlamaConfig(**shape)


TINY_STREAMS = dict(mode="lossless", num_streams=3, stream_layers=2, stream_adapter_rank=8, main_weight=0.0)


def tiny_streams(root: Path, arch: str, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random base folder and the vLLM drafter of random lossless streams on it."""
    torch.manual_seed(seed)
    base = root / f"{arch}-{seed}"
    AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(base)
    model = add_streams(AutoModelForCausalLM.from_pretrained(base).eval(), StreamConfig(**TINY_STREAMS))
    with torch.no_grad():
        for p in model.streams.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(root / f"{arch}-{seed}-streams")
    return base, export_for_vllm(root / f"{arch}-{seed}-streams", root / f"{arch}-{seed}-drafter", layout="peagle")


def tiny_next_token_streams(root: Path, base: Path) -> Path:
    """Random lossless streams on `base` that read the next token (``next_token_input``, the map W
    large enough to change drafts), exported in the DFlash layout; the checkpoint folder."""
    torch.manual_seed(1)
    model = add_streams(AutoModelForCausalLM.from_pretrained(base).eval(),
                        StreamConfig(**TINY_STREAMS, next_token_input=True))
    with torch.no_grad():
        for name, p in model.streams.named_parameters():
            p.normal_(0, 0.1 if name.startswith("next_token_map.") else 0.3)
    model.save_pretrained(root / f"{base.name}-next-token-streams")
    export_for_vllm(root / f"{base.name}-next-token-streams", root / f"{base.name}-next-token-dflash", layout="dflash")
    return root / f"{base.name}-next-token-streams"


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def passes_by_prompt(log: list[dict], lines: list[int], start: int = 0) -> list[list]:
    """The drafter's logged passes ([p, drafts]) of each prompt (decoded one at a time): `lines`
    are the log's lengths after each prompt, from line `start` (where the run began)."""
    out = []
    for end in lines:
        out.append([entry for record in log[start:end] for entry in record["passes"]])
        start = end
    return out


def run_records(log: list[dict], runs: list[dict], index: int) -> tuple[list[dict], int]:
    """The log records of the streams run `runs[index]` (runs share one log, appended in order) and
    the line it starts at."""
    start = 0
    for run in runs[:index]:
        if run["alignment_lines"]:
            start = run["alignment_lines"][-1]
    return log[start:runs[index]["alignment_lines"][-1]], start


def drafts_agreement(model, prompts: list[list[int]], outputs: list[list[int]], passes: list[list],
                     vocab: torch.Tensor | None = None) -> tuple[int, int]:
    """How many logged drafts equal streamspec's own stream predictions (the argmax of stream j at
    position p over the final text, lossless: it depends on the tokens up to p only, and p+1 for
    streams that read the next token, so their last position is not compared; among the ids of
    `vocab` when given)."""
    same = total = 0
    for prompt, output, logged in zip(prompts, outputs, passes):
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(ids, streams_at="all").stream_logits[0]  # [T, γ, V]
            streams = logits.argmax(-1) if vocab is None else vocab[logits[..., vocab].argmax(-1)]
        for p, drafts in logged:
            for j, token in enumerate(drafts):
                if p < known_positions(model, ids.shape[1]):
                    total += 1
                    same += int(streams[p, j]) == token
    return same, total


def known_positions(model, length: int) -> int:
    """The positions of a `length`-token text whose stream predictions the text determines: all,
    but the last for streams that read the token after each position (the text ends before it)."""
    return length - int(model.stream_config.next_token_input)


def check_alignment(log: list[dict]) -> None:
    checked = sum(r["checked"] for r in log)
    assert checked > 0
    assert sum(r["agreed"] for r in log) == checked
    assert all(r["positions_ok"] for r in log)


def tiny_peer_drafters(root: Path, base: Path, prompts: list[list[int]]) -> dict[str, dict]:
    """EAGLE-3 and P-EAGLE drafters for the tiny `base`, trained by speculators (in vLLM's
    environment) for a few steps on the model's own greedy continuations of `prompts` (both on one
    set of hidden states), with a pruned draft vocabulary (vLLM maps its drafts back to the
    target's ids); their reports."""
    from streamspec.evaluation.peer_drafters import train_peer_drafter

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    examples = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            examples.append({"input_ids": ids[0].tolist(), "loss_mask": [0] * len(prompt) + [1] * NEW_TOKENS})
    common = dict(work=root / "peers", epochs=10, total_seq_len=128, draft_vocab_size=256, train_data_ratio=0.75)
    # EAGLE-3 in two calls, as a long run goes: 4 steps, then on to 8 from its last checkpoint
    train_peer_drafter(str(base), examples, root / "llama-eagle3", method="eagle3", max_steps=4, resume=True, **common)
    return {"eagle3": train_peer_drafter(str(base), examples, root / "llama-eagle3", method="eagle3", max_steps=8,
                                         resume=True, **common),
            "peagle": train_peer_drafter(str(base), examples, root / "llama-peagle", method="peagle", max_steps=8,
                                         **common)}


ARCHS = ("llama", "qwen2", "mistral")
DFLASH_ARCHS = ("llama", "qwen2")  # Mistral's layers are Llama's


def batched_agreement(model, prompts: list[list[int]], outputs: list[list[int]], logged: list) -> tuple[int, int]:
    """How many logged passes of requests decoded together ([p, drafts], the request unnamed) equal
    streamspec's own stream predictions at p of one of the texts: a drafter that took another
    request's state, or another position's, drafts what no text's streams predict there."""
    predictions = []
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            predictions.append(model(torch.tensor([prompt + output]), streams_at="all").stream_logits[0].argmax(-1))
    # a text's last position, for streams that read the token after it, is not compared (`known_positions`)
    ends = {known_positions(model, streams.shape[0]) for streams in predictions} - {streams.shape[0] for streams in predictions}
    logged = [(p, drafts) for p, drafts in logged if p not in ends]
    same = sum(any(p < streams.shape[0] and streams[p, :len(drafts)].tolist() == drafts for streams in predictions)
               for p, drafts in logged)
    return same, len(logged)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Per architecture: plain and streams runs of the same prompts, with the drafter's log; the
    llama drafter fed the wrong layer (``wrong_layer``); vLLM's suffix decoding on the llama base
    (``suffix``); and EAGLE-3 and P-EAGLE drafters speculators trained for the llama base
    (``trained``). One vLLM process for all of them: its start-up is most of a run's time."""
    root = tmp_path_factory.mktemp("vllm-tiny")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (17, 30, 9)]
    folders = {arch: tiny_streams(root, arch) for arch in ARCHS}
    # a copy of the llama drafter told to read the layer below the right one (as a mapping drift would)
    wrong = root / "llama-0-drafter-wrong-layer"
    shutil.copytree(folders["llama"][1], wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [config["eagle_aux_hidden_state_layer_ids"][0] - 1]
    (wrong / "config.json").write_text(json.dumps(config))
    # two prompts sharing their first 140 tokens: the second finds the first's first cache block (128
    # tokens on a CPU) in vLLM's prefix cache
    shared_gen = torch.Generator().manual_seed(1)
    common = torch.randint(3, 512, (140,), generator=shared_gen).tolist()
    shared = [common + torch.randint(3, 512, (n,), generator=shared_gen).tolist() for n in (5, 9)]
    runs = []
    for arch, (base, drafter) in folders.items():
        runs += [{"model": str(base), "drafter": "none", "name": f"{arch}-plain"},
                 {"model": str(base), "drafter": "streams", "folder": str(drafter), "name": f"{arch}-streams"}]
        if arch == "llama":  # on the plain engine
            runs.insert(-1, {"model": str(base), "drafter": "none", "name": "llama-plain-shared", "prompts": shared})
    runs.append({"model": str(folders["llama"][0]), "drafter": "streams", "folder": str(wrong), "name": "wrong-layer"})
    for arch in DFLASH_ARCHS:  # the DFlash layout: one engine, one request at a time then all three at once
        dflash = export_for_vllm(root / f"{arch}-0-streams", root / f"{arch}-0-dflash", layout="dflash")
        runs += [{"model": str(folders[arch][0]), "drafter": "streams", "folder": str(dflash), "name": f"{arch}-dflash",
                  "concurrency": n} for n in (1, 3)]
        if arch == "llama":  # twice on that engine: each run starts with the prefix cache emptied
            runs += [{"model": str(folders[arch][0]), "drafter": "streams", "folder": str(dflash),
                      "name": "llama-dflash-shared", "prompts": shared}] * 2
    # streams that read the next token (the bonus token vLLM hands the DFlash drafter)
    next_token = tiny_next_token_streams(root, folders["llama"][0])
    runs += [{"model": str(folders["llama"][0]), "drafter": "streams", "folder": str(root / "llama-0-next-token-dflash"),
              "name": "llama-next-token", "concurrency": n} for n in (1, 3)]
    # vLLM's n-gram drafter: the engines after it start in a fresh process (`streamspec.vllm.run`)
    runs += [{"model": str(folders["llama"][0]), "drafter": "ngram", "name": "llama-ngram"},
             {"model": str(folders["llama"][0]), "drafter": "none", "name": "llama-after-ngram"}]
    try:  # without arctic-inference the suffix test fails, saying so, and the others still run
        check_suffix_decoding()
        runs.append({"model": str(folders["llama"][0]), "drafter": "suffix", "name": "llama-suffix"})
        suffix_missing = None
    except RuntimeError as err:
        suffix_missing = str(err)
    train_prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (12, 20, 8, 16, 25, 10, 14, 18)]
    try:  # without speculators the trained drafters' test fails, saying so, and the others still run
        trained = tiny_peer_drafters(root, folders["llama"][0], train_prompts)
        runs += [{"model": str(folders["llama"][0]), "drafter": method, "folder": str(root / f"llama-{method}"),
                  "name": f"llama-{method}"} for method in trained]
    except VLLMRunError as err:
        trained = str(err)
    log = root / "alignment.jsonl"
    spec = {"model": str(folders["llama"][0]), "prompts": prompts, "max_tokens": NEW_TOKENS, "ignore_eos": True,
            "warmup": False, "max_model_len": 256, "runs": runs}
    done = run_vllm(spec, env={ALIGNMENT_ENV: str(log)})["runs"]
    records = read_log(log)
    results = {}
    by_name = {}
    for i, run in enumerate(done):
        by_name.setdefault(run["name"], i)
    for arch in ARCHS:
        plain, streams = by_name[f"{arch}-plain"], by_name[f"{arch}-streams"]
        arch_log, start = run_records(records, done, streams)
        results[arch] = dict(base=folders[arch][0], drafter=folders[arch][1], runs=[done[plain], done[streams]],
                             log=arch_log, log_start=start, full_log=records, prompts=prompts, root=root)
    results["wrong_layer"] = dict(run=done[by_name["wrong-layer"]],
                                  log=run_records(records, done, by_name["wrong-layer"])[0])
    results["dflash"] = {}
    for arch in DFLASH_ARCHS:
        index = by_name[f"{arch}-dflash"]  # the first of the two runs of that name
        results["dflash"][arch] = dict(one=done[index], batched=done[index + 1],
                                       log_one=run_records(records, done, index),
                                       log_batched=run_records(records, done, index + 1)[0])
    index = by_name["llama-next-token"]
    results["next_token"] = dict(checkpoint=next_token, one=done[index], batched=done[index + 1],
                                 log_one=run_records(records, done, index),
                                 log_batched=run_records(records, done, index + 1)[0])
    index = by_name["llama-dflash-shared"]
    results["shared"] = dict(prompts=shared, plain=done[by_name["llama-plain-shared"]], runs=done[index:index + 2],
                             logs=[run_records(records, done, i) for i in (index, index + 1)])
    results["ngram"] = dict(run=done[by_name["llama-ngram"]], plain=done[by_name["llama-plain"]],
                            after=done[by_name["llama-after-ngram"]], names=[r["name"] for r in done])
    results["suffix"] = dict(run=done[by_name["llama-suffix"]] if not suffix_missing else None,
                             plain=done[by_name["llama-plain"]], missing=suffix_missing)
    results["trained"] = dict(runs={m: done[by_name[f"llama-{m}"]] for m in ("eagle3", "peagle")
                                    if f"llama-{m}" in by_name},
                              plain=done[by_name["llama-plain"]], reports=trained)
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_bases_decode_identically_with_the_streams_drafting(tiny, arch):
    plain, streams = tiny[arch]["runs"]
    assert [len(o) for o in plain["outputs"]] == [NEW_TOKENS] * 3
    assert streams["outputs"] == plain["outputs"]
    assert streams["counters"]["vllm:spec_decode_num_drafts"] > 0  # the drafter ran
    per_position = streams["acceptance_per_position"]  # vLLM's accepted drafts per position, over its steps
    assert len(per_position) == streams["num_speculative_tokens"]
    assert all(1 >= a >= b >= 0 for a, b in zip(per_position, per_position[1:]))  # a chain: never more later
    assert 1 + sum(per_position) == pytest.approx(streams["mean_acceptance_length"])
    check_alignment(tiny[arch]["log"])
    model = load_streamed(tiny[arch]["root"] / f"{arch}-0-streams")
    same, total = drafts_agreement(model, tiny[arch]["prompts"], streams["outputs"],
                                   passes_by_prompt(tiny[arch]["full_log"], streams["alignment_lines"],
                                                    tiny[arch]["log_start"]))
    assert total >= 3 * NEW_TOKENS // 2  # (γ drafts a pass)
    assert same == total


@pytest.mark.parametrize("arch", DFLASH_ARCHS)
def test_the_dflash_layout_drafts_gamma_tokens_from_the_streams(tiny, arch):
    """vLLM's DFlash proposer with the streams (``--layout dflash``): γ drafts a step, no filler,
    outputs identical to vLLM without speculation one request at a time and three at once, every
    request's main state found at its last accepted position, and every draft equal to streamspec's
    own stream predictions, as in the P-EAGLE layout."""
    plain = tiny[arch]["runs"][0]
    one, batched = tiny["dflash"][arch]["one"], tiny["dflash"][arch]["batched"]
    assert one["num_speculative_tokens"] == 3 and batched["concurrency"] == 3
    assert one["outputs"] == plain["outputs"] and batched["outputs"] == plain["outputs"]
    assert one["counters"]["vllm:spec_decode_num_drafts"] > 0 and len(one["acceptance_per_position"]) == 3
    log_one, start = tiny["dflash"][arch]["log_one"]
    log_batched = tiny["dflash"][arch]["log_batched"]
    check_alignment(log_one)
    check_alignment(log_batched)
    assert max(r["checked"] for r in log_batched) > 1  # requests drafted together
    model = load_streamed(tiny[arch]["root"] / f"{arch}-0-streams")
    prompts = tiny[arch]["prompts"]
    same, total = drafts_agreement(model, prompts, one["outputs"],
                                   passes_by_prompt(tiny[arch]["full_log"], one["alignment_lines"], start))
    assert total >= 3 * NEW_TOKENS and same == total
    same, total = batched_agreement(model, prompts, batched["outputs"],
                                    [entry for record in log_batched for entry in record["passes"]])
    assert total >= NEW_TOKENS and same == total


def test_streams_that_read_the_next_token_draft_with_the_bonus_token(tiny):
    """``next_token_input`` streams in the DFlash layout: outputs identical to vLLM without
    speculation one request at a time and three at once, and every draft equal to streamspec's own
    stream predictions, which read the token after p (the bonus token vLLM hands the drafter's
    first query row); with W zeroed the predictions differ, so the token fed is what agrees."""
    plain = tiny["llama"]["runs"][0]
    run = tiny["next_token"]
    one, batched = run["one"], run["batched"]
    assert one["outputs"] == plain["outputs"] and batched["outputs"] == plain["outputs"]
    assert one["counters"]["vllm:spec_decode_num_drafts"] > 0
    log_one, start = run["log_one"]
    check_alignment(log_one)
    check_alignment(run["log_batched"])
    model = load_streamed(run["checkpoint"])
    prompts = tiny["llama"]["prompts"]
    passes = passes_by_prompt(tiny["llama"]["full_log"], one["alignment_lines"], start)
    same, total = drafts_agreement(model, prompts, one["outputs"], passes)
    assert total >= 2 * NEW_TOKENS and same == total
    same, total = batched_agreement(model, prompts, batched["outputs"],
                                    [entry for record in run["log_batched"] for entry in record["passes"]])
    assert total >= NEW_TOKENS and same == total
    with torch.no_grad():
        model.streams.next_token_map.weight.zero_()
    same, total = drafts_agreement(model, prompts, one["outputs"], passes)
    assert same < total


def test_a_prefix_cache_hit_keeps_the_dflash_drafts_the_streams(tiny):
    """Two prompts sharing their first 140 tokens, one at a time, twice on one engine: the second
    prompt reads the first's cache block from vLLM's prefix cache, as much as plain decoding reads
    (the DFlash layout turns off vLLM's recompute of the last cached block: `streams_speculative_config`), and
    still every request's main state is found at p and every draft is the streams' own prediction.
    The second run, with the cache emptied before it, finds what the first found: its own prompts'."""
    shared = tiny["shared"]
    first, second = shared["runs"]
    assert first["outputs"] == shared["plain"]["outputs"] == second["outputs"]
    hits = [run["counters"]["vllm:prefix_cache_hits"] for run in (shared["plain"], first, second)]
    assert hits[0] == hits[1] == hits[2] > 0
    model = load_streamed(tiny["llama"]["root"] / "llama-0-streams")
    for run, (log, start) in zip((first, second), shared["logs"]):
        check_alignment(log)
        same, total = drafts_agreement(model, shared["prompts"], run["outputs"],
                                       passes_by_prompt(tiny["llama"]["full_log"], run["alignment_lines"], start))
        assert total >= NEW_TOKENS and same == total


@pytest.fixture(scope="module")
def pruned(tiny):
    """The llama streams in the DFlash layout with a pruned draft vocabulary (the 48 ids the base's
    greedy text of the prompts uses most: transformers' generate, written as a distilled set),
    decoded in a vLLM process of their own; the run, its alignment log and the ids."""
    root, base = tiny["llama"]["root"], tiny["llama"]["base"]
    prompts = tiny["llama"]["prompts"]
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    text = root / "greedy.jsonl"
    text.write_text("".join(json.dumps({"prompt": "p", "completion": "c", "completion_ids": ids}) + "\n" for ids in greedy))
    folder = export_for_vllm(root / "llama-0-streams", root / "llama-0-dflash-pruned", layout="dflash",
                             draft_vocab=48, draft_vocab_from=[text])
    log = root / "alignment-pruned.jsonl"
    spec = {"model": str(base), "prompts": prompts, "max_tokens": NEW_TOKENS, "ignore_eos": True, "warmup": False,
            "max_model_len": 256, "runs": [{"drafter": "streams", "folder": str(folder), "name": "llama-dflash-pruned"}]}
    run = run_vllm(spec, env={ALIGNMENT_ENV: str(log)})["runs"][0]
    return dict(run=run, log=read_log(log), vocab=load_file(str(folder / "model.safetensors"))["draft_vocab"])


def test_a_pruned_draft_vocabulary_drafts_among_its_ids(tiny, pruned):
    """`--draft-vocab 48`: the drafter's LM head is 48 rows of the target's; every draft is one of
    those ids, namely the streams' argmax among them (streamspec's own stream logits restricted
    to the vocabulary), and the outputs stay vLLM's own."""
    run, plain, vocab, log = pruned["run"], tiny["llama"]["runs"][0], pruned["vocab"], pruned["log"]
    assert vocab.shape == (48,) and run["num_speculative_tokens"] == 3
    assert run["outputs"] == plain["outputs"]
    check_alignment(log)  # the main rows still predict the sampled token over the whole vocabulary
    drafts = [d for record in log for _, ds in record["passes"] for d in ds]
    assert drafts and set(drafts) <= set(vocab.tolist())
    model = load_streamed(tiny["llama"]["root"] / "llama-0-streams")
    passes = passes_by_prompt(log, run["alignment_lines"])
    prompts = tiny["llama"]["prompts"]
    same, total = drafts_agreement(model, prompts, run["outputs"], passes, vocab=vocab)
    assert total >= 3 * NEW_TOKENS and same == total
    unpruned, _ = drafts_agreement(model, prompts, run["outputs"], passes)
    assert unpruned < total  # the whole vocabulary's argmax is often elsewhere: the pruning is what drafted


def test_a_drafter_fed_the_wrong_layer_is_caught(tiny):
    """The alignment check fails loudly when the drafter is fed another layer's hidden state (as a
    mapping drift would), while the target's verification still keeps the outputs exact."""
    records = tiny["wrong_layer"]["log"]
    checked, agreed = sum(r["checked"] for r in records), sum(r["agreed"] for r in records)
    assert checked > 0 and agreed <= checked // 2
    assert tiny["wrong_layer"]["run"]["outputs"] == tiny["llama"]["runs"][0]["outputs"]


def test_engines_after_the_ngram_drafter_start(tiny):
    """vLLM's n-gram drafter loads numba, after which vLLM 0.32 cannot start another engine in the
    same process: the runs after it go on in a fresh one, and every run of the spec comes back."""
    run, plain, after = tiny["ngram"]["run"], tiny["ngram"]["plain"], tiny["ngram"]["after"]
    assert run["outputs"] == plain["outputs"] == after["outputs"]
    assert run["counters"]["vllm:spec_decode_num_drafts"] > 0
    names = tiny["ngram"]["names"]
    assert names.index("llama-after-ngram") == names.index("llama-ngram") + 1  # in the spec's order


def test_suffix_decoding_decodes_identically_and_drafts(tiny):
    """vLLM's suffix decoding (arctic-inference's suffix trees, built by `make vllm`): drafts from
    the prompt and the output so far, where a random model's greedy text soon repeats itself, and
    outputs identical to vLLM without speculation."""
    if tiny["suffix"]["missing"]:
        pytest.fail(tiny["suffix"]["missing"])
    run, plain = tiny["suffix"]["run"], tiny["suffix"]["plain"]
    assert plain["name"] == "llama-plain" and run["name"] == "llama-suffix"
    assert run["outputs"] == plain["outputs"]
    assert run["num_speculative_tokens"] == 8
    assert run["counters"]["vllm:spec_decode_num_drafts"] > 0
    assert run["counters"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert 1 + sum(run["acceptance_per_position"]) == pytest.approx(run["mean_acceptance_length"])
    assert run["mean_acceptance_length"] > 1


@pytest.mark.parametrize("method", ("eagle3", "peagle"))
def test_drafters_trained_by_speculators_decode_identically(tiny, method):
    """The vllm_eagle3 / vllm_peagle rows' drafters: speculators trains them on the CPU (the report:
    what it trained, on how many tokens, in how long), vLLM loads the folder as its eagle3 method
    (P-EAGLE with parallel drafting), drafts with it, and the outputs stay vLLM's own without
    speculation."""
    reports, plain = tiny["trained"]["reports"], tiny["trained"]["plain"]
    if isinstance(reports, str):
        pytest.fail(reports)
    report, run = reports[method], tiny["trained"]["runs"][method]
    assert report["method"] == method and report["speculators"] == "0.9.0" and report["device"] == "cpu"
    assert report["steps"] == 8 and report["stopped"] == "max_steps (8)" and report["checkpoint"] == "interrupted"
    assert report["target_layer_ids"] == [1, 2, 3] and report["draft_vocab_size"] == 256
    assert report["hidden_states_reused"] and report["hidden_state_tokens"] == 0  # one set of hidden states for all
    if method == "eagle3":  # resumed: the second call went on from the first one's last checkpoint, not from 0
        first, second = report["calls"]
        assert first["steps"] == 4 and first["stopped"] == "max_steps (4)" and second["steps"] == 8
        assert 0 < second["tokens_seen"] < 1.5 * first["tokens_seen"]
        assert report["tokens_seen"] == first["tokens_seen"] + second["tokens_seen"]
    assert 0 < report["trained_parameters"] < report["total_parameters"]  # the LM head stays the target's
    assert report["tokens_seen"] >= report["loss_tokens_seen"] > 0 and report["seconds"]["training"] > 0
    assert run["outputs"] == plain["outputs"]
    # the drafts a step it was trained for: EAGLE-3's unrolled steps, P-EAGLE's parallel depths
    assert run["num_speculative_tokens"] == (3 if method == "eagle3" else 4)
    assert run["counters"]["vllm:spec_decode_num_drafts"] > 0


def test_a_drafter_for_another_base_is_refused(tiny):
    other, _ = tiny_streams(tiny["llama"]["root"], "llama", seed=1)  # same shape, other weights
    spec = {"model": str(other), "prompts": [[5, 6, 7]], "max_tokens": 4, "warmup": False, "max_model_len": 256,
            "runs": [{"drafter": "streams", "folder": str(tiny["llama"]["drafter"])}]}
    with pytest.raises(VLLMRunError) as caught:
        run_vllm(spec)
    assert "has other weights" in caught.value.output


def test_default_model_with_the_shipped_sql_streams(tmp_path):
    """SmolLM2 with the shipped SQL streams on held-out Spider questions: identical to vLLM without
    speculation one at a time, vLLM's acceptance counters above 1, and the drafts equal to
    streamspec's own streams; the same for the shipped SQL streams for vLLM, which read the bonus
    token, one at a time; and those with lookup drafts (prompt lookup's, suffix decoding's) merged
    and a draft past the streams', 8 at once."""
    from streamspec.assets import default_model_path, load_default_tokenizer
    from streamspec.data.build import prompt_ids
    from streamspec.evaluation.benchmark import held_out_rows

    tokenizer = load_default_tokenizer()
    prompts = [prompt_ids(tokenizer, row)[0].tolist() for row in held_out_rows("sql")[:8]]
    drafter = export_for_vllm("streamspec:smollm2-135m-sql-streams", tmp_path / "drafter")
    reading = export_for_vllm("streamspec:smollm2-135m-sql-vllm-streams", tmp_path / "drafter-vllm")
    log = tmp_path / "log.jsonl"
    # with lookup drafts merged, one draft past the streams' (γ + 1 = 4 a step)
    lookup = export_for_vllm("streamspec:smollm2-135m-sql-vllm-streams", tmp_path / "drafter-lookup", lookup="2:4",
                             drafts=4)
    lookup_log = tmp_path / "lookup.jsonl"
    # suffix decoding's drafts merged instead (its trees of each request's prompt and output; the
    # drafts themselves are vLLM's suffix drafter's, tests/vllm/test_vllm_lookup.py), 8 at once
    suffix = export_for_vllm("streamspec:smollm2-135m-sql-vllm-streams", tmp_path / "drafter-suffix",
                             lookup="suffix:0", drafts=4)
    spec = {"model": str(default_model_path()), "prompts": prompts, "max_tokens": 48, "warmup": False,
            "runs": [{"drafter": "none"}, {"drafter": "streams", "folder": str(drafter)},
                     {"drafter": "streams", "folder": str(reading)},
                     {"drafter": "streams", "folder": str(lookup), "concurrency": 8},
                     {"drafter": "streams", "folder": str(suffix), "concurrency": 8}]}
    plain, streams, next_token, looked_up, suffixed = run_vllm(
        spec, env={ALIGNMENT_ENV: str(log), LOOKUP_ENV: str(lookup_log)})["runs"]
    assert streams["outputs"] == plain["outputs"] == next_token["outputs"] == looked_up["outputs"]
    assert suffixed["outputs"] == plain["outputs"]
    assert suffixed["mean_acceptance_length"] > next_token["mean_acceptance_length"]
    assert streams["mean_acceptance_length"] > 1.5
    assert next_token["mean_acceptance_length"] > 1.5
    # lookup drafts: each request looked up in its own text as it stood (prompt, output so far; a
    # request's last step samples past max_tokens, which vLLM then cuts), the drafts beginning with
    # what the lookup finds there; SQL copies its schema's names, so more is accepted
    texts = [p + o for p, o in zip(prompts, plain["outputs"])]
    merged = 0
    lines = read_log(lookup_log)
    suffix_lines = [line for line in lines if "suffix" in line.get("lookup", "")]
    assert suffix_lines  # the suffix folder's steps are logged too, and checked apart
    for line in lines:
        if line in suffix_lines:
            continue
        text = line["text"]
        assert any(len(p) < len(text) and text[:len(t)] == t[:len(text)] for p, t in zip(prompts, texts))
        found = lookup_drafts(np.array(text), 4, 2, 4).tolist()
        assert len(line["drafts"]) == 4 and line["drafts"][:len(found)] == found
        merged += bool(found)
    assert merged > 0
    assert looked_up["mean_acceptance_length"] > next_token["mean_acceptance_length"]
    records = read_log(log)
    for run, name, start in ((streams, "smollm2-135m-sql-streams", 0),
                             (next_token, "smollm2-135m-sql-vllm-streams", streams["alignment_lines"][-1])):
        check_alignment(records[start:run["alignment_lines"][-1]])
        model = load_streamed(f"streamspec:{name}")
        same, total = drafts_agreement(model, prompts, run["outputs"],
                                       passes_by_prompt(records, run["alignment_lines"], start))
        assert total > 0 and same >= 0.98 * total, name  # (float32 near-ties aside)


def test_the_benchmark_rows(tiny):
    """`streamspec eval --peers vllm_streams --vllm-schedule FILE`'s rows: plain vLLM beside the
    streams (fixed K, and drafting by batch size: 3 a step alone, none two at once), one request
    at a time and two at once, each compared with plain vLLM and with the benchmark's baseline."""
    from streamspec.evaluation.capacity import added_parameters
    from streamspec.evaluation.vllm_peers import vllm_rows

    root, prompts = tiny["llama"]["root"], tiny["llama"]["prompts"]
    baseline = tiny["llama"]["runs"][0]["outputs"]
    rows = vllm_rows(("vllm_streams",), str(root / "llama-0-streams"), str(tiny["llama"]["base"]), prompts, NEW_TOKENS,
                     [o[:NEW_TOKENS] for o in baseline], baseline_tps=100.0, concurrency=(1, 2),
                     schedule=[[1, 1, 3], [2, 8, 0]])
    assert sorted(rows) == ["vllm", "vllm@2", "vllm_streams", "vllm_streams@2", "vllm_streams_schedule",
                            "vllm_streams_schedule@2"]
    for name, row in rows.items():
        assert row["identical_to_vllm"] and row["tokens"] > 0
        # speedup and tokens/s are each rounded from the same unrounded figure: related within their roundings
        assert row["speedup"] == pytest.approx(row["tokens_per_second"] / 100, abs=1e-3)
        assert row["tokens_per_second"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-2, abs=0.02)
        assert (row["mean_acceptance_length"] is None) == (name in ("vllm", "vllm@2"))  # only drafters accept
        if row["mean_acceptance_length"] is not None:
            assert 1 + sum(row["acceptance_per_position"]) == pytest.approx(row["mean_acceptance_length"], abs=0.01)
            assert len(row["acceptance_per_position"]) == row["num_speculative_tokens"]
            # the drafter's own weights, counted from the checkpoint's streams file
            assert row["draft_parameters"] == added_parameters(root / "llama-0-streams")
    assert rows["vllm_streams@2"]["concurrency"] == 2
