"""The streams drafter behind vLLM's DFlash proposer (``"method": "dflash"``): γ streams, γ drafts.

vLLM's DFlash proposer (``vllm/v1/spec_decode/dflash.py``) splits a draft pass in two:

1. *Context*: for every token the target has just run (the accepted ones and the rejected ones), it
   hands the drafter the target's hidden states (``combine_hidden_states``, then
   ``precompute_and_store_context_kv``), and the drafter writes their keys and values into its
   paged cache itself; these rows never pass through the drafter's layers.
2. *Queries*: per request, 1+K rows at positions p+1…p+K+1 after the last accepted position p:
   the bonus token (just sampled), then K mask tokens. Only token ids and positions come with
   them. Attention is causal (the drafter folder's ``dflash_config.causal``): a query row sees the
   cached keys ≤ p and the query rows up to itself. Draft k is sampled from the k-th mask row.

Mapped onto the streams (stream j of p: the main hidden state at p plus P_j, at position p+j,
attending to the main keys ≤ p and to streams 1..j, trained to predict the token at p+1+j):

==================  =============  ===========================================================
rows                positions      here
==================  =============  ===========================================================
context             …, p, (rej.)   main rows: each drafter layer's keys and values from the
                                   target's own hidden state entering that layer (the folder
                                   asks vLLM for the Ns layers N−Ns…N−1), as the base computes
                                   them: lossless, these are the base's own keys and values
query row 0         p+1            stream 1 of p (the bonus token's id is read by streams that
                                   read the next token, by every stream row of its request)
query row i (i≥1)   p+1+i          stream i+1 of p (rows past γ−1 have no stream to be: they
                                   run as stream γ again; the last row is never read)
==================  =============  ===========================================================

Query row i sits at p+1+i = p+j for stream j = i+1 and, causally, sees the main keys ≤ p and
query rows 0…i, streams 1…j: the trained pattern, with nothing else in view. Draft k (the token at
p+1+k, what stream k predicts) is sampled from mask row k, one row after stream k, so the state
returned for logits at each mask row is the row before's. With K = γ every stream drafts and no
filler draft is verified; K may be 1…γ. A folder with lookup drafts (`streamspec.vllm.lookup`)
may ask for up to 2γ: a lookup hit fills the positions beyond γ, and without one, draft k > γ is
stream γ's guess read one position further on (rows past γ run as stream γ).

The main hidden state at p, which every stream starts from, is the context row at p of the same
request: found by its paged-cache slot (the request's block table at p, from the attention
metadata of the pass), which no other request's row shares.
"""

from __future__ import annotations

import torch

from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.mistral import MistralDecoderLayer
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

from .drafter import StreamsDrafter
from .format import DFLASH, layout_aux_layers


class DFlashStreamsDrafter(StreamsDrafter):
    """Speculative streams as vLLM's DFlash drafter (see the module docstring). Passes the
    proposer's model check as an `Eagle3LlamaForCausalLM` (what `StreamsDrafter` subclasses)."""

    layout = DFLASH
    least_scheduled_drafts = 1  # every draft of the DFlash layout is a stream's

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        first, layers = int(self.facts["first_layer"]), int(self.facts["stream_layers"])
        wanted = layout_aux_layers(DFLASH, first, layers)
        got = list(getattr(self.config, "eagle_aux_hidden_state_layer_ids", None) or [])
        if got != wanted:
            raise ValueError(f"the DFlash layout reads the target's hidden states entering each of the layers it "
                             f"copies, {wanted}; the drafter folder asks for {got}: export it again with "
                             "`streamspec export --format vllm --layout dflash`")
        self.cache_config = vllm_config.cache_config
        self._aux: torch.Tensor | None = None  # [T, Ns, hidden]: this pass's target states, every layer
        self._context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # slots, positions, main
        self._ones_rows: torch.Tensor | None = None  # every DFlash row is a stream row: one mask, sliced

    def _ones(self, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        ones = self._ones_rows
        if ones is None or ones.shape[0] < count or ones.dtype != dtype or ones.device != device:
            ones = self._ones_rows = torch.ones(max(count, 256), 1, dtype=dtype, device=device)
        return ones[:count]

    def _check_speculative_config(self, spec) -> None:
        self._check_draft_count()  # no parallel-drafting flag: the DFlash proposer drafts in one pass

    # -- context: the main rows' keys and values ---------------------------------------------------
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's states entering layers N−Ns…N−1, side by side: kept whole for
        `precompute_and_store_context_kv` (which vLLM calls next, on the rows returned here); the
        proposer itself gets the first (the streams' input)."""
        if not self._base_checked:
            self._check_base()
        hidden = self.config.hidden_size
        layers = len(self.model.layers)
        if hidden_states.shape[-1] != layers * hidden:
            raise ValueError(f"the DFlash streams drafter expects the target's hidden states entering its {layers} "
                             f"layers ({layers} × {hidden} features), got {hidden_states.shape[-1]}")
        self._aux = hidden_states.view(-1, layers, hidden)
        return self._aux[:, 0]

    def precompute_and_store_context_kv(self, context_states: torch.Tensor, context_positions: torch.Tensor,
                                        context_slot_mapping: torch.Tensor | None = None) -> None:
        """Write each drafter layer's keys and values of the context rows into its paged cache, from
        the target's hidden state entering that layer (``None`` slots: vLLM's memory profiling, which
        computes and writes nothing)."""
        aux, self._aux = self._aux, None
        count = context_states.shape[0]
        if aux is None or aux.shape[0] != count:  # profiling: no states of the target's
            aux = context_states[:, None].expand(count, len(self.model.layers), context_states.shape[-1])
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            qkv, _ = attn.qkv_proj(layer.input_layernorm(aux[:, i].contiguous()))
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            if getattr(attn, "qk_norm", False):
                k = attn.k_norm(k.reshape(count, attn.num_kv_heads, attn.head_dim)).reshape(count, attn.kv_size)
            _, k = attn.rotary_emb(context_positions, q, k)
            if context_slot_mapping is not None:
                shape = (count, attn.num_kv_heads, attn.head_dim)
                attn.attn.impl.do_kv_cache_update(attn.attn, k.reshape(shape), v.reshape(shape), attn.attn.kv_cache,
                                                  context_slot_mapping)
        self._context = None if context_slot_mapping is None else (
            context_slot_mapping[:count], context_positions[:count], aux[:, 0])

    # -- queries: the streams ---------------------------------------------------------------------
    def _mains(self, positions: torch.Tensor, per_request: int) -> tuple[torch.Tensor, int, torch.Tensor] | None:
        """Each request's main hidden state at its last accepted position p (from the context rows
        of this pass), the number of requests, and whether each row was found at p; None in a
        pass without context (profiling)."""
        context, self._context = self._context, None
        metadata = get_forward_context().attn_metadata
        if context is None or not isinstance(metadata, dict):
            return None
        md = metadata.get(self.model.layers[0].self_attn.attn.layer_name)
        if md is None:
            return None
        slots, context_positions, main = context
        requests = int(md.num_actual_tokens) // per_request
        last = positions[:requests * per_request:per_request].long() - 1  # p of each request
        block = self.cache_config.block_size
        wanted = md.block_table[torch.arange(requests, device=last.device), last // block].long() * block + last % block
        hits = slots[None, :].long() == wanted[:, None]  # [requests, context rows]
        row = hits.int().argmax(dim=1)
        found = hits.any(dim=1) & (context_positions.index_select(0, row) == last)
        return main.index_select(0, row), requests, found

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # this step's drafts a request (a schedule's K', `streamspec.vllm.schedule`), else the configured K
        per_request = (self.num_drafts if self.step_drafts is None else self.step_drafts) + 1
        count = positions.shape[0]
        rows = torch.arange(count, device=positions.device)
        offset = rows % per_request  # 0: the bonus token's row (stream 1), i: mask row i (stream i+1)
        hidden = self.config.hidden_size
        dtype = self.stream_vectors.dtype
        found_mains = self._mains(positions, per_request)
        main = torch.zeros(count, hidden, dtype=dtype, device=positions.device)
        requests, found = 0, None
        if found_mains is not None:
            mains, requests, found = found_mains
            main[:requests * per_request] = mains.to(dtype).repeat_interleave(per_request, dim=0)
        stream = (offset + 1).clamp(max=self.num_streams)
        # streams that read the next token: each request's bonus token (its row 0), the token at p+1,
        # mapped once a request and shared by its rows
        next_mapped = None
        if self.next_token_map is not None:
            firsts = torch.arange(0, count, per_request, device=positions.device)
            next_mapped = self._next_token_term(input_ids.index_select(0, firsts)).index_select(0, rows // per_request)
        normed, _ = self._stream_pass(main, stream, self._ones(count, dtype, positions.device), positions, next_mapped)
        # draft k (mask row k) is stream k, the row before it
        out = normed.index_select(0, rows - (offset > 0).long())
        if self._alignment_log and found is not None:
            self._log_dflash(positions, out, requests, per_request, found)
        return out

    def _log_dflash(self, positions, out, requests: int, per_request: int, found: torch.Tensor) -> None:
        """See ALIGNMENT_ENV: per request, whether its main state was found at p (``checked`` /
        ``agreed``), whether its query rows sit at p+1…p+K+1, and its drafts with p."""
        passes = []
        positions_ok = True
        if requests:
            grid = positions[:requests * per_request].view(requests, per_request).long()
            positions_ok = bool((grid == grid[:, :1] + torch.arange(per_request, device=grid.device)).all())
            mask_rows = out[:requests * per_request].view(requests, per_request, -1)[:, 1:]
            drafts = self.compute_logits(mask_rows.reshape(-1, mask_rows.shape[-1])).argmax(dim=-1)
            passes = [[int(p) - 1, d] for p, d in zip(grid[:, 0].tolist(), drafts.view(requests, -1).tolist())]
        self._record_alignment(requests, int(found.sum()), positions_ok, passes,
                               "requests' main states found at p; query positions")


class DFlashLlamaStreamsDrafter(DFlashStreamsDrafter):
    decoder_layer = LlamaDecoderLayer


class DFlashMistralStreamsDrafter(DFlashStreamsDrafter):
    decoder_layer = MistralDecoderLayer


class DFlashQwen2StreamsDrafter(DFlashStreamsDrafter):
    def _make_layer(self, vllm_config: VllmConfig, prefix: str) -> torch.nn.Module:
        return Qwen2DecoderLayer(self.config, cache_config=vllm_config.cache_config, prefix=prefix)
