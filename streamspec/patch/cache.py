"""A key/value cache that keeps main-stream entries only: the cache protocol of the patch's layers.

Streams keep no cache of their own (METHOD §1): their keys and values exist only inside the
forward pass that made them. The HF attention modules call ``cache.update(k, v, layer_idx)``
with every query's keys and attend to what it returns, so this cache returns past + all new
entries (streams and draft-tree nodes included, for this pass) but counts as stored only the
first ``main_length`` new ones.

Each layer owns one preallocated buffer that grows by doubling: a decoding step writes its new
entries after the stored ones and attends to a view, so no step copies the whole cache. Entries
past the stored length are scratch, overwritten by the next step; `keep` moves an accepted tree
path into place with one gather of the new entries only.
"""

from __future__ import annotations

import torch


class MainStreamCache:
    """Per-layer main-stream keys/values, [B, kv_heads, length, head_dim] each."""

    def __init__(self, num_layers: int, capacity: int = 256) -> None:
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._length = [0] * num_layers
        self._capacity = capacity
        # How many of the next update's entries are main positions (None: all of them).
        self.main_length: int | None = None

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """The stored keys of each layer (views; None for a layer never updated)."""
        return [None if k is None else k[..., :n, :] for k, n in zip(self._keys, self._length)]

    @property
    def values(self) -> list[torch.Tensor | None]:
        return [None if v is None else v[..., :n, :] for v, n in zip(self._values, self._length)]

    @property
    def buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's whole preallocated key and value buffers (what a compiled pass writes
        into through `StaticCacheView`); entries past the stored length are scratch."""
        return self._keys, self._values

    @property
    def capacity(self) -> int:
        """Entries each layer's buffer holds now (0 before the first update)."""
        return 0 if self._keys[0] is None else self._keys[0].shape[-2]

    def _reserve(self, layer_idx: int, like: torch.Tensor, needed: int) -> None:
        buf = self._keys[layer_idx]
        if buf is not None and buf.shape[-2] >= needed:
            return
        size = max(needed, self._capacity if buf is None else 2 * buf.shape[-2])
        shape = (*like.shape[:-2], size, like.shape[-1])
        # zeros, not empty: a compiled pass (`StaticCacheView`) attends over the whole buffer with
        # the unused part masked out, and a masked NaN would still poison the softmax's products
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if buf is not None:
            n = self._length[layer_idx]
            keys[..., :n, :] = buf[..., :n, :]
            values[..., :n, :] = self._values[layer_idx][..., :n, :]
        self._keys[layer_idx], self._values[layer_idx] = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        new = key_states.shape[-2]
        main = new if self.main_length is None else self.main_length
        past = self._length[layer_idx]
        self._reserve(layer_idx, key_states, past + new)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys[..., past : past + new, :] = key_states
        values[..., past : past + new, :] = value_states
        self._length[layer_idx] = past + main
        return keys[..., : past + new, :], values[..., : past + new, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length[layer_idx]

    def keep(self, prefix_length: int, new_index: torch.Tensor, layers: range | None = None,
             length: int | None = None) -> None:
        """Keep the first `prefix_length` entries, then the entries at `new_index` (positions after
        the prefix, e.g. an accepted tree path), contiguous and in that order; in `layers` only
        (default all). With `length`, only the first `length` of them count as stored: the index
        may then have a fixed size (a path padded to the tree's depth, computed on the device)
        and the rest are scratch."""
        for i, (k, v) in enumerate(zip(self._keys, self._values)):
            if k is None or (layers is not None and i not in layers):
                continue
            idx = prefix_length + new_index.to(k.device)
            m = min(len(idx), k.shape[-2] - prefix_length)
            k[..., prefix_length : prefix_length + m, :] = k.index_select(-2, idx[:m])
            v[..., prefix_length : prefix_length + m, :] = v.index_select(-2, idx[:m])
            self._length[i] = prefix_length + (m if length is None else min(length, m))

    def reserve(self, total: int) -> None:
        """Make room for `total` entries per layer now (buffers made later are made that large), so
        that decoding up to that length never reallocates."""
        self._capacity = max(self._capacity, total)
        for i, buf in enumerate(self._keys):
            if buf is not None and buf.shape[-2] < total:
                self._reserve(i, buf, total)

    def count_stored(self, length: int) -> None:
        """Count the first `length` entries of every layer as stored: a compiled pass wrote them in
        place (`StaticCacheView`), so nothing moves."""
        if length > self.capacity:
            raise ValueError(f"cannot count {length} entries stored in buffers of {self.capacity}")
        self._length = [length if k is not None else n for k, n in zip(self._keys, self._length)]

    def crop(self, length: int) -> None:
        """Drop every entry at or after `length`."""
        self._length = [min(n, length) for n in self._length]


class StaticCacheView:
    """The cache as a compiled decoding pass sees it: every shape fixed whatever the cache holds.

    It wraps the preallocated per-layer buffers of a `MainStreamCache` (``[1, kv_heads, C,
    head_dim]``, C the buffer capacity) and the number of stored entries as a 0-dim device tensor
    `past`, so one compiled graph serves every pass. `update` writes the new main entries at
    ``past + arange`` (``index_copy_``) and returns the WHOLE buffer followed by the pass's stream
    entries (which are never stored): attention then runs over ``C + S·γ`` keys under a mask that
    hides entries at and after ``past + T`` that are not this pass's (see
    `streamspec.decoding.static_main_allowed`). Entries stored by the pass are counted by the
    owning cache afterwards (`MainStreamCache.keep` with host integers). The buffers must be
    zero-initialised (as `MainStreamCache` makes them): masked entries still enter the products.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], past: torch.Tensor) -> None:
        self.keys, self.values, self.past = keys, values, past
        self.main_length: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        new = key_states.shape[-2]
        main = new if self.main_length is None else self.main_length
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        self._write(keys, values, key_states[..., :main, :], value_states[..., :main, :])
        if main == new:
            return keys, values
        return (torch.cat([keys, key_states[..., main:, :]], dim=-2),
                torch.cat([values, value_states[..., main:, :]], dim=-2))

    def _write(self, keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """Store the pass's main entries in the buffers, in place (at past + arange)."""
        at = self.past + torch.arange(new_keys.shape[-2], device=new_keys.device)
        keys.index_copy_(-2, at, new_keys)
        values.index_copy_(-2, at, new_values)

    def commit(self, path: torch.Tensor) -> None:
        """Keep a pass's accepted path inside the pass (`MainStreamCache.keep` as tensor ops): the
        entries of the nodes in `path` [D+1] (this pass's, written at past + node) move to
        past..past+D in every layer, in place. Entries past the accepted depth are scratch; the
        owning cache counts the stored ones afterwards (`MainStreamCache.count_stored`). A
        compiled pass does this so that no per-layer copy runs on the host between passes."""
        at = self.past + torch.arange(path.shape[0], device=path.device)
        source = self.past + path
        for keys, values in zip(self.keys, self.values):
            keys.index_copy_(-2, at, keys.index_select(-2, source))
            values.index_copy_(-2, at, values.index_select(-2, source))

    def get_seq_length(self, layer_idx: int = 0) -> int:  # pragma: no cover - not called by streamspec
        raise NotImplementedError("a static cache view's length is a device tensor (past)")


def row_slots(row_lengths: torch.Tensor, count: int) -> torch.Tensor:
    """Where each row of a batch cache writes its next `count` entries: right after its own
    `row_lengths` [B] stored ones, as a [B, 1, count, 1] index for ``scatter_`` along the entries."""
    return (row_lengths[:, None] + torch.arange(count, device=row_lengths.device))[:, None, :, None]


class StaticRowCacheView(StaticCacheView):
    """The cache of a batch as a compiled decoding pass sees it (`RowCache`'s buffers, every shape
    fixed): each row writes the pass's new main entries right after its own stored ones
    (``row_lengths`` [B], a device tensor; ``scatter_``) and attention runs over the WHOLE buffers
    followed by the pass's stream entries, under a mask that hides what is not the row's
    (`streamspec.patch.layout.row_allowed` with the buffer's width). Entries stored by the pass
    are counted by the owning `RowCache` afterwards (`RowCache.count_rows`). The buffers must be
    zero-initialised, as for `StaticCacheView`."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], row_lengths: torch.Tensor) -> None:
        super().__init__(keys, values, past=None)
        self.row_lengths = row_lengths

    def _write(self, keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        at = row_slots(self.row_lengths, new_keys.shape[-2]).expand(new_keys.shape)
        keys.scatter_(-2, at, new_keys)
        values.scatter_(-2, at, new_values)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # pragma: no cover - not called by streamspec
        raise NotImplementedError("a static row cache view's lengths are a device tensor (row_lengths)")


class RowCache(MainStreamCache):
    """The cache of a batch whose rows accept different numbers of tokens per pass.

    Each row keeps its entries contiguous from the start of its buffer and writes a pass's new
    main entries right after its own stored ones (`row_lengths`, on the device), so a rejected
    draft is overwritten by the next pass instead of staying behind masked: the cache grows by
    what each row accepts, not by the draft's length. Attention reads the region every row fits
    in (`width`, a bound the host keeps) and a mask (`streamspec.patch.layout.row_allowed`) says which
    entries of it are each row's.
    """

    def __init__(self, num_layers: int, capacity: int = 256) -> None:
        super().__init__(num_layers, capacity)
        self.row_lengths: torch.Tensor | None = None
        self.width = 0
        self._at: dict[int, torch.Tensor] = {}  # this pass's write positions by entry count (every layer's)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        batch, heads, new, dim = key_states.shape
        main = new if self.main_length is None else self.main_length
        self._reserve(layer_idx, key_states, self.width + new)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if self.row_lengths is None:
            self.row_lengths = torch.zeros(batch, dtype=torch.long, device=key_states.device)
        if main not in self._at:
            self._at[main] = row_slots(self.row_lengths, main)
        at = self._at[main].expand(batch, heads, main, dim)
        keys.scatter_(-2, at, key_states[..., :main, :])
        values.scatter_(-2, at, value_states[..., :main, :])
        region = self.width + main
        return (torch.cat([keys[..., :region, :], key_states[..., main:, :]], dim=-2),
                torch.cat([values[..., :region, :], value_states[..., main:, :]], dim=-2))

    def advance(self, accepted: torch.Tensor, width: int) -> None:
        """Each row stores `accepted` [B] (device) more of the entries it just wrote; `width` is
        the longest row's length afterwards (the host knows it from the accepted counts)."""
        self.count_rows(self.row_lengths + accepted, width)

    def count_rows(self, row_lengths: torch.Tensor, width: int) -> None:
        """A compiled pass (`StaticRowCacheView`) wrote its entries in place: each row now stores
        `row_lengths` [B] (device) entries, the longest `width` (host). Nothing moves."""
        if width > self.capacity:
            raise ValueError(f"cannot count {width} entries stored in buffers of {self.capacity}")
        self.row_lengths = row_lengths
        self._at.clear()
        self.width = width
        self._length = [width if k is not None else 0 for k in self._keys]
