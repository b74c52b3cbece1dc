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
