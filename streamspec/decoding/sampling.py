"""Drawing tokens: `Sampler` (argmax, or a keyed draw from temperature / top-k / top-p).

Draws are keyed by (seed, row, token index) through a 32-bit integer hash computed on the device,
so speculative decoding draws, at every node of a pass at once, exactly the numbers one token per
pass would draw for the same token indices (see `Sampler`).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor | int, c: int):
    """x·c mod 2³² for x < 2³² held in int64, without overflowing int64 (x split in 16-bit halves)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def _hash32(x):
    """A 32-bit integer hash with good avalanche (the "lowbias32" constants of C. Wellons' hash
    prospector), on Python ints or int64 tensors holding values below 2³²."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class Sampler:
    """Picks the next token from logits: argmax when `temperature` is 0, else a draw from the
    softmax of logits/temperature restricted to `top_k` and nucleus `top_p`.

    Draws are keyed, not sequential: the draw for the token at sequence index t of row r uses
    the uniform number hash(seed, r, t) (inverse-CDF sampling). Speculative decoding chooses a
    token at every draft node of a pass at once, on the device, and keeps those on the accepted
    path; keyed by the index each node's token would have, the kept draws are exactly those one-
    token-per-pass sampling makes. So with a seed, speculative sampling returns the very tokens
    one-token-per-pass sampling returns, whatever the drafts. Regenerating the same indices with
    the same Sampler repeats its draws: make a new Sampler (or seed) for independent samples.
    Without a seed, one is drawn from torch's global generator.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self._seed = seed
        self._fresh = 0  # keys handed to calls that give none (row -1: never a sequence's)

    @property
    def seed(self) -> int:
        """The seed draws are keyed by (drawn from torch's global generator at first use when
        none was given; greedy decoding never needs it)."""
        if self._seed is None:
            self._seed = int(torch.randint(0, 2**62, ()))
        return self._seed

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from ([..., V])."""
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def key(self) -> int:
        """The 32-bit key all draws are hashed with (from the seed)."""
        return _hash32((self.seed & _MASK32) ^ _hash32((self.seed >> 32) & _MASK32))

    def uniforms(self, index: torch.Tensor, row: torch.Tensor | int = 0, key: torch.Tensor | int | None = None) -> torch.Tensor:
        """The uniform numbers in (0, 1) (float64) of the draws for the tokens at sequence indices
        `index` of rows `row` (broadcast together). `key` is `key()` (computed when None; a
        compiled pass gives it as a tensor, so that a new seed does not compile again)."""
        index = torch.as_tensor(index)
        if key is None:
            key = self.key()
        h = _hash32((index & _MASK32) ^ _hash32((torch.as_tensor(row, device=index.device) & _MASK32) ^ key))
        return (h.double() + 0.5) / 2.0**32

    def __call__(self, logits: torch.Tensor, index: torch.Tensor | None = None, row: torch.Tensor | int = 0,
                 key: torch.Tensor | int | None = None) -> torch.Tensor:
        """One token per row: [..., V] logits -> [...] token ids (0-dim from [V]). `index` [...]
        (with `row`) keys each draw (see the class); without it each call gets fresh keys. On the
        device: nothing is read back to the host."""
        if self.greedy:
            return logits.argmax(-1)
        probs = self.probs(logits)
        if index is None:
            count = probs[..., 0].numel()
            index = torch.arange(count, device=logits.device).view(probs.shape[:-1]) + self._fresh
            row, self._fresh = -1, self._fresh + count
        cdf = probs.double().cumsum(-1)
        target = self.uniforms(index.to(logits.device), row, key) * cdf[..., -1]
        token = torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1)
        return token.clamp(max=logits.shape[-1] - 1)
