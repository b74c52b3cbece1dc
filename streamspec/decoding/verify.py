"""Verification of one sequence's draft tree: what a pass accepts and what it drafts next.

Two ways, the same tokens (tests hold it): `verify_on_device` (tensor operations; the LM head over
every node's main row, then, on a CPU with streamspec's own kernels, over the accepted node's
stream rows alone, elsewhere over every node's stream rows in the same call; one small read per
pass) and `walk_on_host` (a walk down the accepted path, one LM-head call per accepted node, the
fewest head rows). See `generate`'s ``verify`` for which runs where.
"""

from __future__ import annotations

import torch

from ..patch.model import StreamedModel
from ..devices import head_split
from .sampling import Sampler
from .tree import DraftTree, accepted_nodes, deepest_path

def _verify(model: StreamedModel, main: torch.Tensor, streams: torch.Tensor, tree: DraftTree, node_tokens: torch.Tensor,
            next_index: torch.Tensor, sampler: Sampler, width: int,
            key: torch.Tensor | None = None, draft_depth: int | None = None, with_scores: bool = False,
            ) -> tuple[torch.Tensor, ...]:
    """Verify one sequence's draft tree and draft the next, on the device.

    On a CPU with streamspec's own kernels (`streamspec.native`) the LM head runs twice: over every
    node's main row, then over the stream rows of the deepest accepted node only (the rows the next
    draft reads: `draft` of them, not every node's); elsewhere once, over every node's main and
    stream rows. The main stream chooses a token at every node (argmax, or one draw per
    node keyed by the sequence index of the token it chooses, `next_index` [N]: draws off the
    accepted path are never used and the kept ones are those one-token-per-pass sampling
    makes); a node is accepted when its whole path
    agrees (`accepted_nodes`); the token chosen at the deepest accepted node is the correction,
    and the next draft is the top-`width` of that node's stream logits. Returns the path [D+1] (node indices, padded past the deepest node),
    ``summary`` [D+2]: that node's depth, then the path's tokens after the root and the
    correction (padded), the new root [1] and the next candidates [draft_depth, width] (the
    stream tree's depth; a tree with lookup branches may be deeper); with `with_scores`, also
    the candidates' log-probabilities [draft_depth, width]."""
    depth_limit = tree.depth_limit
    n, draft = main.shape[1], draft_depth or depth_limit
    # On a CPU with streamspec's own kernels the LM head runs over each node's main row, and later
    # over the accepted node's stream rows alone (there every row costs its products); elsewhere
    # one call over every row the pass may need (a call costs the head's read, rows little more:
    # oneDNN's and cuBLAS's products of many rows; two calls measured 9-17% slower on oneDNN).
    split = head_split(main.device.type)  # the device's formulation (`streamspec.devices.formulation`)
    logits = model.head(main[0] if split else torch.cat([main[0], streams[0, :, :draft].reshape(n * draft, -1)]))
    choice = sampler(logits[:n], next_index, key=key)  # [N]: node i's choice is the token at next_index[i]
    best, path = deepest_path(tree, accepted_nodes(tree, node_tokens, choice))
    depth = tree.depth.index_select(0, best)  # [1]
    correction = choice.index_select(0, best)  # [1]
    levels = torch.arange(depth_limit + 1, device=main.device)
    drafted = torch.cat([node_tokens.index_select(0, path[1:]), correction])
    tokens = torch.where(levels == depth, correction, drafted)
    stream_logits = (model.draft_head(streams[0, :, :draft].index_select(0, best)[0]) if split  # [D, V]: the deepest node's streams
                     else logits[n:].view(n, draft, -1).index_select(0, best)[0])
    candidates = stream_logits.topk(width, dim=-1).indices
    if with_scores:  # the candidates' log-probabilities, for a tree grown by confidence
        scores = stream_logits.log_softmax(-1).gather(-1, candidates)
        return path, torch.cat([depth, tokens]), correction, candidates, scores
    return path, torch.cat([depth, tokens]), correction, candidates


def _walk(model: StreamedModel, main: torch.Tensor, streams: torch.Tensor, children: list[list[int]],
          node_tokens: list[int], next_index: torch.Tensor, sampler: Sampler,
          depth: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Verify one sequence's draft tree from the root down, on the host: at each node the LM head
    runs on that node's main row and its first `depth` stream rows (one call), the main stream
    chooses a token there (keyed by `next_index`, as `_verify`); if a child holds it the walk
    moves there, else it is the correction. Returns the path (node indices), the correction [1]
    and the stream logits [depth, V] of the last node (the next draft's)."""
    node, path = 0, [0]
    while True:
        logits = model.head(torch.cat([main[0, node : node + 1], streams[0, node, :depth]], dim=0))  # [1 + depth, V]
        token = sampler(logits[:1], next_index[node : node + 1])
        chosen = int(token)
        child = next((c for c in children[node] if node_tokens[c] == chosen), None)
        if child is None:
            return path, token, logits[1:]
        node = child
        path.append(node)


# The names the loop and the compiled pass use.
verify_on_device = _verify
walk_on_host = _walk


def chain_verify(model, main, streams, chain, positions, sampler, key, fuse_head: bool):
    """What a batch pass decides from its hidden states: each row's accepted drafts and the next
    root and chain. `main` [B, n, h] and `streams` [B, n, γ, h] are the pass's hidden states over
    `chain` [B, n] (the root, then the drafts) at `positions` [B, n]. Returns the pass's one read
    [B, 1+n] (each row's accepted count, then its accepted tokens and correction padded with
    drafts), the next roots [B] and drafts [B, γ]."""
    batch, n = chain.shape
    g = n - 1
    rows = torch.arange(batch, device=chain.device)
    steps = torch.arange(n, device=chain.device)
    # Every row's choice at every node (a draw per node when sampling: only those on the
    # accepted path are used), and the stream rows of each row's deepest accepted node.
    if fuse_head:
        logits = model.head(torch.cat([main, streams.flatten(1, 2)], dim=1))  # [B, n + n·γ, V]
        choice = sampler(logits[:, :n], positions + 1, rows[:, None], key=key)  # [B, 1+γ]
    else:
        choice = sampler(model.head(main), positions + 1, rows[:, None], key=key)
    depth = (chain[:, 1:] == choice[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # [B] accepted drafts
    roots = choice.gather(1, depth[:, None])[:, 0]
    new = torch.where(steps[:n - 1] == depth[:, None], roots[:, None], chain[:, 1:])  # [B, γ]: drafts, then the correction
    new = torch.cat([new, roots[:, None]], dim=1)
    if fuse_head:
        drafts = logits[:, n:].unflatten(1, (n, g)).argmax(-1)[rows, depth]  # [B, γ]: the deepest node's streams
    else:
        drafts = model.head(streams[rows, depth]).argmax(-1)
    return torch.cat([depth[:, None], new], dim=1), roots, drafts
