"""The command line's contract: errors are one line `streamspec: error: ...` with status 2, and
`--debug` shows the traceback; `from streamspec import generate` is the decoding entry point."""

from __future__ import annotations

import pytest

import streamspec
from streamspec.cli import main


def test_generate_is_exported_at_the_top():
    from streamspec import generate
    from streamspec.decoding import generate as decoding_generate

    assert generate is decoding_generate and "generate" in streamspec.__all__


@pytest.mark.parametrize("argv, words", [
    (["generate", "--checkpoint", "./no-such-checkpoint", "--prompt", "hi", "--device", "cpu"], "no-such-checkpoint"),
    (["export", "--checkpoint", "./no-such-checkpoint", "--out", "x"], "stream_config.json"),
    (["train", "--recipe", "recipes/smollm2-135m/sql.yaml", "training.learning_rat=1"], "learning_rat"),
    (["reason-eval", "--task", "gsm8k", "--data", "x.jsonl", "--base", "b"], "exactly one of --task or --data"),
])
def test_errors_are_one_line_with_status_2(argv, words, capsys, tmp_path, monkeypatch):
    if argv[0] != "train":  # the recipe path is relative to the repository; the rest run elsewhere
        monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamspec: error: ") and err.count("\n") == 1 and words in err


def test_debug_shows_the_traceback(monkeypatch):
    with pytest.raises(Exception, match="learning_rat"):
        main(["--debug", "train", "--recipe", "recipes/smollm2-135m/sql.yaml", "training.learning_rat=1"])
    monkeypatch.setenv("STREAMSPEC_DEBUG", "1")
    with pytest.raises(Exception, match="learning_rat"):
        main(["train", "--recipe", "recipes/smollm2-135m/sql.yaml", "training.learning_rat=1"])


def test_sql_evaluation_decodes_with_the_checkpoints_own_tokenizer(tiny_dir, tmp_path):
    """eval/sql_exact_match.py's generators take the tokenizer of the checkpoint (here its recorded
    base, whose tokenizer has a token the default model's lacks), not the default model's."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamspec import StreamConfig, add_streams
    from streamspec.evaluation.metrics import greedy_generator

    shutil.copytree(tiny_dir, tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    tokenizer.add_tokens(["<only-in-this-base>"])
    tokenizer.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa")
    add_streams(base, StreamConfig(stream_layers=2)).save_pretrained(tmp_path / "ckpt")
    for kind in ("streamed", "speculative"):
        _, used = greedy_generator(kind, str(tmp_path / "ckpt"))
        assert "<only-in-this-base>" in used.get_vocab(), kind


@pytest.mark.parametrize("argv", [
    ["generate", "--checkpoint", "c", "--prompt", "hi", "--lookup", "4,x"],
    ["generate", "--checkpoint", "c", "--prompt", "hi", "--lookup", "0,2"],
    ["eval", "--checkpoint", "c", "--lookup", "sometimes"],
])
def test_bad_lookup_flags_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "--lookup" in capsys.readouterr().err


def test_a_lookup_flag_reaches_generate(tiny_dir, tmp_path, capsys):
    """`streamspec generate --lookup L,M` decodes with lookup branches: the text equals the one
    without them (greedy decoding is exact either way)."""
    from streamspec import StreamConfig, add_streams
    from transformers import AutoModelForCausalLM

    add_streams(AutoModelForCausalLM.from_pretrained(tiny_dir), StreamConfig(stream_layers=2)).save_pretrained(tmp_path / "c")
    texts = []
    for extra in ([], ["--lookup", "4,2"]):
        assert main(["generate", "--checkpoint", str(tmp_path / "c"), "--prompt", "SELECT name FROM singer",
                     "--max-new-tokens", "12", "--device", "cpu", *extra]) == 0
        texts.append(capsys.readouterr().out.rsplit("\n[", 1)[0])
    assert texts[0] == texts[1] and texts[0]
