"""Invariants of the stream patch on tiny random models of every supported architecture."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from conftest import HIDDEN, LAYERS, LORA_TARGETS, make_model, random_ids, reference_logits
from streamspec import StreamConfig, StreamedModel, add_streams

peft = pytest.importorskip("peft")

ATOL = 1e-5


def streamed(arch: str, seed: int = 0, **cfg) -> tuple[torch.nn.Module, StreamedModel]:
    """A tiny base model and a StreamedModel around it (γ = 3, Ns = 2 unless given)."""
    base = make_model(arch, seed)
    cfg.setdefault("num_streams", 3)
    cfg.setdefault("stream_layers", 2)
    torch.manual_seed(seed + 100)
    model = add_streams(base, StreamConfig(**cfg))
    return base, model.eval()


def pad_batch(seqs: list[torch.Tensor], length: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s)
        sl = slice(length - n, length) if side == "left" else slice(0, n)
        ids[i, sl] = s
        mask[i, sl] = 1
    return ids, mask


def completion_labels(ids: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Labels = ids on the real tokens after the first `prompt_len` real tokens, -100 elsewhere."""
    labels = ids.clone()
    rank = mask.cumsum(1) - 1
    labels[(mask == 0) | (rank < prompt_len)] = -100
    return labels


def lora_config(arch: str):
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS[arch],
        fan_in_fan_out=arch == "gpt2",
    )


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# lossless mode equals the base model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("init", ["identity", "lowrank", "value_rotation"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_lossless_logits_equal_base(arch, init, padded):
    seed = 3 if padded else 4
    base, model = streamed(arch, seed=seed, mode="lossless", stream_init=init)
    ids = random_ids(3, 9, seed)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0  # left padding
        mask[1, 6:] = 0  # right padding
    ref = reference_logits(base, ids, mask)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref[real], atol=ATOL, rtol=0)
    # streams were really computed (so the equality is not trivial)
    assert torch.equal(out.stream_mask, real)
    assert torch.isfinite(out.stream_logits[real]).all()
    # base is frozen, stream parameters are trainable
    assert not any(p.requires_grad for p in model.base.parameters())
    assert all(p.requires_grad for p in model.streams.parameters())


def test_lossless_with_eager_attention_equals_base():
    base = make_model("llama", seed=5, attn_implementation="eager")
    model = add_streams(base, StreamConfig(num_streams=2, stream_layers=3, mode="lossless")).eval()
    ids = random_ids(2, 7, 5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ref = reference_logits(base, ids, mask)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)


def test_lossless_logits_independent_of_labels(arch):
    """In lossless mode the carrying pattern (decided by labels) must not change main logits."""
    _, model = streamed(arch, seed=6, mode="lossless")
    ids = random_ids(2, 8, 6)
    mask = torch.ones_like(ids)
    labels = completion_labels(ids, mask, prompt_len=4)
    with torch.no_grad():
        a = model(ids, attention_mask=mask)
        b = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(a.early_exit_logits, b.early_exit_logits, atol=ATOL, rtol=0)
    # the streams of a carrying position are the same whichever other positions carry
    carry = b.stream_mask
    assert carry.sum() < carry.numel()
    torch.testing.assert_close(a.stream_logits[carry], b.stream_logits[carry], atol=ATOL, rtol=0)


def test_streamed_forward_leaves_base_model_untouched(arch):
    """Value-rotation hooks must be removed after the call; the base model stays the base model."""
    base, model = streamed(arch, seed=7, stream_init="value_rotation")
    ids = random_ids(2, 6, 7)
    before = reference_logits(base, ids)
    with torch.no_grad():
        model(ids)
    after = reference_logits(base, ids)
    assert torch.equal(before, after)
    for layer in model.layers:
        assert len(layer.get_submodule(model.arch.value_proj)._forward_hooks) == 0


# ---------------------------------------------------------------------------------------------
# no leakage from the future
# ---------------------------------------------------------------------------------------------
def _assert_prefix_equal(a, b, t):
    torch.testing.assert_close(a.logits[:, : t + 1], b.logits[:, : t + 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(a.early_exit_logits[:, : t + 1], b.early_exit_logits[:, : t + 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(
        a.stream_logits[:, : t + 1], b.stream_logits[:, : t + 1], atol=ATOL, rtol=0, equal_nan=True
    )
    assert torch.equal(a.stream_mask[:, : t + 1], b.stream_mask[:, : t + 1])


@pytest.mark.parametrize("mode", ["shared", "lossless"])
@pytest.mark.parametrize("with_labels", [False, True], ids=["nolabels", "labels"])
def test_no_leakage_from_future_tokens(arch, mode, with_labels):
    seed = 11 if mode == "shared" else 12
    _, model = streamed(arch, seed=seed, mode=mode, stream_layers=3)
    T = 9
    ids = random_ids(2, T, seed)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the second row
    labels = completion_labels(ids, mask, prompt_len=2) if with_labels else None
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    for t in (2, 4, 7):
        changed = ids.clone()
        changed[:, t + 1 :] = random_ids(2, T - t - 1, seed + t + 1000)
        assert not torch.equal(changed, ids)
        new_labels = None
        if with_labels:
            # same label structure, new values after t
            new_labels = torch.where(labels == -100, labels, changed)
        with torch.no_grad():
            out = model(changed, attention_mask=mask, labels=new_labels, return_logits=True)
        _assert_prefix_equal(out, ref, t)
        # and the test can fail: something after t changed
        assert not torch.allclose(out.logits[:, t + 1 :], ref.logits[:, t + 1 :], atol=ATOL)


# ---------------------------------------------------------------------------------------------
# within a position, stream j depends on streams 1..j only
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,stream_layers",
    [("lossless", 2), ("lossless", 3), ("shared", 1)],
    ids=["lossless-Ns2", "lossless-Ns3", "shared-Ns1"],
)
def test_stream_depends_only_on_lower_streams(arch, mode, stream_layers):
    g = 3
    _, model = streamed(arch, seed=21, mode=mode, stream_layers=stream_layers, num_streams=g)
    ids = random_ids(2, 6, 21)
    with torch.no_grad():
        ref = model(ids)
    emb = model.streams.stream_embeddings
    for k in range(g):  # perturb stream k+1 (0-based row k)
        with torch.no_grad():
            saved = emb[k].clone()
            emb[k] += torch.randn(HIDDEN, generator=torch.Generator().manual_seed(k)) * 2.0
            out = model(ids)
            emb[k] = saved
        # streams 1..k (0-based :k) are unchanged
        torch.testing.assert_close(out.stream_logits[:, :, :k], ref.stream_logits[:, :, :k], atol=1e-6, rtol=0)
        # stream k+1 itself changes (so the check above could fail)
        assert not torch.allclose(out.stream_logits[:, :, k], ref.stream_logits[:, :, k], atol=1e-4)
        # early-exit logits never see streams
        torch.testing.assert_close(out.early_exit_logits, ref.early_exit_logits, atol=1e-6, rtol=0)
        # main sees its own streams in shared mode only
        if mode == "lossless":
            torch.testing.assert_close(out.logits, ref.logits, atol=1e-6, rtol=0)
        else:
            assert not torch.allclose(out.logits, ref.logits, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# padding side does not matter
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_left_and_right_padding_agree_with_unpadded(arch, mode):
    _, model = streamed(arch, seed=31, mode=mode, stream_layers=2)
    seqs = [random_ids(1, 7, 31)[0], random_ids(1, 4, 32)[0], random_ids(1, 1, 33)[0]]
    singles = []
    with torch.no_grad():
        for s in seqs:
            singles.append(model(s[None]))
        for side in ("left", "right"):
            ids, mask = pad_batch(seqs, 7, side)
            out = model(ids, attention_mask=mask)
            assert torch.equal(out.stream_mask, mask.bool())
            for i, (s, single) in enumerate(zip(seqs, singles)):
                real = mask[i].bool()
                torch.testing.assert_close(out.logits[i, real], single.logits[0], atol=ATOL, rtol=0)
                torch.testing.assert_close(out.stream_logits[i, real], single.stream_logits[0], atol=ATOL, rtol=0)
                torch.testing.assert_close(
                    out.early_exit_logits[i, real], single.early_exit_logits[0], atol=ATOL, rtol=0
                )
                # padding positions carry no streams: NaN
                assert torch.isnan(out.stream_logits[i, ~real]).all()


@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_fully_padded_row_changes_nothing(arch, mode):
    _, model = streamed(arch, seed=36, mode=mode)
    ids = random_ids(2, 5, 36)
    mask = torch.ones_like(ids)
    mask[1] = 0
    labels = ids.clone()
    labels[0, :2] = -100
    labels[1] = -100
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, labels=labels, return_logits=True)
        alone = model(ids[:1], labels=labels[:1], return_logits=True)
    assert not batch.stream_mask[1].any()
    assert torch.isfinite(batch.logits).all() and torch.isfinite(batch.early_exit_logits).all()
    torch.testing.assert_close(batch.logits[0], alone.logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(batch.stream_logits[0], alone.stream_logits[0], atol=ATOL, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.loss, alone.loss, atol=ATOL, rtol=0)


def test_left_and_right_padding_give_same_loss(arch):
    _, model = streamed(arch, seed=34, mode="shared")
    seqs = [random_ids(1, 8, 34)[0], random_ids(1, 5, 35)[0]]
    parts = []
    with torch.no_grad():
        for side in ("left", "right"):
            ids, mask = pad_batch(seqs, 8, side)
            labels = completion_labels(ids, mask, prompt_len=2)
            out = model(ids, attention_mask=mask, labels=labels)
            parts.append(out)
    torch.testing.assert_close(parts[0].loss, parts[1].loss, atol=ATOL, rtol=0)
    for name in parts[0].loss_parts:
        torch.testing.assert_close(parts[0].loss_parts[name], parts[1].loss_parts[name], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------
def _naive_parts(out, labels, g, stream_targets="labels"):
    B, T = labels.shape
    rows = {"main": ([], []), "early_exit": ([], [])}
    rows.update({f"stream_{j}": ([], []) for j in range(1, g + 1)})
    for b in range(B):
        for t in range(T):
            if t + 1 < T and labels[b, t + 1] != -100:
                rows["main"][0].append(out.logits[b, t])
                rows["main"][1].append(labels[b, t + 1])
                rows["early_exit"][0].append(out.early_exit_logits[b, t])
                rows["early_exit"][1].append(labels[b, t + 1])
            if not out.stream_mask[b, t]:
                continue
            for j in range(1, g + 1):
                if t + 1 + j < T and labels[b, t + 1 + j] != -100:
                    rows[f"stream_{j}"][0].append(out.stream_logits[b, t, j - 1])
                    # "main": the main stream's own top-1 prediction of token t+1+j (made at t+j)
                    target = labels[b, t + 1 + j] if stream_targets == "labels" else out.logits[b, t + j].argmax()
                    rows[f"stream_{j}"][1].append(target)
    parts = {}
    for name, (logits, targets) in rows.items():
        assert logits, f"test batch gives no target for {name}"
        parts[name] = F.cross_entropy(torch.stack(logits), torch.stack(targets))
    return parts


@pytest.mark.parametrize("mode", ["shared", "lossless"])
@pytest.mark.parametrize("stream_targets", ["labels", "main"])
def test_loss_parts_match_naive_computation(arch, mode, stream_targets):
    g = 3
    weights = [0.3, 0.2, 0.5]
    main_weight = 0.7 if mode == "shared" else 0.0
    _, model = streamed(
        arch, seed=41, mode=mode, num_streams=g, main_weight=main_weight, stream_weights=weights, stream_layers=2,
        stream_targets=stream_targets,
    )
    seqs = [random_ids(1, 10, 41)[0], random_ids(1, 7, 42)[0]]
    ids, mask = pad_batch(seqs, 10, "left")
    labels = completion_labels(ids, mask, prompt_len=3)
    labels[0, 8] = -100  # a hole inside a completion
    with torch.no_grad():
        # make the early-exit adapter (zero at init) act, so its two code paths are compared
        model.streams.exit_up.weight.normal_(std=0.3)
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    expected_carry = torch.zeros_like(mask, dtype=torch.bool)
    expected_carry[:, :-1] = labels[:, 1:] != -100
    assert torch.equal(out.stream_mask, expected_carry)
    assert torch.isnan(out.stream_logits[~expected_carry]).all()
    assert torch.isfinite(out.stream_logits[expected_carry]).all()

    naive = _naive_parts(out, labels, g, stream_targets)
    if stream_targets == "main":  # the test can tell the two targets apart
        assert not torch.allclose(naive["stream_1"], _naive_parts(out, labels, g)["stream_1"])
    assert set(out.loss_parts) == {"main", "early_exit", *(f"stream_{j}" for j in range(1, g + 1))}
    for name, value in naive.items():
        torch.testing.assert_close(out.loss_parts[name], value, atol=1e-5, rtol=1e-5, msg=name)
    total = main_weight * naive["main"] + sum(w * naive[f"stream_{j + 1}"] for j, w in enumerate(weights))
    total = total + naive["early_exit"]
    torch.testing.assert_close(out.loss, total, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stream_layers", [1, 3])
def test_early_exit_is_logit_lens_at_init(arch, stream_layers):
    """Early-exit logits read the input of layer N−Ns through the adapter and the model's own head;
    the adapter starts as the identity."""
    base, model = streamed(arch, seed=45, stream_layers=stream_layers)
    ids = random_ids(2, 6, 45)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    from streamspec.patch.layout import position_ids_from_mask

    with torch.no_grad():
        hf = base(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask.bool()),
            output_hidden_states=True,
        )
        lens = model.head(hf.hidden_states[LAYERS - stream_layers])
        out = model(ids, attention_mask=mask)
        real = mask.bool()
        torch.testing.assert_close(out.early_exit_logits[real], lens[real], atol=ATOL, rtol=0)
        model.streams.exit_up.weight.normal_(std=0.3)
        moved = model(ids, attention_mask=mask)
        expected = model.head(model.streams.early_exit(hf.hidden_states[LAYERS - stream_layers]))
    assert not torch.allclose(moved.early_exit_logits[real], lens[real], atol=1e-4)
    torch.testing.assert_close(moved.early_exit_logits[real], expected[real], atol=ATOL, rtol=0)


def test_labels_default_returns_no_logits_and_small_chunks_agree(arch):
    _, model = streamed(arch, seed=43)
    ids = random_ids(2, 8, 43)
    labels = completion_labels(ids, torch.ones_like(ids), prompt_len=2)
    with torch.no_grad():
        a = model(ids, labels=labels)
        b = model(ids, labels=labels, loss_chunk_size=2)
    assert a.logits is None and a.stream_logits is None and a.early_exit_logits is None
    assert a.loss is not None and a.loss.dim() == 0
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    for name in a.loss_parts:
        torch.testing.assert_close(a.loss_parts[name], b.loss_parts[name], atol=1e-5, rtol=1e-5)


def test_no_carrying_position_gives_zero_stream_loss():
    _, model = streamed("llama", seed=44)
    ids = random_ids(2, 5, 44)
    labels = torch.full_like(ids, -100)
    labels[:, 0] = ids[:, 0]  # a target at position 0 is nobody's next token
    with torch.no_grad():
        out = model(ids, labels=labels, return_logits=True)
    assert not out.stream_mask.any()
    assert torch.isnan(out.stream_logits).all()
    for name, value in out.loss_parts.items():
        assert value.item() == 0.0, name
    assert out.loss.item() == 0.0


# ---------------------------------------------------------------------------------------------
# gradients and training
# ---------------------------------------------------------------------------------------------
def _train_batch(arch, seed):
    seqs = [random_ids(1, 10, seed)[0], random_ids(1, 8, seed + 1)[0]]
    ids, mask = pad_batch(seqs, 10, "right")
    return ids, mask, completion_labels(ids, mask, prompt_len=3)


def test_gradients_reach_stream_parameters(arch):
    _, model = streamed(arch, seed=51, stream_init="lowrank", init_rank=4)
    model.train()
    ids, mask, labels = _train_batch(arch, 51)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    s = model.streams
    assert s.stream_embeddings.grad is not None
    assert (s.stream_embeddings.grad.abs().sum(dim=1) > 0).all(), "every stream identifier gets a gradient"
    assert s.exit_up.weight.grad.abs().sum() > 0
    # exit_up starts at zero, so exit_down has no gradient on the first step ...
    assert s.exit_down.weight.grad.abs().sum() == 0
    # init_up starts at zero (f = identity) but is itself trained
    assert s.init_up.weight.grad.abs().sum() > 0
    # ... shared mode without LoRA trains the base too
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.base.parameters())
    # ... and once exit_up is non-zero, exit_down gets a gradient as well
    model.zero_grad()
    with torch.no_grad():
        s.exit_up.weight.normal_(std=0.1)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    assert s.exit_down.weight.grad.abs().sum() > 0


def _early_exit_only_backward(arch):
    _, model = streamed(arch, seed=52, main_weight=0.0, stream_weights=0.0)
    model.train()
    ids, mask, labels = _train_batch(arch, 52)
    out = model(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, out.loss_parts["early_exit"])
    out.loss.backward()
    return model


def _has_grad(p):
    return p.grad is not None and p.grad.abs().sum() > 0


def test_early_exit_loss_does_not_train_decoder_layers(arch):
    """The early-exit input is detached: its loss trains the adapter, never the decoder layers."""
    model = _early_exit_only_backward(arch)
    assert _has_grad(model.streams.exit_up.weight)
    for name, p in model.layers.named_parameters():
        assert not _has_grad(p), name
    assert not _has_grad(model.streams.stream_embeddings)


def test_early_exit_loss_does_not_train_base_head(arch):
    model = _early_exit_only_backward(arch)
    for name, p in model.base.named_parameters():
        assert not _has_grad(p), name


def test_lora_gradients_and_identity_at_init(arch):
    base, model = streamed(arch, seed=53, mode="shared")
    ids, mask, labels = _train_batch(arch, 53)
    with torch.no_grad():
        before = model(ids, attention_mask=mask)
    model.add_lora(lora_config(arch))
    assert model.has_lora
    assert model.hf_model is base
    with torch.no_grad():
        after = model(ids, attention_mask=mask)
    # LoRA starts at zero: nothing changes yet
    torch.testing.assert_close(after.logits, before.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(after.stream_logits, before.stream_logits, atol=ATOL, rtol=0, equal_nan=True)

    model.train()
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    lora_b = [(n, p) for n, p in model.base.named_parameters() if "lora_B" in n]
    lora_a = [(n, p) for n, p in model.base.named_parameters() if "lora_A" in n]
    assert lora_b and lora_a
    assert all(p.requires_grad for _, p in lora_a + lora_b)
    for n, p in lora_b:
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    # non-LoRA base weights are frozen by peft; stream parameters stay trainable
    for n, p in model.base.named_parameters():
        if "lora_" not in n:
            assert not p.requires_grad, n
    assert model.streams.stream_embeddings.grad.abs().sum() > 0

    with pytest.raises(ValueError, match="already"):
        model.add_lora(lora_config(arch))


def test_lora_refused_in_lossless_mode():
    _, model = streamed("llama", seed=54, mode="lossless")
    with pytest.raises(ValueError, match="lossless"):
        model.add_lora(lora_config("llama"))
    wrapped = peft.get_peft_model(make_model("llama", seed=54), lora_config("llama"))
    with pytest.raises(ValueError, match="lossless"):
        add_streams(wrapped, StreamConfig(stream_layers=2, mode="lossless"))


def _steps(model, ids, mask, labels, n=6):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    model.train()
    first = None
    for _ in range(n):
        opt.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        opt.step()
        if first is None:
            first = out
    model.eval()
    with torch.no_grad():
        last = model(ids, attention_mask=mask, labels=labels)
    return first, last


def test_adamw_steps_lower_loss_shared_lora(arch):
    _, model = streamed(arch, seed=55, mode="shared")
    model.add_lora(lora_config(arch))
    ids, mask, labels = _train_batch(arch, 55)
    first, last = _steps(model, ids, mask, labels)
    assert last.loss < first.loss - 0.05, (first.loss, last.loss)


def test_adamw_steps_lossless_keep_main_exact(arch):
    base, model = streamed(arch, seed=56, mode="lossless", main_weight=0.0, stream_weights=1.0)
    ids, mask, labels = _train_batch(arch, 56)
    ref = reference_logits(base, ids, mask)
    first, last = _steps(model, ids, mask, labels)
    assert last.loss < first.loss - 0.05, (first.loss, last.loss)
    for j in (1, 2, 3):
        assert last.loss_parts[f"stream_{j}"] < first.loss_parts[f"stream_{j}"]
    # the base never moved, so the main loss and logits are unchanged
    torch.testing.assert_close(last.loss_parts["main"], first.loss_parts["main"], atol=1e-5, rtol=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# parameter overhead and stream inits
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("init", ["identity", "lowrank", "value_rotation"])
def test_parameter_overhead(arch, init):
    g, prune, rank = 3, 4, 5
    base = make_model(arch, seed=61)
    n_base = sum(p.numel() for p in base.parameters())
    cfg = StreamConfig(
        num_streams=g, stream_layers=2, stream_init=init, init_rank=rank if init == "lowrank" else None, prune_rank=prune
    )
    model = add_streams(base, cfg)
    h = HIDDEN
    expected = (g * h if init != "value_rotation" else 0) + (2 * h * rank if init == "lowrank" else 0) + 2 * h * prune
    assert model.num_stream_parameters() == expected
    assert sum(p.numel() for p in model.streams.parameters()) == expected
    assert sum(p.numel() for p in model.parameters()) == n_base + expected
    assert hasattr(model.streams, "stream_embeddings") == (init != "value_rotation")


def test_lowrank_default_rank_and_overhead():
    cfg = StreamConfig(stream_init="lowrank", num_streams=2, stream_layers=2, prune_rank=8)
    assert cfg.init_rank == 8
    model = add_streams(make_model("qwen2", seed=62), cfg)
    assert model.num_stream_parameters() == 2 * HIDDEN + 2 * HIDDEN * 8 + 2 * HIDDEN * 8


def test_lowrank_starts_as_identity(arch):
    _, ident = streamed(arch, seed=63, stream_init="identity")
    _, low = streamed(arch, seed=63, stream_init="lowrank", init_rank=3)
    with torch.no_grad():
        low.streams.stream_embeddings.copy_(ident.streams.stream_embeddings)
        low.streams.exit_down.weight.copy_(ident.streams.exit_down.weight)
    ids = random_ids(2, 6, 63)
    with torch.no_grad():
        a, b = ident(ids), low(ids)
    torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(a.stream_logits, b.stream_logits, atol=ATOL, rtol=0)
    # and the map does act once trained
    with torch.no_grad():
        low.streams.init_up.weight.normal_(std=0.5)
        c = low(ids)
    assert not torch.allclose(c.stream_logits, b.stream_logits, atol=1e-4)


@pytest.mark.parametrize("mode", ["shared", "lossless"])
def test_value_rotation_streams_differ(arch, mode):
    g = 3
    _, model = streamed(arch, seed=64, stream_init="value_rotation", num_streams=g, mode=mode)
    ids = random_ids(2, 6, 64)
    with torch.no_grad():
        out = model(ids)
    sl = out.stream_logits
    assert torch.isfinite(sl).all()
    for i in range(g):
        for j in range(i + 1, g):
            assert not torch.allclose(sl[:, :, i], sl[:, :, j], atol=1e-4), (i, j)
    # The streams above could differ through attention alone (stream j sees j copies of its
    # state). Check the rotation itself acts: the same model without rotation (identity init with
    # zero identifiers, so every stream starts as a copy of main, as in value_rotation) differs.
    _, plain_model = streamed(arch, seed=64, stream_init="identity", num_streams=g, mode=mode)
    with torch.no_grad():
        plain_model.streams.stream_embeddings.zero_()
        plain = plain_model(ids)
    if mode == "lossless":  # same base weights: main is the base model in both
        torch.testing.assert_close(plain.logits, out.logits, atol=ATOL, rtol=0)
    for j in range(g):
        assert not torch.allclose(plain.stream_logits[:, :, j], sl[:, :, j], atol=1e-4), j


def test_stream_identifiers_scale_with_the_main_state():
    """S_j = M + rms(M)·P_j: the same identifiers set streams apart at any hidden-state scale."""
    streams = add_streams(make_model("llama"), StreamConfig(stream_layers=2)).streams
    main = torch.randn(2, 5, HIDDEN)
    for scale in (1e-2, 1.0, 300.0):
        out = streams.make_streams(main * scale)
        rms = (main * scale).pow(2).mean(-1, keepdim=True).sqrt()
        expected = (main * scale)[:, :, None] + rms[:, :, None] * streams.stream_embeddings
        torch.testing.assert_close(out, expected)
        # Each stream sits ||P_j||/sqrt(h) away from its main state, relative to the state's norm.
        relative = (out - (main * scale)[:, :, None]).norm(dim=-1) / (main * scale).norm(dim=-1)[:, :, None]
        expected_relative = streams.stream_embeddings.detach().norm(dim=-1) / HIDDEN**0.5
        torch.testing.assert_close(relative, expected_relative.expand_as(relative), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# streams that read the next token (next_token_input)
# ---------------------------------------------------------------------------------------------
def test_next_token_input_starts_as_the_plain_streams_and_reads_only_the_next_token(arch):
    """With its map at zero the streams are the plain streams' exactly; trained, stream j at t reads
    the token at t+1 and nothing after it, and the main stream never reads it (lossless)."""
    _, plain = streamed(arch, seed=5, mode="lossless")
    _, reads = streamed(arch, seed=5, mode="lossless", next_token_input=True)
    reads.streams.load_state_dict({**plain.streams.state_dict(), "next_token_map.weight":
                                   reads.streams.next_token_map.weight}, strict=True)
    T = 8
    ids = random_ids(2, T, 5)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a, b = plain(ids, attention_mask=mask), reads(ids, attention_mask=mask)
        torch.testing.assert_close(b.stream_logits, a.stream_logits)
        reads.streams.next_token_map.weight.normal_(0, 0.5)
        ref = reads(ids, attention_mask=mask)
        t = 3
        changed = ids.clone()
        changed[:, t + 1] = (ids[:, t + 1] + 1) % 50
        out = reads(changed, attention_mask=mask)
    torch.testing.assert_close(out.logits[:, : t + 1], ref.logits[:, : t + 1])  # main rows: causal, as the base's
    torch.testing.assert_close(out.stream_logits[:, :t], ref.stream_logits[:, :t])  # earlier streams never see it
    assert not torch.allclose(out.stream_logits[:, t], ref.stream_logits[:, t], atol=ATOL)  # stream at t reads t+1
    later = ids.clone()
    later[:, t + 2 :] = (ids[:, t + 2 :] + 1) % 50
    with torch.no_grad():
        torch.testing.assert_close(reads(later, attention_mask=mask).stream_logits[:, t], ref.stream_logits[:, t])


def test_next_token_input_is_refused_where_it_cannot_run():
    """Shared mode (the main stream would read the token it predicts), streamspec's decoders (they
    draft inside the verify pass, where the next token is not known) and the vLLM export in the
    P-EAGLE layout (its drafter is not handed the token)."""
    from streamspec.patch.saving import CheckpointError
    from streamspec.vllm.export import check_exportable

    with pytest.raises(ValueError, match="next_token_input needs mode='lossless'"):
        StreamConfig(next_token_input=True, mode="shared")
    with pytest.raises(ValueError, match="next_token_input must be true or false"):
        StreamConfig(next_token_input="yes", mode="lossless")
    _, model = streamed("llama", mode="lossless", next_token_input=True)
    from streamspec.decoding.generate import generate

    with pytest.raises(ValueError, match="read the token after each position"):
        generate(model, random_ids(1, 6, 1), max_new_tokens=4)
    with pytest.raises(CheckpointError, match="next_token_input.*'dflash' layout only"):
        check_exportable(model.stream_config, "llama", "peagle")
    check_exportable(model.stream_config, "llama", "dflash")  # vLLM hands the DFlash drafter that token
