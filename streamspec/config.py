"""`StreamConfig`: what a streamed model is, validated on construction; and `build_section`, the strict
typed reading of a YAML section into a dataclass that recipes and SpecReason configs share.

The same dataclass is the `streams:` section of a recipe and the content of a checkpoint's
`stream_config.json`, so every field is a plain JSON value.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

STREAM_INITS = ("identity", "lowrank", "value_rotation")
MODES = ("shared", "lossless")
STREAM_TARGETS = ("labels", "main")


@dataclass
class StreamConfig:
    """Configuration of the speculative streams added to a causal LM.

    Args:
        num_streams: γ, the number of speculative streams per position. Stream j (1..γ) at
            position t predicts the token at t+1+j; the main stream predicts t+1.
        stream_layers: Ns, how many of the model's top decoder layers are multi-stream
            attention (MSA) layers. Streams are inserted at the input of layer N−Ns.
        stream_init: how a stream's initial hidden state is made from the main one:
            ``"identity"`` (S_j = M + P_j, the paper's choice), ``"lowrank"`` (S_j = M + B·A·M + P_j
            with a rank-``init_rank`` map that starts at zero), or ``"value_rotation"`` (no new
            stream parameters: S_j = M, and each stream's attention values are rotated by an
            angle proportional to j).
        init_rank: rank η of the ``"lowrank"`` map; must be unset for the other inits.
        mode: ``"shared"`` (the main stream also attends to its own position's streams; trained
            with LoRA) or ``"lossless"`` (the main stream never sees streams and the base stays
            frozen, so its outputs are exactly the base model's).
        main_weight: α0, weight of the main next-token loss.
        stream_weights: αj, weight of stream j's loss; a scalar for all streams or a list of γ.
        prune_rank: rank of the early-exit adapter at layer N−Ns used to prune draft trees.
        stream_adapter_rank: rank of stream-only low-rank adapters on every linear layer of the
            MSA layers (``None``: none, the paper's γ·h new parameters). They act on stream rows
            only and the main stream never passes through them, so ``"lossless"`` mode stays
            exact; they give the streams capacity of their own when the base is frozen.
        stream_targets: what stream j at position t learns to predict: ``"labels"``, the data's
            token t+1+j (the paper), or ``"main"``, the main stream's own top-1 prediction of that
            token given the data up to it (self-distillation without generating: drafts are
            accepted when they equal the main stream's predictions, so this is what acceptance
            asks for; meant for a frozen main stream, i.e. lossless mode).
        next_token_input: the streams at position t also read the token at t+1 (its input
            embedding, RMS-normalised, through a learned map that starts at zero): the token a
            drafter that runs after the verify pass (vLLM's DFlash layout) knows and a drafter
            inside it does not. Lossless mode only (the main stream must never see it); such
            streams train and validate, and streamspec's own decoders refuse them.
    """

    num_streams: int = 3
    stream_layers: int = 4
    stream_init: str = "identity"
    init_rank: int | None = None
    mode: str = "shared"
    main_weight: float = 1.0
    stream_weights: float | list[float] = 0.1
    prune_rank: int = 8
    stream_adapter_rank: int | None = None
    stream_targets: str = "labels"
    next_token_input: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_streams, bool) or not isinstance(self.num_streams, int) or self.num_streams < 1:
            raise ValueError(f"StreamConfig.num_streams must be an integer >= 1, got {self.num_streams!r}")
        if isinstance(self.stream_layers, bool) or not isinstance(self.stream_layers, int) or self.stream_layers < 1:
            raise ValueError(f"StreamConfig.stream_layers must be an integer >= 1, got {self.stream_layers!r}")
        if self.stream_init not in STREAM_INITS:
            raise ValueError(f"StreamConfig.stream_init must be one of {list(STREAM_INITS)}, got {self.stream_init!r}")
        if self.stream_init == "lowrank":
            if self.init_rank is None:
                self.init_rank = 8
            if isinstance(self.init_rank, bool) or not isinstance(self.init_rank, int) or self.init_rank < 1:
                raise ValueError(f"StreamConfig.init_rank must be an integer >= 1 for 'lowrank', got {self.init_rank!r}")
        elif self.init_rank is not None:
            raise ValueError(
                f"StreamConfig.init_rank is only used with stream_init='lowrank', got init_rank={self.init_rank!r} "
                f"with stream_init={self.stream_init!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"StreamConfig.mode must be one of {list(MODES)}, got {self.mode!r}")
        self.main_weight = _non_negative("main_weight", self.main_weight)
        weights = self.stream_weights
        if isinstance(weights, (list, tuple)):
            if len(weights) != self.num_streams:
                raise ValueError(
                    f"StreamConfig.stream_weights must be a scalar or a list of num_streams={self.num_streams} "
                    f"values, got a list of {len(weights)}"
                )
            self.stream_weights = [_non_negative(f"stream_weights[{i}]", w) for i, w in enumerate(weights)]
        else:
            w = _non_negative("stream_weights", weights)
            self.stream_weights = [w] * self.num_streams
        if isinstance(self.prune_rank, bool) or not isinstance(self.prune_rank, int) or self.prune_rank < 1:
            raise ValueError(f"StreamConfig.prune_rank must be an integer >= 1, got {self.prune_rank!r}")
        if self.stream_targets not in STREAM_TARGETS:
            raise ValueError(
                f"StreamConfig.stream_targets must be one of {list(STREAM_TARGETS)}, got {self.stream_targets!r}"
            )
        if not isinstance(self.next_token_input, bool):
            raise ValueError(f"StreamConfig.next_token_input must be true or false, got {self.next_token_input!r}")
        if self.next_token_input and self.mode != "lossless":
            raise ValueError("StreamConfig.next_token_input needs mode='lossless': in shared mode the main stream "
                             "attends to the streams and would read the token it predicts")
        rank = self.stream_adapter_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"StreamConfig.stream_adapter_rank must be an integer >= 1 or null, got {rank!r}")

    def check_model(self, num_hidden_layers: int) -> None:
        """Raise if this config cannot be applied to a model with that many decoder layers."""
        if self.stream_layers > num_hidden_layers:
            raise ValueError(
                f"StreamConfig.stream_layers={self.stream_layers} exceeds the model's {num_hidden_layers} decoder "
                f"layers; allowed: 1..{num_hidden_layers}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StreamConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown StreamConfig field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise ValueError(f"StreamConfig.{name} must be a number >= 0, got {value!r}")
    return float(value)


def build_section(cls, values: dict[str, Any], section: str, source: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {[f'{section}.{k}' for k in unknown]}; allowed: {names}")
    values = {key: _coerce(value, hints[key]) for key, value in values.items()}
    for key, value in values.items():  # a nested section (e.g. data.distill) from its mapping
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            values[key] = build_section(hints[key], value, f"{section}.{key}", source)
    for key, value in values.items():
        if not _matches(value, hints[key]):
            raise ValueError(f"{source}: {section}.{key} must be {_type_name(hints[key])}, got {value!r}")
    try:
        return cls(**values)
    except ValueError as err:
        raise ValueError(f"{source}: [{section}] {err}") from err


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, hint: Any) -> Any:
    """YAML 1.1 reads "1e-4" (no dot) as a string; take it as the number it is where one is expected."""
    if isinstance(value, str) and _matches(1.0, hint) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def _matches(value: Any, hint: Any) -> bool:
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (inner,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, inner) for v in value)
    return True


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))
