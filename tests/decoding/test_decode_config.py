"""`DecodeConfig`: the decode options in one frozen dataclass, checked when made and against a
model; `generate`, `DecodingSession` and the server take it or the old keywords (the same
tokens either way, never both); the CLI flags of `generate` and `serve` are made from its fields,
so no option exists in one place and not another."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from conftest import make_model, random_ids
from streamspec import StreamConfig, add_streams
from streamspec.cli import build_parser
from streamspec.decoding import DecodeConfig, generate
from streamspec.decoding.config import decode_config_from_args, decode_fields, flag_of
from streamspec.decoding.lookup import PromptLookup
from streamspec.decoding.session import DecodingSession

pytestmark = pytest.mark.usefixtures("single_thread")


def _model():
    return add_streams(make_model("llama"), StreamConfig(num_streams=3, stream_layers=2, mode="lossless")).eval()


def test_values_are_checked_when_made():
    for bad, match in ((dict(tree_top_k=0), "tree_top_k"), (dict(tree_top_k=(2, 0)), "tree_top_k"),
                       (dict(prune_threshold=1.0), "prune_threshold"), (dict(tree_budget=0), "tree_budget"),
                       (dict(verify="gpu"), "verify"), (dict(compile="turbo"), "compile"),
                       (dict(compile=True, prune_threshold=0.1), "prune_threshold=None"),
                       (dict(compile=True, verify="host"), "verify"),
                       (dict(lookup=PromptLookup(), prune_threshold=0.1), "lookup branches"),
                       (dict(tree_budget=4, prune_threshold=0.1), "tree_budget")):
        with pytest.raises(ValueError, match=match):
            DecodeConfig(**bad)
    with pytest.raises(TypeError, match="PromptLookup"):
        DecodeConfig(lookup=(8, 2))
    config = DecodeConfig(tree_top_k=[3, 1, 1])
    assert config.tree_top_k == (3, 1, 1) and hash(config)  # frozen: usable as a key
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.verify = "host"


def test_checks_against_the_model_and_batch():
    model = _model()
    assert DecodeConfig().shape(3) == (3, 3, 3) and DecodeConfig().shape(3, batch=2) == (1, 1, 1)
    with pytest.raises(ValueError, match="sequence needs 1 to 3"):
        DecodeConfig(tree_top_k=(2, 2, 2, 2)).check(model)
    with pytest.raises(ValueError, match="single best path"):
        DecodeConfig(tree_top_k=2).check(model, batch=2)
    with pytest.raises(ValueError, match="a batch"):
        DecodeConfig(tree_budget=5).check(model, batch=2)
    assert DecodeConfig(compile="eager").check(model, speculative=False).compile == "eager"  # one token per pass compiles
    with pytest.raises(ValueError, match="speculative=False"):
        DecodeConfig(lookup=PromptLookup()).check(model, speculative=False)
    plain = make_model("llama")
    assert DecodeConfig(verify="host").check(plain) is not None
    with pytest.raises(ValueError, match="streamed models"):
        DecodeConfig(tree_top_k=2).check(plain)
    assert DecodeConfig(verify="auto").walks_on_host("cpu") and not DecodeConfig(verify="device").walks_on_host("cpu")
    assert not DecodeConfig(compile="eager").walks_on_host("cpu")


def test_config_and_keywords_decode_the_same_and_are_not_mixed():
    model = _model()
    ids = random_ids(1, 9, seed=4)
    options = dict(tree_top_k=(2, 1, 1), lookup=PromptLookup(tokens=3, matches=1), verify="device")
    by_keywords = generate(model, ids, 12, **options)
    by_config = generate(model, ids, 12, config=DecodeConfig(**options))
    assert torch.equal(by_keywords.tokens, by_config.tokens)
    assert by_keywords.accepted_per_pass == by_config.accepted_per_pass
    with pytest.raises(ValueError, match="not both"):
        generate(model, ids, 4, config=DecodeConfig(), tree_top_k=2)
    with pytest.raises(TypeError, match="DecodeConfig"):
        generate(model, ids, 4, config={"tree_top_k": 2})
    session = DecodingSession(model, config=DecodeConfig(**options))
    assert session.config == DecodeConfig(**options) and session.shape == (2, 1, 1)
    with pytest.raises(ValueError, match="not both"):
        DecodingSession(model, config=DecodeConfig(), prune_threshold=0.1)


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_decode_option_is_a_flag_of_the_commands_that_decode(command):
    sub = _subparser(command)
    flags = {opt for a in sub._actions for opt in a.option_strings}
    assert {flag_of(f.name) for f in decode_fields()} <= flags
    args = sub.parse_args(["--checkpoint", "x"] + (["--prompt", "p"] if command == "generate" else []) +
                          ["--tree-top-k", "2,1,1", "--lookup", "8,2", "--verify", "device", "--compile", "off",
                           "--tree-budget", "6"])
    assert decode_config_from_args(args) == DecodeConfig(tree_top_k=(2, 1, 1), lookup=PromptLookup(8, 2),
                                                         verify="device", compile=False, tree_budget=6)
    defaults = decode_config_from_args(sub.parse_args(["--checkpoint", "x"] + (["--prompt", "p"] if command == "generate" else [])))
    # tree_top_k None: 3 for one sequence; compiled where it pays; nothing asked of a plain model
    assert defaults == DecodeConfig(compile="auto") and defaults.check(make_model("llama")) is not None
    with pytest.raises(SystemExit):
        sub.parse_args(["--checkpoint", "x", "--verify", "gpu"])


def test_eval_takes_the_options_every_row_shares():
    from streamspec.cli import EVAL_DECODE_FLAGS
    from streamspec.evaluation.benchmark import row_config, streaming_method

    sub = _subparser("eval")
    flags = {opt for a in sub._actions for opt in a.option_strings}
    # its tree flags take auto too, and pruning is --thresholds (tried on validation)
    assert {flag_of(f.name) for f in decode_fields() if f.name != "prune_threshold"} | {"--thresholds"} <= flags
    args = sub.parse_args(["--checkpoint", "x", "--verify", "host"])
    assert decode_config_from_args(args, only=EVAL_DECODE_FLAGS) == DecodeConfig(verify="host", compile="auto")
    # a compiled command: pruned rows run uncompiled, the rest (host-built trees too) compiled
    compiled = DecodeConfig(compile="eager")
    assert row_config(compiled, tree_top_k=2).compile == "eager"
    assert row_config(compiled, tree_top_k=2, lookup=PromptLookup()).compile == "eager"
    assert row_config(compiled, tree_budget=6).compile == "eager"
    assert row_config(compiled, prune_threshold=0.1).compile is False
    assert streaming_method(_model(), 0, compiled, speculative=False).config.compile == "eager"  # streamed_ar too


def test_compile_auto_follows_the_rule_where_a_compiled_pass_can_run():
    from streamspec.decoding.config import compile_arg, compile_pays
    from streamspec.evaluation.benchmark import row_config, streaming_method

    assert compile_arg("auto") == "auto" and DecodeConfig(compile="auto").compile_backend is None
    from streamspec import native

    assert compile_pays("cuda", torch.float32) and compile_pays("cpu", torch.bfloat16)
    # float32 on a CPU: compiled where streamspec's own kernels run (measured faster there), else eager
    fp32_compiles = native.bf16_linear() is not None
    assert compile_pays("cpu", torch.float32) == fp32_compiles
    assert not compile_pays("mps", torch.bfloat16) and not compile_pays("cpu", torch.float16)
    model = _model()  # float32 on the CPU, torch's default kernels: eager
    assert DecodeConfig(compile="auto").resolved(model).compile is False
    from streamspec.kernels import pack_linear_layers, unpack_linear_layers

    pack_linear_layers(model)  # packed: compiled where streamspec's own kernels run
    assert DecodeConfig(compile="auto").resolved(model).compile is fp32_compiles
    assert DecodeConfig(compile="auto").resolved(model, batch=2).compile is False  # a float32 batch: eager
    assert DecodeConfig(compile=True).resolved(model, batch=2).compile is True  # unless asked for
    assert streaming_method(model, 0, DecodeConfig(compile="auto")).config.compile is fp32_compiles
    unpack_linear_layers(model)
    bf16 = _model().to(torch.bfloat16)
    assert DecodeConfig(compile="auto").resolved(bf16).compile is True
    for blocked in (dict(prune_threshold=0.1), dict(verify="host")):
        assert DecodeConfig(compile="auto", **blocked).resolved(bf16).compile is False, blocked
    for host_tree in (dict(lookup=PromptLookup()), dict(tree_budget=5)):  # padded to fixed sizes: compiled
        assert DecodeConfig(compile="auto", **host_tree).resolved(bf16).compile is True, host_tree
    assert DecodeConfig(compile="auto").resolved(bf16, batch=2).compile is True  # a batch compiles its chains too
    assert DecodeConfig(compile="auto").resolved(make_model("llama").to(torch.bfloat16)).compile is False  # no streams
    assert DecodeConfig(compile=True).resolved(model).compile is True  # only auto is decided
    assert streaming_method(model, 0, DecodeConfig(compile="auto")).config.compile is False
    assert row_config(DecodeConfig(compile="auto"), lookup=PromptLookup()).compile == "auto"
    assert row_config(DecodeConfig(compile="auto"), prune_threshold=0.1).compile is False


def test_reason_takes_the_drafters_decode_options_from_the_same_fields(tiny_dir):
    from streamspec.reason.cli import setup_from_args
    from streamspec.reason.config import BackendConfig

    sub = _subparser("reason")
    flags = {opt for a in sub._actions for opt in a.option_strings}
    assert {"--drafter-" + f.name.replace("_", "-") for f in decode_fields()} <= flags
    args = sub.parse_args(["--base", str(tiny_dir), "--drafter", str(tiny_dir), "--problem", "1+1?",
                           "--drafter-tree-top-k", "2,1", "--drafter-lookup", "6,2", "--drafter-verify", "device"])
    drafter = setup_from_args(args).drafter
    assert drafter.decode_config() == DecodeConfig(tree_top_k=(2, 1), lookup=PromptLookup(6, 2), verify="device")
    unset = setup_from_args(sub.parse_args(["--base", str(tiny_dir), "--drafter", str(tiny_dir), "--problem", "x"]))
    assert unset.drafter.decode_config() == DecodeConfig()
    with pytest.raises(ValueError, match="verify"):
        BackendConfig(source=str(tiny_dir), verify="gpu")
