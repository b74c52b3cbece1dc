"""The benchmark's peer rows (`streamspec.evaluation.peers`): the memory floor's arithmetic (what a
pass reads: tied weights once, the input table only when it is the LM head, the KV cache), the
floor row and each row's multiple of it; transformers compiled with a static cache decodes what
eager `generate` decodes and compiles once for prompts of one bucket; llama.cpp's rows on the
default model's GGUF, plain and with its n-gram speculation, decode the same tokens in fewer
passes; bad peer names and a llama.cpp row with no GGUF are refused."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import hf_greedy, make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.evaluation.peers import (
    AUTO_PEERS,
    PEERS,
    TRAINED_PEERS,
    add_memory_floor,
    floor_ms,
    kv_bytes_per_token,
    measure_read_bandwidth,
    peers_arg,
    transformers_compiled_method,
    weight_bytes,
)


def test_peer_names_parse_and_bad_ones_are_refused():
    assert peers_arg("auto") == AUTO_PEERS and peers_arg("none") == ()
    # all: every peer but those decoding with a trained drafter, which are named with its folder
    assert peers_arg("all") == tuple(p for p in PEERS if p not in TRAINED_PEERS)
    assert set(TRAINED_PEERS) == {"vllm_eagle3", "vllm_peagle"} <= set(PEERS)
    assert peers_arg("vllm,vllm_eagle3") == ("vllm", "vllm_eagle3")
    assert not any(p.startswith("vllm") for p in AUTO_PEERS)  # vLLM rows start engines: asked for by name
    assert peers_arg("llama_cpp, memory_floor") == ("llama_cpp", "memory_floor")
    assert peers_arg("vllm,vllm_streams") == ("vllm", "vllm_streams")
    with pytest.raises(ValueError, match="unknown peer.*sglang"):
        peers_arg("llama_cpp,sglang")


def test_weight_bytes_count_what_a_pass_reads():
    model = make_model("llama")  # untied: the input table is not read whole by a pass
    params = sum(p.numel() for p in model.parameters())
    table = model.get_input_embeddings().weight.numel()
    assert weight_bytes(model) == 4 * (params - table)
    model.tie_weights()
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    tied = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    assert weight_bytes(model) == 4 * tied
    streamed = add_streams(make_model("llama"), StreamConfig(num_streams=2, stream_layers=1))
    added = streamed.num_stream_parameters()
    assert weight_bytes(streamed) == 4 * (params - table + added)
    assert weight_bytes(make_model("llama").to(torch.bfloat16)) == 2 * (params - table)


def test_kv_bytes_and_the_floor():
    config = make_model("llama").config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = kv_bytes_per_token(config, torch.float32)
    assert per_token == 2 * config.num_hidden_layers * heads * head_dim * 4
    assert kv_bytes_per_token(config, torch.bfloat16) * 2 == per_token
    assert floor_ms(1_000_000, 1000, 500, 1e9) == pytest.approx(1000 * 1_500_000 / 1e9)


def test_every_row_gets_its_multiple_of_the_floor():
    summary = {
        "baseline": {"tokens_per_second": 20.0, "ms_per_pass": 50.0},
        "chain": {"ms_per_pass": 90.0, "ms_per_step_forward": 40.0, "ms_per_step_head": 8.0, "ms_per_step_overhead": 2.0},
    }
    add_memory_floor(summary, {"baseline": 10.0, "chain": 12.5}, 2e10, {"threads": 1})
    assert summary["baseline"]["x_floor"] == 5.0 and summary["baseline"]["floor_basis"].startswith("pass")
    assert summary["chain"]["x_floor"] == 4.0 and summary["chain"]["floor_basis"] == "decoding step"  # 50 ms / 12.5
    floor = summary["memory_floor"]
    assert floor["ms_per_pass"] == 10.0 and floor["tokens_per_second"] == 100.0 and floor["speedup"] == 5.0
    assert floor["read_gb_per_s"] == 20.0 and floor["threads"] == 1


def test_read_bandwidth_is_measured_and_small_buffers_refused():
    assert measure_read_bandwidth(megabytes=64, repeats=2) > 1e8  # any machine reads > 100 MB/s
    with pytest.raises(ValueError, match="megabytes"):
        measure_read_bandwidth(megabytes=1)


@pytest.mark.slow
def test_transformers_compiled_decodes_what_eager_generate_does(single_thread):
    from streamspec.evaluation.methods import CallCounter

    model = make_model("llama")
    counter = CallCounter(model)  # the benchmark's hooks on the same model: the compiled graph must not trace them
    run = transformers_compiled_method(model, eos_token_id=None)
    graphs = counters["stats"]["unique_graphs"]
    for length in (7, 12):  # one cache bucket: compiled once for both prompts
        ids = random_ids(1, length, seed=length)
        new, passes, _, _ = run(ids, 10)
        assert new == hf_greedy(model, ids, 10)[0].tolist() and passes == 10
    assert list(run.compile_seconds) == [256]
    before = counter.calls
    run(random_ids(1, 5, seed=2), 4)
    assert counter.calls == before  # cleared for the compiled generation
    with torch.no_grad():
        model(random_ids(1, 3, seed=0))
    assert counter.calls == before + 1 and len(counter.durations) == before + 1  # and back for the eager rows
    assert counters["stats"]["unique_graphs"] - graphs <= 2  # the decoding step (and transformers' own helpers)


@pytest.mark.slow
def test_llama_cpp_rows_plain_and_with_its_ngram_speculation(single_thread):
    pytest.importorskip("xllamacpp")
    from streamspec.assets import DEFAULT_MODEL_ID, load_tokenizer
    from streamspec.evaluation.peers import llama_cpp_method
    from streamspec.llamacpp import LlamaCppServer

    tokenizer = load_tokenizer(DEFAULT_MODEL_ID)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat exactly, three times: apple, banana, "
                                           "cherry, dates, elderberry, figs, grapes."}], add_generation_prompt=True,
                                         tokenize=False)
    ids = torch.tensor([tokenizer(text).input_ids])
    runs = {}
    for speculative in (None, "ngram"):
        with LlamaCppServer(DEFAULT_MODEL_ID, threads=1, speculative=speculative) as server:
            runs[speculative] = llama_cpp_method("llama_cpp", server.url)(ids, 48)
    (plain, plain_passes, _, split), (lookup, lookup_passes, _, _) = runs[None], runs["ngram"]
    assert plain and plain == lookup  # greedy speculation keeps llama.cpp's tokens
    assert plain_passes == len(plain) and lookup_passes < len(lookup)  # drafts copied from the prompt were accepted
    assert split["prefill"] > 0 and split["forward"] > 0
    with pytest.raises(ValueError, match="speculative"):
        LlamaCppServer(DEFAULT_MODEL_ID, speculative="medusa")


def test_the_benchmark_gives_the_floor_row_and_refuses_what_it_cannot_run(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from streamspec.evaluation.benchmark import markdown_table, run_benchmark

    torch.manual_seed(0)
    add_streams(AutoModelForCausalLM.from_pretrained(tiny_dir), StreamConfig(stream_layers=2)).save_pretrained(tmp_path / "c")
    options = dict(task="sql", limit=1, thresholds=(), tree_top_k=1, lookup=None, tree_budget=None, max_new_tokens=3)
    summary = run_benchmark(str(tmp_path / "c"), peers=("memory_floor",), **options)
    floor = summary["memory_floor"]
    assert floor["read_gb_per_s"] > 0 and floor["ms_per_pass"] > 0 and floor["weight_bytes"]["streams"] > floor["weight_bytes"]["baseline"]
    for name in ("baseline", "prompt_lookup", "streamed_ar", "chain"):
        assert summary[name]["x_floor"] > 0 and summary[name]["floor_ms"] > 0
    assert summary["chain"]["floor_ms"] >= summary["baseline"]["floor_ms"]  # the streams' weights are read too
    assert "x_floor" in markdown_table(summary)
    with pytest.raises(ValueError, match="need a GGUF"):
        run_benchmark(str(tmp_path / "c"), peers=("llama_cpp",), **options)
    with pytest.raises(ValueError, match="unknown peer"):
        run_benchmark(str(tmp_path / "c"), peers=("sglang",), **options)
