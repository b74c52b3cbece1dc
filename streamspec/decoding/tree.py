"""Draft trees as pure tensors, built once per shape.

The streams of one position give, for each depth d = 1..γ, the top-k candidates for the token
d steps after the root. Every candidate of depth d is a child of every candidate of depth d−1, so
the tree holds 1 + k + k² + … + k^γ nodes (40 for k = 3, γ = 3). A shape may also give k depth by
depth, (k1, k2, …): 1 + k1 + k1·k2 + … nodes, e.g. (3, 1, 1) keeps three candidates for the next
token and one below each (10 nodes). Nodes are numbered breadth first (the root is node 0), so a
parent always comes before its children.

A node attends to the cached prefix and to its ancestors (itself included); its position id is
prefix length + depth. Trees built on the host for one pass (confidence-shaped ones, `grow_tree`;
with lookup branches, `streamspec.decoding.lookup`) become `DraftTree`s through
`tree_from_parents`; they need not be breadth first, only parents before children.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """The fixed shape of a draft tree.

    Attributes:
        parent: [N] parent node of each node (-1 for the root).
        depth: [N] depth of each node (root 0).
        rank: [N] which of the top-k candidates of its depth a node holds (root 0).
        ancestors: [N, N] bool, ``ancestors[i, j]`` when j is i or an ancestor of i.
    """

    top_k: tuple[int, ...]  # candidates at each depth 1..depth_limit
    depth_limit: int
    parent: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    ancestors: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.parent.numel())

    @property
    def num_parents(self) -> int:
        """Nodes that can have children (depth < depth_limit): the first ones, breadth first."""
        return int((self.depth < self.depth_limit).sum())

    def tokens(self, root: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Node tokens [N] from the root token (0-dim) and candidates [γ', k] (row d−1: depth d)."""
        drawn = candidates[(self.depth - 1).clamp(min=0), self.rank]
        return torch.where(self.depth == 0, root, drawn)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root down to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parent[node])
        return path[::-1]

    def children(self) -> list[list[int]]:
        """The children of each node, as Python lists (for walking the tree on the host)."""
        return children_of(self.parent.tolist())

    def subset(self, keep: torch.Tensor) -> "DraftTree":
        """The tree restricted to the nodes in `keep` (sorted; must be closed under parents)."""
        remap = torch.full((self.size,), -1, dtype=torch.long, device=self.parent.device)
        remap[keep] = torch.arange(len(keep), device=self.parent.device)
        parent = self.parent[keep]
        return DraftTree(
            top_k=self.top_k,
            depth_limit=self.depth_limit,
            parent=torch.where(parent >= 0, remap[parent.clamp(min=0)], parent),
            depth=self.depth[keep],
            rank=self.rank[keep],
            ancestors=self.ancestors[keep][:, keep],
        )

    def to(self, device) -> "DraftTree":
        return DraftTree(
            self.top_k, self.depth_limit, self.parent.to(device), self.depth.to(device), self.rank.to(device),
            self.ancestors.to(device),
        )


def tree_shape(top_k: int | tuple[int, ...] | list[int], depth: int) -> tuple[int, ...]:
    """Candidates per depth: an int k means k at each of the `depth` depths; a sequence gives
    them depth by depth, and its length (1..depth) is the tree's depth."""
    if isinstance(top_k, bool) or not isinstance(top_k, (int, tuple, list)):
        raise ValueError(f"tree_top_k must be an int or a sequence of ints, got {top_k!r}")
    if isinstance(top_k, int):
        if top_k < 1:
            raise ValueError(f"tree_top_k must be >= 1, got {top_k}")
        return (top_k,) * depth
    shape = tuple(top_k)
    if not 1 <= len(shape) <= depth or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in shape):
        raise ValueError(
            f"tree_top_k as a sequence needs 1 to {depth} (the number of streams) ints >= 1, one per depth; got {top_k!r}"
        )
    return shape


def rank_paths(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The nodes of a shape's full tree as rank paths from the root, breadth first (node i is
    ``paths[i]``; the root is ``()``)."""
    paths: list[tuple[int, ...]] = [()]
    for d in range(1, len(shape) + 1):
        paths.extend(itertools.product(*(range(k) for k in shape[:d])))
    return paths


def tree_lists(shape: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """Parent, depth and rank of each node of a shape's full tree, as Python lists."""
    paths = rank_paths(shape)
    number = {path: i for i, path in enumerate(paths)}
    return ([number[p[:-1]] if p else -1 for p in paths], [len(p) for p in paths], [p[-1] if p else 0 for p in paths])


def build_tree(top_k: int | tuple[int, ...], depth: int) -> DraftTree:
    """The full tree of a shape: every rank path over the candidates of each depth (see
    `tree_shape`; an int k is k candidates at each of `depth` depths)."""
    if depth < 0:
        raise ValueError(f"tree depth must be >= 0, got {depth}")
    shape = tree_shape(top_k, depth)
    paths = rank_paths(shape)
    number = {path: i for i, path in enumerate(paths)}
    parent, depths, rank = tree_lists(shape)
    n = len(paths)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for i, path in enumerate(paths):
        for d in range(len(path) + 1):
            ancestors[i, number[path[:d]]] = True
    return DraftTree(
        top_k=shape,
        depth_limit=len(shape),
        parent=torch.tensor(parent),
        depth=torch.tensor(depths),
        rank=torch.tensor(rank),
        ancestors=ancestors,
    )


def prune_by_transition(tree: DraftTree, tokens: torch.Tensor, early_log_probs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Nodes kept after dropping every child whose early-exit transition probability from its
    parent, softmax(z̃_parent)[child token], is below `threshold`, with its subtree.

    Args:
        early_log_probs: [P, V] log-softmax of the early-exit logits at the first P nodes, P at
            least `tree.num_parents` (only parents' rows are read).
    Returns the sorted indices of kept nodes (the root is always kept).
    """
    parent = tree.parent.clamp(min=0)
    transition = early_log_probs[parent, tokens].exp()
    keep = torch.ones(tree.size, dtype=torch.bool, device=tokens.device)
    for d in range(1, tree.depth_limit + 1):  # parents first: a dropped node drops its subtree
        level = tree.depth == d
        keep = torch.where(level, keep[parent] & (transition >= threshold), keep)
    return keep.nonzero().flatten()


def accepted_nodes(tree: DraftTree, tokens: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """[N] bool: the nodes whose whole path the main stream confirms. A node is accepted when its
    parent is and its token is the one chosen at its parent (``choice`` [N]: the token the main
    stream chose at each node, argmax or a draw). The root always is. Tensor operations only, one
    per depth: nothing is read back to the host."""
    parent = tree.parent.clamp(min=0)
    confirmed = tokens == choice[parent]
    accepted = tree.depth == 0
    for d in range(1, tree.depth_limit + 1):
        accepted = torch.where(tree.depth == d, accepted[parent] & confirmed, accepted)
    return accepted


def deepest_path(tree: DraftTree, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deepest accepted node (the first one breadth first when several are as deep) and its
    path: returns ``best`` [1] and ``path`` [depth_limit + 1], the node at each depth from the
    root down to ``best`` (entries past its depth are 0). On the device, no host read."""
    best = torch.where(accepted, tree.depth, -1).argmax().view(1)
    on_path = tree.ancestors.index_select(0, best)[0]  # [N]
    levels = torch.arange(tree.depth_limit + 1, device=tree.depth.device)
    at_level = on_path[None, :] & (tree.depth[None, :] == levels[:, None])  # [D+1, N]
    return best, at_level.int().argmax(dim=1)


def grow_tree(scores: list[list[float]], budget: int) -> tuple[list[int], list[int], list[int]]:
    """A draft tree shaped by confidence: from each depth's candidate scores (``scores[d-1][r]``:
    the log-probability the streams give their rank-r candidate for depth d, best first), grow
    the tree best-first, always adding the node whose path (root to it) has the highest summed
    log-probability, until it has `budget` nodes (root included) or none is left. A node holds the
    candidate of its rank at its depth, as in the fixed shapes, so the tree is a subtree of the
    full one. Returns parent, depth and rank of each node; parents come before children."""
    if budget < 1:
        raise ValueError(f"the tree budget must be >= 1, got {budget}")
    parent, depth, rank = [-1], [0], [0]
    frontier = [(-score, 0, r, 0) for r, score in enumerate(scores[0])] if scores else []
    heapq.heapify(frontier)
    while frontier and len(parent) < budget:
        neg, up, r, d = heapq.heappop(frontier)
        node = len(parent)
        parent.append(up)
        depth.append(d + 1)
        rank.append(r)
        if d + 1 < len(scores):
            for child_rank, score in enumerate(scores[d + 1]):
                heapq.heappush(frontier, (neg - score, node, child_rank, d + 1))
    return parent, depth, rank


def children_of(parent: list[int]) -> list[list[int]]:
    """Each node's children, from each node's parent (-1 for the root)."""
    children: list[list[int]] = [[] for _ in parent]
    for node, up in enumerate(parent):
        if up >= 0:
            children[up].append(node)
    return children


def tree_from_parents(parent: list[int], depth_limit: int, top_k: tuple[int, ...]) -> DraftTree:
    """A `DraftTree` (on the CPU) from each node's parent (parents before children)."""
    n = len(parent)
    depth = [0] * n
    rows: list[list[bool]] = []  # built as lists and made a tensor once: this runs every pass
    for node in range(n):
        up = parent[node]
        row = list(rows[up]) if up >= 0 else [False] * n
        row[node] = True
        if up >= 0:
            depth[node] = depth[up] + 1
        rows.append(row)
    return DraftTree(
        top_k=top_k,
        depth_limit=max(max(depth), depth_limit),
        parent=torch.tensor([-1] + parent[1:]),
        depth=torch.tensor(depth),
        rank=torch.zeros(n, dtype=torch.long),
        ancestors=torch.tensor(rows, dtype=torch.bool).view(n, n),
    )


def padded_tree(parent: list[int], size: int, depth_limit: int, top_k: tuple[int, ...]) -> DraftTree:
    """A host-built tree (each node's parent, parents before children) padded to `size` nodes
    with a static `depth_limit`, so that trees of any shape within those bounds run through one
    compiled pass (`streamspec.decoding.compiled`). A padding node is a second root: depth 0, no
    parent, it sees only the cached prefix and itself and no real node sees it, so it is never on
    the accepted path (the deepest accepted node is the first of its depth, and node 0 comes
    before every padding node). On the CPU."""
    n = len(parent)
    if n > size:
        raise ValueError(f"a tree of {n} nodes does not fit a pass padded to {size}")
    depth = [0] * size
    rows = [[False] * size for _ in range(size)]
    for node in range(n):
        up = parent[node]
        if up >= 0:
            rows[node][:n] = rows[up][:n]
            depth[node] = depth[up] + 1
        rows[node][node] = True
    for node in range(n, size):
        rows[node][node] = True
    if max(depth) > depth_limit:
        raise ValueError(f"a tree {max(depth)} deep does not fit a pass with depth_limit={depth_limit}")
    return DraftTree(
        top_k=top_k,
        depth_limit=depth_limit,
        parent=torch.tensor([-1] + list(parent[1:n]) + [-1] * (size - n)),
        depth=torch.tensor(depth),
        rank=torch.zeros(size, dtype=torch.long),
        ancestors=torch.tensor(rows, dtype=torch.bool),
    )
