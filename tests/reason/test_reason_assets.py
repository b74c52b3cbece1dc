"""Opt-in reasoning models (streamspec.reason.assets): joining parts, refusing a wrong size or
hash, GGUF metadata checks, ``streamspec:`` ids; and, only when ``make reason-assets`` has
installed the part packages, the real Qwen2.5-Coder-0.5B-Instruct.

The joining tests make their own part packages in a temporary folder (never the real ones), so
`make test` needs none of the opt-in packages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util

import pytest

from streamspec import assets
from streamspec.reason.assets import (
    REASON_MODELS,
    check_gguf,
    gguf_metadata,
    join_gguf,
    join_reason_model,
    packages_installed,
    part_files,
    reason_model,
    reason_model_path,
)

SMALL = "qwen2.5-coder-0.5b-instruct"
PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part \x00\x01", b"and the last"]


def _fake_packages(tmp_path, monkeypatch, parts=PARTS, prefix="ssfake_part"):
    """Part packages ``<prefix>N/data/partNN.bin`` on sys.path, and a table entry for them."""
    root = tmp_path / "site"
    for n, data in enumerate(parts, start=1):
        folder = root / f"{prefix}{n}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise RuntimeError('part packages are never imported')\n")
        (folder / f"part{n:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    joined = b"".join(parts)
    entry = dataclasses.replace(
        REASON_MODELS[SMALL], package=prefix + "{n}", distribution="ssfake-part{n}", parts=len(parts),
        size=len(joined), sha256=hashlib.sha256(joined).hexdigest(), gguf_name="fake.gguf",
    )
    monkeypatch.setitem(REASON_MODELS, "fake", entry)
    return entry, joined


def test_table_and_ids():
    assert set(REASON_MODELS) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    big, small = REASON_MODELS["qwen2.5-coder-1.5b-instruct"], REASON_MODELS[SMALL]
    assert (big.parts, big.size, big.layers) == (22, 1_117_320_768, 28)
    assert (small.parts, small.size, small.layers) == (6, 491_400_064, 24)
    # The hashes published for the official q4_k_m files (ASSETS.md gives their ends).
    assert big.sha256.startswith("cc324af0") and big.sha256.endswith("b046") and len(big.sha256) == 64
    assert small.sha256.startswith("1d961463") and small.sha256.endswith("ff32") and len(small.sha256) == 64
    assert reason_model("streamspec:Qwen2.5-Coder-0.5B-Instruct") is small
    assert reason_model("Qwen2.5-Coder-1.5B-Instruct") is big
    with pytest.raises(ValueError, match="unknown reasoning model"):
        reason_model("streamspec:Qwen2.5-72B")


def test_join_concatenates_in_order_without_importing(tmp_path, monkeypatch):
    entry, joined = _fake_packages(tmp_path, monkeypatch)
    assert packages_installed("fake")
    files = part_files("fake")
    assert [f.name for f in files] == ["part01.bin", "part02.bin", "part03.bin"]
    out = join_gguf("fake", tmp_path / "cache")
    assert out == tmp_path / "cache" / "fake.gguf" and out.read_bytes() == joined
    assert [p.name for p in out.parent.iterdir()] == ["fake.gguf"]  # no temporary file left
    assert join_gguf("fake", tmp_path / "cache") == out  # verified again, not rejoined


@pytest.mark.parametrize("field, value, message", [("size", 5, "bytes, expected 5"), ("sha256", "0" * 64, "sha256")])
def test_join_refuses_a_wrong_size_or_hash(tmp_path, monkeypatch, field, value, message):
    entry, _ = _fake_packages(tmp_path, monkeypatch)
    monkeypatch.setitem(REASON_MODELS, "fake", dataclasses.replace(entry, **{field: value}))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=message):
        join_gguf("fake", cache)
    assert list(cache.iterdir()) == []  # the bad file is deleted, nothing half-written stays
    with pytest.raises(ValueError, match=message):
        join_reason_model("fake", cache)  # the whole job refuses it before any conversion
    assert list(cache.iterdir()) == []


def test_a_corrupted_cached_file_is_replaced(tmp_path, monkeypatch):
    _, joined = _fake_packages(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"x" * len(joined))  # right size, wrong content
    assert join_gguf("fake", cache).read_bytes() == joined


def test_missing_packages_name_the_install_command(tmp_path, monkeypatch):
    entry, _ = _fake_packages(tmp_path, monkeypatch)
    monkeypatch.setitem(REASON_MODELS, "fake", dataclasses.replace(entry, parts=4))
    assert not packages_installed("fake")
    with pytest.raises(RuntimeError, match=r"ssfake-part4.*make reason-assets"):
        part_files("fake")
    monkeypatch.setenv("STREAMSPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="make reason-assets"):
        reason_model_path("fake")


def _tiny_gguf(path, architecture, layers):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(layers)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_metadata_is_checked(tmp_path):
    good = _tiny_gguf(tmp_path / "good.gguf", "qwen2", 24)
    assert gguf_metadata(good) == {"architecture": "qwen2", "layers": 24, "tensors": 0}
    assert check_gguf(good, SMALL)["layers"] == 24
    with pytest.raises(ValueError, match="expected qwen2 with 28"):
        check_gguf(good, "qwen2.5-coder-1.5b-instruct")
    with pytest.raises(ValueError, match="llama with 24"):
        check_gguf(_tiny_gguf(tmp_path / "llama.gguf", "llama", 24), SMALL)


def test_streamspec_ids_resolve_through_the_table(tmp_path, monkeypatch):
    """`load_base_model` / `load_tokenizer` take a ``streamspec:`` id: the converted folder is
    looked up in the cache (faked here), and other names pass through unchanged."""
    monkeypatch.setenv("STREAMSPEC_CACHE", str(tmp_path))
    folder = tmp_path / "Qwen2.5-Coder-0.5B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert assets.builtin_model_path("streamspec:Qwen2.5-Coder-0.5B-Instruct") == str(folder)
    assert assets.builtin_model_path("streamspec:qwen2.5-coder-0.5b-instruct") == str(folder)  # any case
    assert assets.builtin_model_path("org/some-model") == "org/some-model"
    for missing in ("streamspec:NoSuchModel", "streamspec:Qwen2.5-Coder-1.5B-Instruct"):  # not converted here
        with pytest.raises(FileNotFoundError, match="make reason-assets"):
            assets.builtin_model_path(missing)
    (folder / "config.json").unlink()  # a folder without a model is not one
    with pytest.raises(FileNotFoundError, match="make reason-assets"):
        assets.builtin_model_path("streamspec:Qwen2.5-Coder-0.5B-Instruct")


# ---------------------------------------------------------------------------------------------
# The real model: only where `make reason-assets` installed its packages


@pytest.mark.skipif(not packages_installed(SMALL), reason="opt-in: run `make reason-assets`")
def test_real_small_model_joins_loads_and_matches_its_metadata():
    import torch

    folder = reason_model_path(SMALL)  # joins and converts on first use (~1-2 min)
    gguf = folder.parent / REASON_MODELS[SMALL].gguf_name
    assert gguf.stat().st_size == REASON_MODELS[SMALL].size
    meta = check_gguf(gguf, SMALL)
    assert meta["tensors"] > 0
    model = assets.load_base_model("streamspec:Qwen2.5-Coder-0.5B-Instruct")
    tokenizer = assets.load_tokenizer("streamspec:Qwen2.5-Coder-0.5B-Instruct")
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 24, 896)
    assert config._name_or_path == "streamspec:Qwen2.5-Coder-0.5B-Instruct"
    assert not getattr(config, "quantization_config", None)
    assert tokenizer.chat_template and len(tokenizer) >= 151_000
    assert 600e6 < sum(p.numel() for p in model.parameters()) < 660e6  # untied LM head: 0.63 B
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert torch.isfinite(logits).all()
    assert tokenizer.decode(logits.argmax()).strip() == "Paris"


@pytest.mark.skipif(not packages_installed(SMALL), reason="opt-in: run `make reason-assets`")
def test_shipped_qwen_drafter_streams_keep_the_base_exact():
    """The Qwen2.5-Coder-0.5B drafter's shipped reasoning streams (streamspec/weights/) load by
    name onto the opt-in base, strictly, and decode its own greedy tokens on a GSM8K evaluation
    problem in SpecReason's framing, in fewer passes than tokens."""
    import torch

    from streamspec.data.reasoning import solve_message
    from streamspec.decoding.generate import generate
    from streamspec.loading import load_for_inference
    from streamspec.reason.tasks import load_problems

    loaded = load_for_inference("streamspec:qwen2.5-coder-0.5b-reason-streams", device="cpu", dtype="float32",
                                cpu_kernels=False)
    assert loaded.streamed and loaded.model.stream_config.mode == "lossless"
    tokenizer = loaded.tokenizer
    problem = load_problems(task="gsm8k", limit=1)[0].question
    text = tokenizer.apply_chat_template([{"role": "user", "content": solve_message(problem)}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    base = assets.load_base_model("streamspec:Qwen2.5-Coder-0.5B-Instruct").eval()
    with torch.no_grad():
        plain = base.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    out = generate(loaded.model, ids, 24, tree_top_k=(2, 1, 1), eos_token_id=tokenizer.eos_token_id)
    assert out.tokens[0].tolist() == plain[: out.tokens.shape[1]] and out.tokens.shape[1] == min(len(plain), 24)
    assert out.forward_passes < out.tokens.shape[1]
