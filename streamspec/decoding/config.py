"""`DecodeConfig`: the decode options, in one typed place.

The options that shape how a streamed model (or one with Medusa heads) decodes: the draft tree
(`tree_top_k`, `tree_budget`, `lookup`), its pruning (`prune_threshold`), where a pass verifies
(`verify`) and whether it is compiled (`compile`). `generate`, `DecodingSession`, the server's
`Engine` and the command line all take this one dataclass, so an option exists everywhere or
nowhere: the CLI flags of `streamspec generate` and `streamspec serve` are made from its fields
(`add_decode_arguments`, `decode_config_from_args`), as litgpt's argument classes are its CLI.

Checks come in two steps: the values themselves when the config is made (`__post_init__`: a bad
value fails before any model is loaded), and what depends on the model and the batch when it is
used (`DecodeConfig.check`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .lookup import PromptLookup
from .tree import tree_shape

VERIFY_CHOICES = ("auto", "device", "host")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


# ----------------------------------------------------------------------------- CLI value parsers

def tree_arg(text: str) -> int | tuple[int, ...]:
    """``3`` (three candidates at every depth) or ``3,1,1`` (per depth) for --tree-top-k."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or comma-separated ints such as 3,1,1; got {text!r}") from None
    return values[0] if len(values) == 1 else values


def lookup_arg(text: str) -> PromptLookup:
    """``L,M[,N]`` (branch tokens, matches, n-gram) for --lookup: a `PromptLookup`."""
    try:
        return PromptLookup.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def compile_arg(text: str) -> bool | str:
    """``on``/``off`` (also true/false, 1/0), ``auto`` (`compile_pays`) or a torch.compile backend
    name for --compile."""
    lowered = text.lower()
    if lowered == "auto":
        return "auto"
    if lowered in ("on", "true", "1", "yes"):
        return True
    if lowered in ("off", "false", "0", "no"):
        return False
    if lowered in COMPILE_BACKENDS:
        return lowered
    raise argparse.ArgumentTypeError(f"expected on, off, auto or a backend {list(COMPILE_BACKENDS)}; got {text!r}")


def compile_pays(device: torch.device | str, dtype: torch.dtype, model=None) -> bool:
    """The rule ``compile="auto"`` follows: whether a compiled step is faster than the eager one
    for a model on `device` in `dtype`. On CUDA always (one graph replaces a launch per kernel:
    the step is launch-bound at batch 1). On a CPU in bfloat16 too: measured faster there
    (`eval/step_speed.py`, docs/benchmarks.md "The step at the machine's limit"). In float32 on
    a CPU where streamspec's own kernels run (`streamspec.native`: the attention kernel in float32
    too, the kernels called from the graph in C++): measured faster (one token 22.7 ms a step
    compiled against 29.7 eager, tree (2,1,1) 42.1 against 48.4, one thread of this project's
    AMD EPYC); elsewhere in float32 the eager step with the packed oneDNN kernels is kept
    (measured as fast or faster without them), and so is a given `model` none of whose layers is
    packed with streamspec's kernel (`streamspec.kernels.PackedLinear`; torch's default kernels,
    ``--default-kernels``, or oneDNN alone, ``own_kernel=False``)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return True
    if kind != "cpu":
        return False
    if dtype == torch.bfloat16:
        return True
    if dtype == torch.float32:
        from .. import native
        from ..kernels import PackedLinear

        packed = model is None or any(type(m) is PackedLinear and m.__dict__.get("_streamspec_own", True)
                                      for m in model.modules())
        return packed and native.bf16_linear() is not None
    return False


def _option(help: str, parse=None, metavar: str | None = None, choices=None) -> dict:
    return {"help": help, "parse": parse, "metavar": metavar, "choices": choices}


@dataclass(frozen=True)
class DecodeConfig:
    """How a streamed model decodes (see the module docstring and `streamspec.decoding.generate`).

    Attributes:
        tree_top_k: candidates per stream, or per depth (``(3, 1, 1)``); None: 3 for one sequence,
            1 (the single best path) for a batch.
        prune_threshold: drop draft children whose early-exit transition probability is below it
            (streams only; fixed trees).
        lookup: prompt-lookup branches in the draft tree (one sequence, unpruned).
        tree_budget: grow each pass's tree by confidence up to this many nodes (one sequence,
            unpruned).
        verify: where a pass decides what it accepts: ``auto``, ``device`` or ``host``.
        compile: run each draft-tree pass through torch.compile with static shapes (True: the
            inductor backend, or a backend name); unpruned (one sequence or a batch's chains);
            trees built on the host (lookup, tree_budget) are padded to a few fixed sizes.
            ``"auto"``: compiled where `compile_pays` says it is faster and the rest of the
            options allow it (no pruning, no host walk), else eager (`resolved`).
    """

    tree_top_k: int | tuple[int, ...] | None = field(default=None, metadata=_option(
        "candidates per stream, or per depth: 3,1,1 (default: 3; a batch: 1)", tree_arg))
    prune_threshold: float | None = field(default=None, metadata=_option(
        "drop draft children whose early-exit transition probability is below this (streams only)", float))
    lookup: PromptLookup | None = field(default=None, metadata=_option(
        "prompt-lookup branches in the draft tree: up to M continuations of L tokens of the latest n-gram "
        "(N, default 3) found earlier in the text (streamspec.decoding.lookup)", lookup_arg, "L,M[,N]"))
    tree_budget: int | None = field(default=None, metadata=_option(
        "grow each pass's tree by confidence up to N nodes from --tree-top-k candidates per stream", int, "N"))
    verify: str = field(default="auto", metadata=_option(
        "where a pass verifies its draft: device (tensor ops, one read a pass), host (a walk down the accepted "
        "path), auto (host on a CPU, device elsewhere)", None, None, VERIFY_CHOICES))
    compile: bool | str = field(default=False, metadata=_option(
        "compile each pass with static shapes (on, off, auto: where it is faster and the tree allows, or a "
        "torch.compile backend)", compile_arg, "on|off|auto|BACKEND"))

    def __post_init__(self) -> None:
        top_k = self.tree_top_k
        if isinstance(top_k, list):
            object.__setattr__(self, "tree_top_k", tuple(top_k))
        if top_k is not None:
            tree_shape(self.tree_top_k, len(self.tree_top_k) if isinstance(self.tree_top_k, tuple) else 1)
        if self.prune_threshold is not None and (isinstance(self.prune_threshold, bool)
                                                 or not 0 <= self.prune_threshold < 1):
            raise ValueError(f"prune_threshold must be in [0, 1) or None, got {self.prune_threshold!r}")
        if self.lookup is not None and not isinstance(self.lookup, PromptLookup):
            raise TypeError(f"lookup must be a streamspec.decoding.lookup.PromptLookup or None, got "
                            f"{type(self.lookup).__name__}")
        budget = self.tree_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"tree_budget must be an int >= 1 (nodes, the root included) or None, got {budget!r}")
        if self.verify not in VERIFY_CHOICES:
            raise ValueError(f"verify must be one of {list(VERIFY_CHOICES)}, got {self.verify!r}")
        if not (isinstance(self.compile, bool) or self.compile in COMPILE_BACKENDS or self.compile == "auto"):
            raise ValueError(f"compile must be a bool, 'auto' or one of {list(COMPILE_BACKENDS)}, got {self.compile!r}")
        backend = self.compile_backend
        if backend is not None:
            if self.prune_threshold is not None:
                raise ValueError("compile=True needs prune_threshold=None: pruning changes the number of tree rows in "
                                 "the middle of a pass, which a static-shape compiled pass cannot follow")
            if self.verify == "host":
                raise ValueError("compile=True compiles the device step: verify must be 'device' or 'auto'")
        for feature, value in (("lookup branches", self.lookup), ("tree_budget", self.tree_budget)):
            if value is None:
                continue
            if self.prune_threshold is not None:
                self._host_tree_refused(feature, "prune_threshold (pruning needs the fixed tree's node order)")

    @staticmethod
    def _host_tree_refused(feature: str, why: str) -> None:
        raise ValueError(f"{feature}: each pass's tree is built on the host, for one sequence's "
                         f"speculative decoding; not with {why}")

    # -- derived -------------------------------------------------------------------------------
    def resolved(self, model, batch: int = 1, speculative: bool = True) -> "DecodeConfig":
        """This config with ``compile="auto"`` decided for `model` (`compile_pays` on its device
        and dtype, where a compiled pass can run: no pruning, device verification; a batch's
        chains as one sequence's trees, except a float32 batch on a CPU, measured no faster compiled);
        any other config unchanged."""
        if self.compile != "auto":
            return self
        try:
            param = next(model.parameters())
        except (StopIteration, AttributeError):
            return self.replace(compile=False)
        possible = self.prune_threshold is None and self.verify != "host" and hasattr(model, "num_drafts")
        # a batch's compiled chains were measured faster in bfloat16 on a CPU (docs/benchmarks.md,
        # "Batches": 73.8 against 62.6 tokens/s), not in float32 (25.7 against 26.1): there a
        # batch stays eager unless compile is asked for
        possible &= not (batch > 1 and param.device.type == "cpu" and param.dtype == torch.float32)
        return self.replace(compile=bool(possible and compile_pays(param.device, param.dtype, model)))

    @property
    def compile_backend(self) -> str | None:
        """The torch.compile backend, or None when uncompiled (``"auto"`` before `resolved`)."""
        if self.compile is False or self.compile == "auto":
            return None
        return "inductor" if self.compile is True else self.compile

    @property
    def host_tree(self) -> bool:
        """Whether each pass's tree is built on the host (lookup branches or a confidence budget)."""
        return self.lookup is not None or self.tree_budget is not None

    def shape(self, num_streams: int, batch: int = 1) -> tuple[int, ...]:
        """The tree's candidates per depth for a model with `num_streams` streams."""
        top_k = self.tree_top_k if self.tree_top_k is not None else (1 if batch > 1 else 3)
        return tree_shape(top_k, num_streams)

    def walks_on_host(self, device: torch.device | str) -> bool:
        """Whether a pass verifies its draft with the host walk (see `generate`'s ``verify``)."""
        from ..devices import formulation

        auto_host = self.verify == "auto" and formulation(device, None, native_ready=False).host_walk
        return self.compile_backend is None and (self.verify == "host" or auto_host)

    def replace(self, **changes: Any) -> "DecodeConfig":
        return dataclasses.replace(self, **changes)

    # -- against a model and a batch -----------------------------------------------------------
    def check(self, model, batch: int = 1, speculative: bool = True) -> "DecodeConfig":
        """Refuse what this model or batch cannot do (a clear ValueError naming the option);
        returns self."""
        from ..patch.decoder import DecoderParts
        from ..patch.model import StreamedModel

        self = self.resolved(model, batch, speculative)  # compile="auto" decided for this model
        if not isinstance(model, DecoderParts):
            if self != DecodeConfig(verify=self.verify):
                raise ValueError("tree_top_k, prune_threshold, lookup, tree_budget and compile are for streamed models "
                                 "(they shape the draft tree); this model has no streams")
            return self
        if self.prune_threshold is not None and not isinstance(model, StreamedModel):
            raise ValueError(f"prune_threshold needs streams (their early-exit estimator); {type(model).__name__} has none")
        shape = self.shape(model.num_drafts, batch)  # raises on a bad shape
        backend = self.compile_backend
        if batch > 1:
            if shape != (1,) * model.num_drafts or self.prune_threshold is not None:
                raise ValueError("a batch decodes the single best path per sequence: tree_top_k must be 1 (or unset) "
                                 "and prune_threshold None")
            for feature, value in (("lookup branches", self.lookup), ("tree_budget", self.tree_budget)):
                if value is not None:
                    self._host_tree_refused(feature, "a batch (B > 1)")
        if not speculative:
            for feature, value in (("lookup branches", self.lookup), ("tree_budget", self.tree_budget)):
                if value is not None:
                    self._host_tree_refused(feature, "speculative=False")
        return self


def check_generate_args(model, input_ids, max_new_tokens, config: DecodeConfig, attention_mask, speculative,
                         caller="generate") -> None:
    """What `generate` refuses besides the decode options' own checks (`DecodeConfig.check`)."""
    from ..arch import context_positions
    from ..patch.decoder import DecoderParts

    if not isinstance(model, DecoderParts):
        raise TypeError(f"{caller} needs a StreamedModel (see add_streams) or a MedusaModel (add_medusa_heads), "
                        f"got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got {shape}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    config.check(model, batch=input_ids.shape[0], speculative=speculative)
    if input_ids.shape[0] > 1 and not speculative:
        raise ValueError("speculative=False decodes one sequence at a time; pass a batch of 1")
    g = model.num_drafts
    limit = context_positions(model.config)
    if limit is not None and input_ids.shape[1] + max_new_tokens + g > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) + the {g} stream positions "
            f"after the last token exceed the model's context of {limit} positions"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


# ----------------------------------------------------------------------------- the CLI, from the fields

def decode_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(DecodeConfig))


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_decode_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                         only: tuple[str, ...] | None = None, prefix: str = "") -> None:
    """One flag per `DecodeConfig` field (``--tree-top-k``, ``--prune-threshold``, ``--lookup``,
    ``--tree-budget``, ``--verify``, ``--compile``), with the field's parser and help; `defaults`
    overrides a field's default for this command; `only` keeps those fields; `prefix` (e.g.
    ``drafter-``) names one role's options (``--drafter-tree-top-k``, dest ``drafter_tree_top_k``)."""
    defaults = defaults or {}
    for f in decode_fields():
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        dest = prefix.replace("-", "_") + f.name
        kwargs: dict[str, Any] = {"dest": dest, "default": defaults.get(f.name, f.default), "help": meta["help"]}
        if meta["parse"] is not None:
            kwargs["type"] = meta["parse"]
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        if meta["choices"]:
            kwargs["choices"] = list(meta["choices"])
        parser.add_argument("--" + prefix + f.name.replace("_", "-"), **kwargs)


def decode_config_from_args(args: argparse.Namespace, only: tuple[str, ...] | None = None) -> DecodeConfig:
    """The `DecodeConfig` of parsed arguments (from `add_decode_arguments`, with the same `only`)."""
    return DecodeConfig(**{f.name: getattr(args, f.name) for f in decode_fields() if only is None or f.name in only})


def decode_config_of(config: DecodeConfig | None, **options: Any) -> DecodeConfig:
    """`config`, or one made from keyword options (the functions that took each option as its own
    keyword still do); giving both is refused, so nothing is silently overridden."""
    given = {k: v for k, v in options.items() if v != DecodeConfig.__dataclass_fields__[k].default}
    if config is None:
        return DecodeConfig(**options)
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be a DecodeConfig, got {type(config).__name__}")
    if given:
        raise ValueError(f"give the decode options in config or as keywords, not both (keywords: {sorted(given)})")
    return config
