"""The streams drafter vLLM runs: copies of the base's top Ns layers, the stream vectors and the
stream adapters, behind vLLM's EAGLE-3 drafter interface (parallel drafting).

The rows vLLM's proposer hands `StreamsDrafter.forward` for each request (``hidden_states`` is
the target's residual stream entering layer N−Ns, ``eagle_aux_hidden_state_layer_ids``):

====================  ===========  ====================================  ======================
rows                  positions    hidden                                here
====================  ===========  ====================================  ======================
accepted tokens       …, p−1       the target's, at each position        main rows
last accepted (p)     p            the target's at p                     main row at p
K−1 mask rows         p+1…p+K−1    ``mask_hidden`` (NaN: a marker)       streams 1…K−1 of p
rejected rows         0            (never read)                          ignored
====================  ===========  ====================================  ======================

Attention is causal within the request over the drafter's own paged cache, so stream j sees the
main keys ≤ p and streams 1..j, at position p+j: the pattern the streams were trained with
(`streamspec.patch.layout.stream_allowed`). The main rows are the base's own top layers on the
base's own hidden states, so their keys and values, which the cache keeps, are the base's.

vLLM samples draft k from the k-th of the rows [p, mask 1…K−1]; draft k is the token at p+1+k,
which stream k predicts, and stream k sits one row later. So the hidden state returned for
logits at each of those rows is the next row's; the last mask row has no next stream and repeats
its own (a filler draft that the target rarely accepts). With K = γ+1 every stream drafts.

The drafter refuses a served model that is not its base (layer count, width, vocabulary, and the
embedding rows' fingerprint, checked when vLLM shares the target's embeddings with it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralDecoderLayer
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

from ..fingerprint import same_fingerprint
from ..scales import over_rms, rms
from .format import (ALIGNMENT_ENV, DFLASH, DRAFTER_FORMAT, PEAGLE, check_folder_layout, check_target,
                     draft_range, recommended_drafts)
from .lookup import install_lookup_hook, lookup_source, parse_lookup
from .schedule import check_schedule, install_proposer_hook, zero_drafts_mode

logger = logging.getLogger(__name__)


# HF linear names inside a decoder layer -> (vLLM's fused module, shard id)
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# the adapters each vLLM linear carries, in the order of its output shards
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # input split across ranks, output summed


class _StreamRowMask:
    """Which rows of the pass in progress are stream rows ([T, 1], 1.0 or 0.0), shared by the
    adapters of one drafter (set by `StreamsDrafter.forward` before its layers run)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None


class _AdaptedLinear(nn.Module):
    """A vLLM linear whose stream rows get the stream adapters' ``up(down(x))`` added (main rows
    pass through untouched). For a fused linear (qkv, gate_up) each part has its own pair; their
    outputs are laid out as vLLM lays out the fused output on this rank. For a row-parallel linear
    (o, down) the input is this rank's slice: the rank-r products are summed across ranks before
    ``up``, as the linear's own products are."""

    def __init__(self, base: nn.Module, rows: _StreamRowMask, parts: list[tuple[int, int]],
                 rank: int, row_parallel: bool) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        self.row_parallel = row_parallel
        in_features = parts[0][0]
        dtype = next(base.parameters()).dtype
        self.down = nn.Parameter(torch.zeros(len(parts) * rank, in_features, dtype=dtype), requires_grad=False)
        self.ups = nn.ParameterList(
            nn.Parameter(torch.zeros(out, rank, dtype=dtype), requires_grad=False) for _, out in parts)
        self.rank = rank

    def forward(self, x: torch.Tensor):
        out, bias = self.base(x)
        mask = self.rows.mask
        if mask is None:
            return out, bias
        low = x @ self.down.t()
        if self.row_parallel and get_tensor_model_parallel_world_size() > 1:
            low = tensor_model_parallel_all_reduce(low)
        lows = low.split(self.rank, dim=-1)
        delta = torch.cat([part @ up.t() for part, up in zip(lows, self.ups)], dim=-1)
        return out + delta * mask, bias


class StreamsDrafter(Eagle3LlamaForCausalLM):
    """Speculative streams as vLLM's EAGLE-3 parallel drafter (see the module docstring). A
    subclass per base family names the decoder layer class."""

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    layout = PEAGLE
    # vLLM's proposer runs each step with the slots of that step's K' (`streamspec.vllm.schedule`)
    drafts_by_batch_size = True
    # the fewest drafts a step of a schedule may ask for (K' = 1 would draft the filler only)
    least_scheduled_drafts = 2

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        spec = vllm_config.speculative_config
        self.config = spec.draft_model_config.hf_config
        facts = getattr(self.config, "streamspec", None)
        if not isinstance(facts, dict) or facts.get("format") != DRAFTER_FORMAT:
            raise ValueError(f"{spec.draft_model_config.model} is not a streamspec drafter folder (its config.json has "
                             "no 'streamspec' section): write one with `streamspec export --format vllm`")
        target = vllm_config.model_config.hf_config
        check_target(facts, target, vllm_config.model_config.get_total_num_hidden_layers())
        check_folder_layout(facts, self.layout)
        self.facts = facts
        self.num_streams = int(facts["num_streams"])
        self.num_drafts = spec.num_speculative_tokens
        # lookup drafts merged into the streams' each step (`streamspec.vllm.lookup`), read by the runner hook
        self.lookup = parse_lookup(facts.get("lookup"))
        self.lookup_source = lookup_source(self.lookup) if self.lookup else None
        self._check_speculative_config(spec)
        check_schedule(spec.num_speculative_tokens_per_batch_size, self.num_drafts, self.num_streams,
                       least=self.least_scheduled_drafts)
        self.zero_drafts = zero_drafts_mode()
        self.step_drafts: int | None = None  # set by the proposer hook at each step (K')
        install_proposer_hook()
        if self.lookup:
            install_lookup_hook()
        self.config.draft_vocab_size = self.config.vocab_size
        # vLLM's layers index the config's per-layer attention kinds relative to the target's layers
        self.config.target_layer_count = int(facts["num_hidden_layers"])
        hidden = self.config.hidden_size
        # the drafter's attention layers are numbered after the target's (vLLM keys each layer's
        # paged cache by its name)
        first = int(facts["num_hidden_layers"])
        self.model = nn.Module()
        # placeholders: vLLM puts the target's own embeddings and LM head in their place
        self.model.embed_tokens = VocabParallelEmbedding(self.config.vocab_size, hidden, prefix=f"{prefix}model.embed_tokens")
        self.model.layers = nn.ModuleList(
            self._make_layer(vllm_config, f"model.layers.{first + i}") for i in range(int(facts["stream_layers"])))
        self.model.norm = RMSNorm(hidden, eps=self.config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.config.vocab_size, hidden, prefix=f"{prefix}lm_head")
        self.logits_processor = LogitsProcessor(self.config.vocab_size, scale=1.0)
        self.draft_id_to_target_id = None
        self.has_own_embed_tokens = False
        self.has_own_lm_head = False
        self.use_parallel_drafting = True
        dtype = vllm_config.model_config.dtype
        # row 0 (main rows) adds nothing; row j the stream vector P_j (in units of the main state's RMS)
        self.stream_vectors = nn.Parameter(torch.zeros(self.num_streams + 1, hidden, dtype=dtype), requires_grad=False)
        # streams that read the next token (`StreamConfig.next_token_input`): its map W
        self.next_token_map = None
        if facts.get("next_token_input"):
            if self.layout != DFLASH:
                raise ValueError(f"the drafter folder's streams read the next token, which vLLM hands the drafter in "
                                 f"the {DFLASH!r} layout only; export them with --layout {DFLASH}")
            self.next_token_map = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
            self.next_token_map.weight.requires_grad_(False)
        self._rows = _StreamRowMask()
        rank = facts.get("stream_adapter_rank")
        if rank:
            for layer in self.model.layers:
                self._adapt(layer, int(rank))
        # the hidden state vLLM gives mask rows: NaN marks them (a target's hidden state never is)
        self.register_buffer("mask_hidden", torch.full((1, hidden), float("nan"), dtype=dtype), persistent=False)
        # a pruned draft vocabulary (`streamspec export --draft-vocab N`): the target ids the drafts
        # are chosen among, and the rows of the target's LM head for them (taken once it is shared)
        size = facts.get("draft_vocab_size")
        if size and get_tensor_model_parallel_world_size() > 1:
            raise ValueError("a drafter folder with a pruned draft vocabulary runs on one tensor-parallel rank; "
                             "export it without --draft-vocab for tensor parallelism")
        self.register_buffer("draft_vocab", torch.zeros(int(size), dtype=torch.long) if size else None,
                             persistent=False)
        self._draft_head: torch.Tensor | None = None
        self._draft_head_of: torch.Tensor | None = None  # the LM head weight the rows were taken from
        self._base_checked = False
        self._alignment_log = os.environ.get(ALIGNMENT_ENV)

    def _check_speculative_config(self, spec) -> None:
        """Refuse settings this layout cannot draft with (`streamspec.vllm.dflash` has its own)."""
        if not spec.parallel_drafting:
            raise ValueError('the streams drafter drafts all its tokens in one pass: set "parallel_drafting": true '
                             "in --speculative-config")
        self._check_draft_count()

    def _check_draft_count(self) -> None:
        """Refuse a ``num_speculative_tokens`` this layout cannot draft (`draft_range`)."""
        least, most = draft_range(self.num_streams, self.layout, bool(self.lookup))
        if not least <= self.num_drafts <= most:
            beyond = ("" if self.layout == PEAGLE else "; lookup drafts fill positions past γ" if self.lookup
                      else "; past γ only with lookup drafts (`streamspec export --lookup`)")
            every = recommended_drafts(self.num_streams, self.layout)
            raise ValueError(f"num_speculative_tokens must be {least}..{most} for streams with γ = {self.num_streams} "
                             f"in the {self.layout} layout (every stream drafts at {every}{beyond}), got {self.num_drafts}")

    def _make_layer(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return self.decoder_layer(vllm_config, prefix=prefix, config=self.config)

    def _adapt(self, layer: nn.Module, rank: int) -> None:
        """Put `_AdaptedLinear` in place of each linear of `layer`, shaped for this rank's shards."""
        attn = layer.self_attn
        q, kv = attn.q_size, attn.kv_size
        mlp_inner = layer.mlp.gate_up_proj.output_size_per_partition // 2
        hidden = self.config.hidden_size
        shapes = {
            "self_attn.qkv_proj": [(hidden, q), (hidden, kv), (hidden, kv)],
            "self_attn.o_proj": [(attn.o_proj.input_size_per_partition, hidden)],
            "mlp.gate_up_proj": [(hidden, mlp_inner), (hidden, mlp_inner)],
            "mlp.down_proj": [(layer.mlp.down_proj.input_size_per_partition, hidden)],
        }
        for path, parts in shapes.items():
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            setattr(parent, name, _AdaptedLinear(getattr(parent, name), self._rows, parts, rank, path in _ROW_PARALLEL))

    # -- logits ---------------------------------------------------------------------------------
    def _full_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def _pruned_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary only: the target's LM head rows of its ids."""
        weight = self.lm_head.weight  # the served model's once vLLM shares it: taken again if it changes
        if self._draft_head is None or self._draft_head_of is not weight:
            self._draft_head = weight.detach().index_select(0, self.draft_vocab).contiguous()
            self._draft_head_of = weight
        return torch.nn.functional.linear(hidden_states, self._draft_head.to(hidden_states.dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The drafts' logits over the target's vocabulary; with a pruned draft vocabulary, -inf
        outside it (a draft is always one of its ids; the target verifies every draft)."""
        if self.draft_vocab is None:
            return self._full_logits(hidden_states)
        small = self._pruned_logits(hidden_states)
        logits = small.new_full((small.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, self.draft_vocab] = small
        return logits

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The greedy drafts' target ids (vLLM's ``use_local_argmax_reduction``)."""
        if self.draft_vocab is None:
            return self._full_logits(hidden_states).argmax(dim=-1)
        return self.draft_vocab.index_select(0, self._pruned_logits(hidden_states).argmax(dim=-1))

    # -- the pass ---------------------------------------------------------------------------------
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """One aux layer (the input of layer N−Ns): nothing to combine. vLLM calls this right after
        sharing the target's embeddings and LM head, so the first call checks the base."""
        if not self._base_checked:
            self._check_base()
        return hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        marked = torch.isnan(hidden_states[:, 0])
        # each row's main row: itself, or for a marked row the last unmarked row before it (p)
        origin = torch.where(marked, 0, rows).cummax(dim=0).values
        index = rows - origin
        # stream j of p sits at p+j; marked rows elsewhere are left over from earlier passes in rows
        # vLLM does not read (a request's rejected rows, at position 0)
        is_stream = marked & (index <= self.num_streams) & (positions == positions.index_select(0, origin) + index)
        index = torch.where(is_stream, index, 0)
        main = hidden_states.index_select(0, origin).nan_to_num()
        normed, prenorm = self._stream_pass(main, index, is_stream[:, None].to(main.dtype), positions)
        # draft k is sampled from the row before stream k (see the module docstring)
        after = (rows + 1).clamp(max=rows.shape[0] - 1)
        take_next = is_stream.index_select(0, after) & (origin.index_select(0, after) == origin) & (after != rows)
        out = normed.index_select(0, torch.where(take_next, after, rows))
        if self._alignment_log:
            self._log_alignment(input_ids, positions, normed, out, marked, is_stream, take_next, index)
        return out, prenorm

    def _stream_pass(self, main: torch.Tensor, stream: torch.Tensor, mask: torch.Tensor,
                     positions: torch.Tensor, next_mapped: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``main + rms(main)·P_stream`` (stream 0: the main row itself, P_0 = 0) through the
        drafter's layers, the stream adapters applied where `mask` is 1; (normed, pre-norm). With
        `next_mapped` (`_next_token_term` of the token after each row's main position; streams that
        read it) each row also gets ``rms(main)·W·n(E(next))``."""
        scale = rms(main)
        x = main + (scale * self.stream_vectors.index_select(0, stream).float()).to(main.dtype)
        if next_mapped is not None:
            x = x + (scale.to(next_mapped.dtype) * next_mapped).to(main.dtype)
        self._rows.mask = mask
        try:
            residual = None
            for layer in self.model.layers:
                x, residual = layer(positions=positions, hidden_states=x, residual=residual)
        finally:
            self._rows.mask = None
        return self.model.norm(x, residual)

    def _next_token_term(self, ids: torch.Tensor) -> torch.Tensor:
        """W·n(E(ids)): the tokens' input embeddings over their RMS through the next-token map."""
        weight = self.next_token_map.weight
        return self.next_token_map(over_rms(self.model.embed_tokens(ids).to(weight.dtype)))

    # -- checks -----------------------------------------------------------------------------------
    def _check_base(self) -> None:
        """Refuse a served model whose embedding rows are not the base's (same shape, other weights)."""
        recorded = self.facts.get("base_fingerprint")
        embed = self.model.embed_tokens
        if recorded and isinstance(embed, VocabParallelEmbedding):
            weight, shard = embed.weight, embed.shard_indices
            vocab = int(self.facts["vocab_size"])
            sums, expected = [], []
            if shard.org_vocab_start_index == 0:
                sums += weight[:8].detach().double().sum(dim=1).tolist()
                expected += recorded[:8]
            if shard.org_vocab_end_index == vocab:
                local = vocab - shard.org_vocab_start_index
                sums += weight[local - 8: local].detach().double().sum(dim=1).tolist()
                expected += recorded[8:]
            if expected and not same_fingerprint(expected, sums):
                raise ValueError(
                    f"the streams drafter was exported from {self.facts.get('base_name')!r}, and the model vLLM "
                    "serves has other weights (its embedding rows differ): export the drafter from a checkpoint "
                    "trained on this model")
        self._base_checked = True

    def _log_alignment(self, input_ids, positions, normed, out, marked, is_stream, take_next, index) -> None:
        """See ALIGNMENT_ENV. Rows at a last accepted position p that have streams after them: their
        main output must predict the token just sampled (``input_ids`` there). Each such row's
        drafts (the argmax of streams 1…K−1) are logged with p, so a test can compare them with
        streamspec's own stream predictions for the same text."""
        last = ((~is_stream) & take_next).nonzero().flatten()
        checked, agreed, passes = int(last.numel()), 0, []
        if checked:
            agreed = int((self._full_logits(normed[last]).argmax(dim=-1) == input_ids[last].long()).sum())
            # this pass's K'−1 stream rows after each last accepted row (K' may vary by batch size)
            streams = int(torch.where(is_stream, index, 0).max())
            rows = (last[:, None] + torch.arange(streams, device=last.device)).clamp(max=out.shape[0] - 1)
            drafts = self.compute_logits(out[rows.flatten()]).argmax(dim=-1).view(rows.shape)
            passes = [[int(p), d] for p, d in zip(positions[last].tolist(), drafts.tolist())]
        # a marked row at a real position that is not where its stream belongs
        positions_ok = not bool((marked & ~is_stream & (positions > 0)).any())
        self._record_alignment(checked, agreed, positions_ok, passes,
                               "last accepted rows predict the sampled token; stream positions")

    def _record_alignment(self, checked: int, agreed: int, positions_ok: bool, passes: list, what: str) -> None:
        """One pass's line in the ALIGNMENT_ENV log (either layout); an error logged when a row was
        out of place."""
        if agreed < checked or not positions_ok:
            logger.error("%s streams drafter out of alignment: %d of %d %s %s", type(self).__name__, agreed, checked,
                         what, "ok" if positions_ok else "wrong")
        with open(self._alignment_log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"checked": checked, "agreed": agreed, "positions_ok": positions_ok,
                                "passes": passes}) + "\n")

    # -- weights ----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a drafter folder's weights (`streamspec.vllm.export` names them); refuse a folder
        with missing or unexpected tensors instead of leaving weights at zero."""
        params = dict(self.named_parameters())
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        loaded: set[str] = set()
        unexpected = []
        adapters: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if name == "stream_vectors":
                self.stream_vectors[1:].copy_(tensor)
                loaded.add(name)
                continue
            if name == "next_token_map.weight" and self.next_token_map is not None:
                self.next_token_map.weight.copy_(tensor)
                loaded.add(name)
                continue
            if name == "draft_vocab" and self.draft_vocab is not None and tensor.shape == self.draft_vocab.shape:
                self.draft_vocab.copy_(tensor)
                self._draft_head = None
                loaded.add(name)
                continue
            if name.startswith("adapters."):
                _, layer, linear, which = name.split(".")
                adapters.setdefault((int(layer), linear.replace("-", ".")), {})[which] = tensor
                loaded.add(name)
                continue
            target, shard = self._vllm_name(name)
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(target)
        if self.facts.get("stream_adapter_rank"):
            wanted = {(i, linear) for i in range(len(self.model.layers)) for parts in _FUSED.values() for linear in parts}
            incomplete = sorted(k for k in wanted if set(adapters.get(k, {})) != {"down", "up"})
            if incomplete or set(adapters) - wanted:
                raise ValueError(f"the drafter folder's stream adapters do not match its layers: incomplete {incomplete[:3]}, "
                                 f"unexpected {sorted(set(adapters) - wanted)[:3]}")
        for (layer, linear), pair in adapters.items():
            self._load_adapter(layer, linear, pair, tp_rank, tp_size)
        expected = {n for n in params if not n.startswith(("model.embed_tokens", "lm_head")) and not n.endswith(".down")
                    and ".ups." not in n}
        if self.draft_vocab is not None:
            expected.add("draft_vocab")
        missing = sorted(expected - loaded)
        if unexpected or missing:
            raise ValueError(f"the drafter folder does not match its config: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}")
        return set(params)

    def _vllm_name(self, name: str) -> tuple[str, object]:
        """A drafter folder's tensor name -> (this module's parameter name, shard id or None)."""
        if name == "norm.weight":
            return "model.norm.weight", None
        prefix, _, rest = name.partition(".")  # layers.{i}.<HF path>
        index, _, path = rest.partition(".")
        module, _, leaf = path.rpartition(".")
        shard = None
        if module in _STACKED:
            module, shard = _STACKED[module]
        if self.facts.get("stream_adapter_rank") and module in _FUSED:
            module = module + ".base"
        return f"model.layers.{index}.{module}.{leaf}", shard

    def _load_adapter(self, layer: int, linear: str, pair: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
        """Put one HF linear's adapter pair into its fused vLLM linear, sliced to this rank."""
        fused = next(f for f, parts in _FUSED.items() if linear in parts)
        part = _FUSED[fused].index(linear)
        module = self.model.layers[layer].get_submodule(fused)
        down, up = pair["down"], pair["up"]
        if fused in _ROW_PARALLEL:  # this rank's slice of the input
            width = module.down.shape[1]
            down = down[:, tp_rank * width:(tp_rank + 1) * width]
        else:  # this rank's slice of the output, as vLLM shards the weight
            width = module.ups[part].shape[0]
            attn = self.model.layers[layer].self_attn
            if linear in ("self_attn.k_proj", "self_attn.v_proj") and attn.total_num_kv_heads < tp_size:
                shard_rank = tp_rank // (tp_size // attn.total_num_kv_heads)  # replicated kv heads
            else:
                shard_rank = tp_rank
            up = up[shard_rank * width:(shard_rank + 1) * width]
        module.down[part * module.rank:(part + 1) * module.rank].copy_(down)
        module.ups[part].copy_(up)


class LlamaStreamsDrafter(StreamsDrafter):
    decoder_layer = LlamaDecoderLayer


class MistralStreamsDrafter(StreamsDrafter):
    decoder_layer = MistralDecoderLayer


class Qwen2StreamsDrafter(StreamsDrafter):
    def _make_layer(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return Qwen2DecoderLayer(self.config, cache_config=vllm_config.cache_config, prefix=prefix)
