"""The README is a front page whose commands work: every `streamspec` / `train/finetune.py`
command it shows is parsed by the real command line (flags, and for a training command its recipe
and overrides), its Python example runs, and `streamspec generate` as written runs on the shipped
streams. (`make demo` / `make test` are what CI and the demo run.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from streamspec.cli import build_parser, check_device_args

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _commands() -> list[list[str]]:
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("make ") or line.startswith("#") or not line:
                continue
            words = shlex.split(line.split("&&")[-1])
            if words[:2] == ["python", "train/finetune.py"]:
                words = ["streamspec", "train", *words[2:]]
            commands.append(words)
    return commands


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) < 200
    assert {w[1] for w in _commands()} >= {"generate", "train", "eval", "serve", "reason", "distill", "export"}


@pytest.mark.parametrize("words", _commands(), ids=lambda w: " ".join(w[:2]))
def test_every_readme_command_parses(words):
    assert words[0] == "streamspec", words
    parser = build_parser()
    args = parser.parse_args(words[1:])  # an unknown flag or a bad value exits here
    check_device_args(parser, args)
    if args.command == "train":
        from streamspec.training.recipe import load_recipe

        load_recipe(ROOT / args.recipe, args.overrides)


def test_readme_python_example_and_generate_command_run(capsys):
    (code,) = _blocks("python")
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip()
    generate = next(w for w in _commands() if w[1] == "generate")
    from streamspec.cli import main

    assert main(generate[1:] + ["--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out.strip()


def test_every_shipped_name_the_readme_gives_ships():
    from streamspec.assets import shipped_streams_path

    names = set(re.findall(r"streamspec:([a-z0-9.-]+-streams)\b", README))
    assert names
    for name in names:
        assert shipped_streams_path(name).is_dir(), name
