"""Pure tests of streamspec.patch.layout and streamspec.decoding.cache (no model involved)."""

from __future__ import annotations

import itertools

import pytest
import torch

from streamspec.decoding.cache import MainStreamCache
from streamspec.patch.layout import (
    carrying_positions,
    causal,
    main_allowed,
    position_ids_from_mask,
    stream_allowed,
    stream_position_ids,
    stream_slots,
    to_bias,
)

B = torch.tensor


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# carrying_positions
# ---------------------------------------------------------------------------------------------
def test_carrying_without_labels_is_every_real_position():
    real = B([[False, True, True, True], [True, True, False, False]])
    carry = carrying_positions(real, None)
    assert torch.equal(carry, real)
    assert carry.data_ptr() != real.data_ptr(), "must be a copy, not the caller's tensor"
    carry[0, 0] = True
    assert not real[0, 0]


def test_carrying_with_labels_follows_next_label():
    real = torch.ones(2, 6, dtype=torch.bool)
    labels = B([[-100, -100, -100, 5, 6, 7], [-100, 4, -100, 5, -100, -100]])
    carry = carrying_positions(real, labels)
    expected = B([[False, False, True, True, True, False], [True, False, True, False, False, False]])
    assert torch.equal(carry, expected)


def test_carrying_with_labels_excludes_padding_and_last_position():
    # left padding: two padding positions, labels -100 there
    real = B([[False, False, True, True, True], [True, True, True, True, True]])
    labels = B([[-100, -100, -100, 8, 9], [1, 2, 3, 4, 5]])
    carry = carrying_positions(real, labels)
    assert torch.equal(carry, B([[False, False, True, True, False], [True, True, True, True, False]]))
    # a (malformed) label at padding after a padding query never makes the padding query carry
    labels2 = B([[-100, 7, -100, 8, 9], [1, 2, 3, 4, 5]])
    carry2 = carrying_positions(real, labels2)
    assert not carry2[0, 0]


# ---------------------------------------------------------------------------------------------
# stream_slots
# ---------------------------------------------------------------------------------------------
def test_stream_slots_orders_carrying_positions_and_marks_valid():
    carry = B(
        [
            [False, True, False, True, True, False],
            [True, False, False, False, False, False],
            [False, False, False, False, False, False],
        ]
    )
    index, valid = stream_slots(carry)
    assert index.shape == (3, 3) and valid.shape == (3, 3)
    assert index[0].tolist() == [1, 3, 4]
    assert valid.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert index[1, 0].item() == 0
    # padding slots point at non-carrying positions of their row
    for b, s in zip(*torch.nonzero(~valid, as_tuple=True)):
        assert not carry[b, index[b, s]]


def test_stream_slots_random_matches_bruteforce():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        carry = torch.rand(4, 9, generator=gen) < 0.4
        index, valid = stream_slots(carry)
        assert index.shape[1] == int(carry.sum(1).max())
        for b in range(4):
            pos = torch.nonzero(carry[b]).flatten().tolist()
            assert index[b, : len(pos)].tolist() == pos
            assert valid[b].tolist() == [s < len(pos) for s in range(index.shape[1])]


def test_stream_slots_no_carrying_position():
    index, valid = stream_slots(torch.zeros(2, 5, dtype=torch.bool))
    assert index.shape == (2, 0) and valid.shape == (2, 0)


# ---------------------------------------------------------------------------------------------
# position ids
# ---------------------------------------------------------------------------------------------
def test_position_ids_from_mask_left_and_right_padding():
    real = B([[False, False, True, True, True], [True, True, True, False, False], [True] * 5])
    pos = position_ids_from_mask(real)
    assert pos[0, 2:].tolist() == [0, 1, 2]
    assert pos[1, :3].tolist() == [0, 1, 2]
    assert pos[2].tolist() == [0, 1, 2, 3, 4]
    assert (pos >= 0).all()


def test_stream_position_ids_are_pos_plus_j_slot_major():
    position_ids = B([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    index = B([[3, 5], [0, 2]])
    g = 3
    out = stream_position_ids(position_ids, index, g)
    assert out.shape == (2, 2 * g)
    for b in range(2):
        for s in range(2):
            for j in range(1, g + 1):
                assert out[b, s * g + j - 1].item() == position_ids[b, index[b, s]].item() + j
    assert out[0].tolist() == [2, 3, 4, 4, 5, 6]


# ---------------------------------------------------------------------------------------------
# main_allowed
# ---------------------------------------------------------------------------------------------
def test_causal_is_lower_triangular():
    c = causal(4)
    assert c.shape == (1, 4, 4)
    assert torch.equal(c[0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_main_allowed_padding_no_past():
    real = B([[False, True, True, True], [True, True, True, False]])
    allowed = main_allowed(causal(4), real)
    assert allowed.shape == (2, 4, 4)
    for b, q, k in itertools.product(range(2), range(4), range(4)):
        expected = bool(k <= q and real[b, k])
        if not real[b, q] and k == q:  # a padding query also sees itself (no empty row)
            expected = True
        assert allowed[b, q, k].item() == expected, (b, q, k)


def test_main_allowed_with_past_keys():
    past, new = 3, 2
    key_real = B([[False, True, True, True, True], [True, True, True, True, False]])
    allowed = main_allowed(causal(new), key_real)
    assert allowed.shape == (2, new, past + new)
    # real queries see every real past key and causal real new keys
    assert allowed[0].tolist() == [[False, True, True, True, False], [False, True, True, True, True]]
    # second row: new query 1 is padding: it sees the real keys and itself, never another padding key
    assert allowed[1].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    # a real query never sees a padding key
    assert not allowed[0, :, 0].any()
    assert not allowed[1, 0, 4]


def test_main_allowed_respects_tree_mask():
    tree = B([[[True, False, False], [True, True, False], [True, False, True]]])
    key_real = torch.ones(1, 5, dtype=torch.bool)
    allowed = main_allowed(tree, key_real)
    assert allowed[0, :, :2].all()
    assert torch.equal(allowed[0, :, 2:], tree[0])


# ---------------------------------------------------------------------------------------------
# stream_allowed
# ---------------------------------------------------------------------------------------------
def _reference_stream_allowed(main_ok, index, valid, g, shared):
    """Brute-force the METHOD §1 rules, one (query, key) pair at a time."""
    batch, T, K = main_ok.shape
    S = index.shape[1]
    Q = T + S * g
    out = torch.zeros(batch, Q, K + S * g, dtype=torch.bool)
    for b in range(batch):
        for q in range(Q):
            if q < T:
                q_pos, q_slot, q_j = q, None, 0
            else:
                q_slot, q_j = divmod(q - T, g)
                q_j += 1
                q_pos = index[b, q_slot].item()
            for k in range(K + S * g):
                if k < K:  # a main key (past or new)
                    out[b, q, k] = main_ok[b, q_pos, k]
                else:
                    k_slot, k_j = divmod(k - K, g)
                    k_j += 1
                    if q_slot is None:  # main query -> stream key
                        out[b, q, k] = bool(
                            shared and valid[b, k_slot] and index[b, k_slot].item() == q_pos
                        )
                    else:  # stream query -> stream key
                        out[b, q, k] = bool(k_slot == q_slot and k_j <= q_j)
    return out


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("past", [0, 2])
def test_stream_allowed_matches_bruteforce(shared, past):
    gen = torch.Generator().manual_seed(7 + past)
    g, T, batch = 3, 5, 3
    for _ in range(4):
        real_new = torch.rand(batch, T, generator=gen) < 0.8
        key_real = torch.cat([torch.ones(batch, past, dtype=torch.bool), real_new], dim=1)
        main_ok = main_allowed(causal(T), key_real)
        carry = real_new & (torch.rand(batch, T, generator=gen) < 0.6)
        index, valid = stream_slots(carry)
        got = stream_allowed(main_ok, index, valid, g, shared)
        assert got.shape == (batch, T + index.shape[1] * g, past + T + index.shape[1] * g)
        assert torch.equal(got, _reference_stream_allowed(main_ok, index, valid, g, shared))


def test_stream_allowed_rules_explicit():
    """Two carrying positions, γ = 2, no past, no padding: the rules spelled out."""
    T, g = 3, 2
    main_ok = main_allowed(causal(T), torch.ones(1, T, dtype=torch.bool))
    index, valid = B([[0, 2]]), B([[True, True]])
    for shared in (True, False):
        a = stream_allowed(main_ok, index, valid, g, shared)[0]
        # columns: main 0..2, slot0 stream1, slot0 stream2, slot1 stream1, slot1 stream2 -> 3..6
        s01, s02, s21, s22 = 3, 4, 5, 6
        # stream j sees streams 1..j of its own slot only
        assert a[s01, s01] and not a[s01, s02]
        assert a[s02, s01] and a[s02, s02]
        assert not a[s21, s01] and not a[s21, s02] and not a[s22, s01] and not a[s22, s02]
        assert a[s22, s21] and a[s22, s22] and not a[s21, s22]
        # streams see main keys <= their position
        assert a[s01, 0] and not a[s01, 1] and not a[s01, 2]
        assert a[s21, :3].all()
        # main t sees its own streams only in shared mode, never another position's
        assert a[0, s01].item() == shared and a[0, s02].item() == shared
        assert a[2, s21].item() == shared and a[2, s22].item() == shared
        assert not a[1, 3:].any()
        assert not a[2, s01] and not a[2, s02]
        assert not a[0, s21] and not a[0, s22]
        # main-to-main part is unchanged
        assert torch.equal(a[:T, :T], main_ok[0])


def test_stream_allowed_invalid_slots_invisible_to_main():
    T, g = 3, 2
    carry = B([[False, True, True], [True, False, False]])
    index, valid = stream_slots(carry)
    main_ok = main_allowed(causal(T), torch.ones(2, T, dtype=torch.bool))
    a = stream_allowed(main_ok, index, valid, g, shared=True)
    # row 1 has a single valid slot (slot 0); its padding slot 1 points to a non-carrying
    # position, no main query may see it
    assert not a[1, :T, T + g :].any()
    # every query row has at least one visible key (no empty softmax)
    assert a.any(dim=-1).all()


def test_to_bias():
    allowed = B([[[True, False], [True, True]]])
    bias = to_bias(allowed, torch.float32)
    assert bias.shape == (1, 1, 2, 2)
    assert bias[0, 0, 0, 0] == 0 and bias[0, 0, 1, 0] == 0 and bias[0, 0, 1, 1] == 0
    assert bias[0, 0, 0, 1] == torch.finfo(torch.float32).min
    assert to_bias(allowed, torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# MainStreamCache
# ---------------------------------------------------------------------------------------------
def _kv(length, seed, batch=2, heads=2, dim=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, length, dim, generator=gen), torch.randn(batch, heads, length, dim, generator=gen)


def test_cache_stores_all_when_main_length_unset():
    cache = MainStreamCache(num_layers=2)
    k, v = _kv(5, 0)
    rk, rv = cache.update(k, v, 0)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert cache.get_seq_length(0) == 5
    assert cache.get_seq_length(1) == 0
    assert cache.keys[1] is None


def test_cache_stores_only_main_entries_and_returns_past_plus_all():
    cache = MainStreamCache(num_layers=1)
    k0, v0 = _kv(3, 0)
    cache.update(k0, v0, 0)
    # next pass: 2 main positions followed by 6 stream entries
    k1, v1 = _kv(8, 1)
    cache.main_length = 2
    rk, rv = cache.update(k1, v1, 0)
    assert rk.shape[-2] == 3 + 8 and rv.shape[-2] == 3 + 8
    assert torch.equal(rk, torch.cat([k0, k1], dim=-2))
    assert torch.equal(rv, torch.cat([v0, v1], dim=-2))
    assert cache.get_seq_length(0) == 5
    assert torch.equal(cache.keys[0], torch.cat([k0, k1[..., :2, :]], dim=-2))
    assert torch.equal(cache.values[0], torch.cat([v0, v1[..., :2, :]], dim=-2))
    # streams from that pass are gone on the next one
    cache.main_length = None
    k2, v2 = _kv(1, 2)
    rk2, _ = cache.update(k2, v2, 0)
    assert torch.equal(rk2, torch.cat([k0, k1[..., :2, :], k2], dim=-2))


def test_cache_first_update_with_main_length():
    cache = MainStreamCache(num_layers=1)
    cache.main_length = 3
    k, v = _kv(7, 3)
    rk, rv = cache.update(k, v, 0)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert torch.equal(cache.keys[0], k[..., :3, :])
    assert cache.get_seq_length() == 3


def test_cache_keep_and_crop():
    cache = MainStreamCache(num_layers=2)
    k, v = _kv(8, 4)
    cache.update(k, v, 0)
    cache.update(k + 1, v + 1, 1)
    cache.keep(3, torch.tensor([4, 1]))  # keep entries 0,1,2 then 3+4=7, 3+1=4
    idx = torch.tensor([0, 1, 2, 7, 4])
    assert torch.equal(cache.keys[0], k[..., idx, :])
    assert torch.equal(cache.values[0], v[..., idx, :])
    assert torch.equal(cache.keys[1], (k + 1)[..., idx, :])
    assert cache.get_seq_length() == 5
    cache.crop(2)
    assert torch.equal(cache.keys[0], k[..., :2, :])
    assert torch.equal(cache.values[1], (v + 1)[..., :2, :])
    assert cache.get_seq_length(1) == 2


def test_cache_keep_skips_empty_layers():
    cache = MainStreamCache(num_layers=2)
    k, v = _kv(4, 5)
    cache.update(k, v, 0)
    cache.keep(2, torch.tensor([1]))
    assert cache.keys[1] is None
    assert torch.equal(cache.keys[0], k[..., [0, 1, 3], :])


def test_cache_grows_past_its_capacity_and_matches_concatenation():
    """Many small steps through a tiny preallocated buffer: the stored entries always equal the
    concatenation of the main parts, and scratch entries of a step never survive it."""
    cache = MainStreamCache(num_layers=1, capacity=2)
    reference_k, reference_v = [], []
    for step in range(12):
        new, main = 1 + step % 4, 1 + step % 3
        main = min(main, new)
        k, v = _kv(new, 10 + step)
        cache.main_length = main
        rk, rv = cache.update(k, v, 0)
        assert torch.equal(rk, torch.cat([*reference_k, k], dim=-2))
        assert torch.equal(rv, torch.cat([*reference_v, v], dim=-2))
        reference_k.append(k[..., :main, :])
        reference_v.append(v[..., :main, :])
        assert torch.equal(cache.keys[0], torch.cat(reference_k, dim=-2))
        assert torch.equal(cache.values[0], torch.cat(reference_v, dim=-2))
