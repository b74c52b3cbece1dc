"""The weights the patch adds: `StreamParameters` (stream identifiers, the init map, the early-exit
adapter and, optionally, `StreamAdapters`: stream-only low-rank adapters on the MSA layers'
linears), which is all a streamed checkpoint saves of the patch."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import StreamConfig
from ..scales import over_rms, rms
from .stream_modules import StreamModule, unwrap

STREAM_INIT_STD = 0.3


class StreamParameters(nn.Module):
    """Everything the patch adds: stream identifiers P_j, the optional low-rank init map, and the
    early-exit adapter. Only this module (and a LoRA adapter) is saved in a streamed checkpoint."""

    def __init__(self, config: StreamConfig, hidden_size: int) -> None:
        super().__init__()
        g = config.num_streams
        if config.stream_init != "value_rotation":
            # In units of the main state's RMS (see make_streams): each stream starts 30% away.
            self.stream_embeddings = nn.Parameter(torch.randn(g, hidden_size) * STREAM_INIT_STD)
        if config.stream_init == "lowrank":
            self.init_down = nn.Linear(hidden_size, config.init_rank, bias=False)
            self.init_up = nn.Linear(config.init_rank, hidden_size, bias=False)
            nn.init.zeros_(self.init_up.weight)  # f starts as the identity
        # Residual low-rank adapter; zero-initialised up-projection so it starts as the logit lens.
        self.exit_down = nn.Linear(hidden_size, config.prune_rank, bias=False)
        self.exit_up = nn.Linear(config.prune_rank, hidden_size, bias=False)
        nn.init.normal_(self.exit_down.weight, std=1.0 / math.sqrt(hidden_size))
        nn.init.zeros_(self.exit_up.weight)
        if config.next_token_input:
            # the next token's normalised embedding, mapped into the streams; starts at zero
            self.next_token_map = nn.Linear(hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.next_token_map.weight)
        self.num_streams = g

    @property
    def reads_next_token(self) -> bool:
        return hasattr(self, "next_token_map")

    def make_streams(self, main: torch.Tensor, next_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """S_j = f(M) + rms(M)·P_j: [B, S, h] main hidden states -> [B, S, γ, h] stream states.
        With ``next_token_input`` every stream also gets rms(M)·W·n(E), n(E) the next token's input
        embedding `next_embeds` [B, S, h] over its RMS.

        P_j is expressed in units of the main state's root-mean-square (detached). Hidden states
        at layer N−Ns are large (RMS ≈ 225 for SmolLM2-135M) and their scale differs by orders of
        magnitude between models; an unscaled P_j of the usual init size would be thousands of
        times smaller than M, every stream would start as a copy of the main stream, and the
        fine-tuning learning rate would be far too small to grow it. In these units one init and
        one learning rate fit every model.
        """
        dtype = self.dtype
        if hasattr(self, "init_down"):
            main = main + self.init_up(self.init_down(main.to(dtype))).to(main.dtype)
        streams = main[:, :, None, :].expand(-1, -1, self.num_streams, -1)
        if hasattr(self, "stream_embeddings") or self.reads_next_token:  # rms(M), once
            scale = rms(main).to(dtype)
        if hasattr(self, "stream_embeddings"):
            streams = streams + (scale[:, :, None, :] * self.stream_embeddings).to(main.dtype)
        if self.reads_next_token:
            if next_embeds is None:
                raise ValueError(
                    "these streams read the token after each position (StreamConfig.next_token_input): they draft "
                    "where that token is known, after the verify pass (training and validation here); streamspec's "
                    "decoders draft inside the verify pass and cannot run them: serve them as vLLM's drafter "
                    "(`streamspec export --format vllm`, docs/serving.md)")
            mapped = self.next_token_map(over_rms(next_embeds.to(dtype)))
            streams = streams + (scale * mapped)[:, :, None, :].to(main.dtype)
        return streams

    def forward(self, main: torch.Tensor, next_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`make_streams`, as a module call: DeepSpeed ZeRO-3 gathers a module's own partitioned
        parameters (the P_j) around its calls only, for the forward and the backward pass."""
        return self.make_streams(main, next_embeds)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of these parameters: float32 master weights in reduced-precision training
        (`streamspec.training.trainer`), else the base's; inputs are cast to it and results back."""
        return self.exit_down.weight.dtype

    def early_exit(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.exit_up(self.exit_down(hidden.to(self.dtype))).to(hidden.dtype)


class StreamAdapters(nn.Module):
    """Stream-only low-rank adapters: for each MSA layer and each of its linear layers, a residual
    ``up(down(x))`` added to that linear's output on stream rows only (``up`` starts at zero, so
    the streams start as without adapters). Keys are the linear's name inside its layer. The
    weights live here (and are saved from here); a `StreamAdapter` wrapper in place of each linear
    applies them."""

    def __init__(self, targets: list[list[tuple[str, int, int]]], rank: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for layer_targets in targets:
            adapters = nn.ModuleDict()
            for name, fan_in, fan_out in layer_targets:
                pair = nn.Module()
                pair.down = nn.Linear(fan_in, rank, bias=False)
                pair.up = nn.Linear(rank, fan_out, bias=False)
                nn.init.normal_(pair.down.weight, std=1.0 / math.sqrt(fan_in))
                nn.init.zeros_(pair.up.weight)
                adapters[_adapter_key(name)] = pair
            self.layers.append(adapters)


def _adapter_key(name: str) -> str:
    """A linear's name inside its layer as a ModuleDict key (no dots); `_adapter_target` inverts it."""
    return name.replace(".", "-")


def _adapter_target(key: str) -> str:
    return key.replace("-", ".")


def linear_targets(layer: nn.Module) -> list[tuple[str, int, int]]:
    """The linear layers of a decoder layer as ``(name, in_features, out_features)``: ``nn.Linear``,
    GPT-2's ``Conv1D``, and a peft LoRA wrapper or a stream module counted as the one layer it
    wraps (its insides are skipped), so the names are the same with and without them."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers.pytorch_utils import Conv1D

    found: list[tuple[str, int, int]] = []
    taken: list[str] = []
    for name, module in layer.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if isinstance(module, (BaseTunerLayer, StreamModule)):
            inner = unwrap(module)
            inner = inner.get_base_layer() if isinstance(inner, BaseTunerLayer) else inner
        elif isinstance(module, (nn.Linear, Conv1D)):
            inner = module
        else:
            continue
        if isinstance(inner, Conv1D):
            fan_in, fan_out = inner.weight.shape
        elif isinstance(inner, nn.Linear):
            fan_in, fan_out = inner.in_features, inner.out_features
        else:
            raise TypeError(f"stream adapters support linear layers only; {name} wraps {type(inner).__name__}")
        found.append((name, int(fan_in), int(fan_out)))
        taken.append(name)
    if not found:
        raise ValueError(f"stream adapters found no linear layer in {type(layer).__name__}")
    return found
