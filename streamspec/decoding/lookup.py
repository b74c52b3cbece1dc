"""Prompt-lookup branches inside the stream tree.

SQL copies table and column names from its schema, a summary copies phrases from its paper, a
reasoning step copies numbers from its question. Each pass, the latest n tokens of the text
(prompt and generated, root included) are looked up earlier in the text; the tokens that followed
each earlier occurrence, up to `PromptLookup.tokens` of them, are a guess of what comes next. Each
guess joins the stream tree as a branch under the root: where it shares a prefix with the stream
candidates it follows their nodes, from where it differs it adds a chain of new nodes. The main
stream verifies every branch in the same forward pass, and the next tree is drafted from the
streams of the deepest accepted node, whichever branch it is on: every node carries streams.

Acceptance does not care where a node came from, so greedy output stays exactly one-token-per-
pass decoding's, and sampled output keeps its distribution (and, with a seed, its tokens).

Everything here runs on the host, on token ids the host has read already (the pass's one read
carries the next stream candidates too), and builds a `DraftTree` whose nodes are no longer in
breadth-first order: pruning, which relies on that order, is refused with lookup.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .tree import grow_tree, tree_lists


@dataclass(frozen=True)
class PromptLookup:
    """How lookup branches are found and how many join a tree.

    Attributes:
        tokens: the longest branch (tokens after the root), L.
        matches: at most this many branches per pass (distinct continuations, most recent match
            first).
        ngram: the longest suffix looked up; shorter ones (down to `min_ngram`) are tried when it
            has too few matches.
        min_ngram: the shortest suffix looked up (1 proposes after any earlier occurrence of the
            root token alone; 2 is more selective).
        budget: at most this many nodes in the merged tree (stream tree included; branch nodes
            past it are dropped); None: no limit.
    """

    tokens: int = 8
    matches: int = 2
    ngram: int = 3
    min_ngram: int = 1
    budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "matches", "ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup {name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.ngram:
            raise ValueError(f"lookup min_ngram ({self.min_ngram}) must be <= ngram ({self.ngram})")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"lookup budget must be an int >= 1 or None, got {self.budget!r}")

    @classmethod
    def parse(cls, text: str) -> "PromptLookup":
        """From ``L``, ``L,M`` or ``L,M,N`` (tokens, matches, ngram), as the command line takes it."""
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"expected L[,M[,N]] (branch tokens, matches, n-gram), got {text!r}") from None
        if not 1 <= len(values) <= 3:
            raise ValueError(f"expected L[,M[,N]] (branch tokens, matches, n-gram), got {text!r}")
        return cls(*values)


class NgramIndex:
    """Where each n-gram (n ≤ `max_n`) of a growing token list ends, to look up the latest one's
    earlier occurrences in O(matches) per pass instead of a scan of the text."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self._ends[tuple(self.tokens[end - n : end])].append(end)

    def continuations(self, lookup: PromptLookup) -> list[list[int]]:
        """Up to `lookup.matches` continuations of the text's latest n-gram, each up to
        `lookup.tokens` long. Candidates: for n from `ngram` down to `min_ngram`, the
        `recent_occurrences` latest earlier occurrences of the last n tokens, most recent first;
        longer continuations come first (an occurrence near the end of the text has only a few
        tokens after it), and one that is a prefix of a branch already taken adds nothing and
        is skipped (`pick_branches`)."""
        text, end = self.tokens, len(self.tokens)
        candidates: list[list[int]] = []
        for n in range(min(lookup.ngram, end), lookup.min_ngram - 1, -1):
            ends = self._ends.get(tuple(text[end - n :]), ())
            taken = 0
            for stop in reversed(ends):
                if taken == recent_occurrences(lookup):
                    break
                if stop < end:  # not the latest n-gram itself
                    candidates.append(text[stop : stop + lookup.tokens])
                    taken += 1
        return pick_branches(candidates, lookup)


def recent_occurrences(lookup: PromptLookup) -> int:
    """How many of a suffix's latest occurrences are looked at (enough to pass the few near the
    end of the text whose continuation is cut short)."""
    return lookup.tokens + 4 * lookup.matches


def pick_branches(candidates: list[list[int]], lookup: PromptLookup) -> list[list[int]]:
    """Longer candidates first (whole-length ones, then shorter ones cut by the end of the text),
    each length in the candidates' order; one that is a prefix of a branch already picked (or
    empty) is skipped; at most `lookup.matches`."""
    ordered = sorted(candidates, key=len, reverse=True)  # stable: the order within a length stays
    picked: list[list[int]] = []
    for branch in ordered:
        if branch and not any(p[: len(branch)] == branch for p in picked):
            picked.append(branch)
            if len(picked) == lookup.matches:
                break
    return picked


def merge_branches(parent: list[int], tokens: list[int], branches: list[list[int]],
                   budget: int | None = None) -> tuple[list[int], list[int]]:
    """The stream tree (`parent`, `tokens` of each node, node 0 the root) with each branch (the
    tokens after the root) merged in: a branch token that a child of its current node holds
    already moves there, any other adds a node. Returns the merged tree's parents and tokens
    (the stream tree's nodes first, unchanged); at most `budget` nodes."""
    parent, tokens = list(parent), list(tokens)
    children: dict[tuple[int, int], int] = {}
    for node in range(1, len(parent)):
        children.setdefault((parent[node], tokens[node]), node)
    for branch in branches:
        node = 0
        for token in branch:
            child = children.get((node, token))
            if child is None:
                if budget is not None and len(parent) >= budget:
                    break
                child = len(parent)
                parent.append(node)
                tokens.append(token)
                children[(node, token)] = child
            node = child
    return parent, tokens


@dataclass(frozen=True)
class StreamTreeOnHost:
    """A stream tree's structure as Python lists, to write its tokens and merge branches into it
    on the host."""

    parent: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]

    @classmethod
    def of(cls, shape: tuple[int, ...]) -> "StreamTreeOnHost":
        """The full tree of a shape (`streamspec.decoding.tree.build_tree`'s nodes, in its order)."""
        parent, depth, rank = tree_lists(shape)
        return cls(tuple(parent), tuple(depth), tuple(rank))

    @classmethod
    def grown(cls, scores: list[list[float]], budget: int) -> "StreamTreeOnHost":
        """The tree `grow_tree` grows from the candidates' scores within `budget` nodes."""
        parent, depth, rank = grow_tree(scores, budget)
        return cls(tuple(parent), tuple(depth), tuple(rank))

    def tokens(self, root: int, candidates: list[list[int]]) -> list[int]:
        """Node tokens from the root and the candidates (row d−1: depth d), as `DraftTree.tokens`."""
        return [root if d == 0 else candidates[d - 1][r] for d, r in zip(self.depth, self.rank)]

    def with_branches(self, root: int, candidates: list[list[int]], branches: list[list[int]],
                      budget: int | None = None) -> tuple[list[int], list[int]]:
        """The merged tree's parents and tokens (`merge_branches`)."""
        return merge_branches(list(self.parent), self.tokens(root, candidates), branches, budget)
