"""The benchmark's ``medusa`` row (Medusa heads on the baseline's model, through the same tree
verifier), its strict refusal of heads made on another base, what every draft row reports
(``draft_parameters``), the `streamspec eval` options that go with them, and the shipped-streams
lookup. Tiny random models throughout (conftest's tiny_dir: a random Llama with SmolLM2's
tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import streamspec.evaluation.benchmark as bench
from streamspec import CheckpointError, StreamConfig, add_streams
from streamspec.data.schema_styles import SCHEMA_STYLES
from streamspec.decoding.lookup import PromptLookup
from streamspec.patch.medusa import MedusaConfig, add_medusa_heads, load_medusa

pytestmark = pytest.mark.usefixtures("single_thread")

ROWS = [{"prompt": "How many singers are there?", "completion": "SELECT count(*) FROM singer"},
        {"prompt": "List the names of all stadiums.", "completion": "SELECT name FROM stadium"}]
DRAFT_ROWS = ("chain", "tree", "tree_lookup", "tree_confidence")


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _streamed(tiny_dir, folder):
    """Lossless streams with random stream-only adapters on the tiny base: every method's tokens
    are the base's."""
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    model = add_streams(base, StreamConfig(stream_layers=2, mode="lossless", stream_adapter_rank=4))
    _randomize(model.streams.adapters, seed=3, std=0.2)
    model.save_pretrained(folder)
    return model


def _medusa_on(base, folder, heads: int = 3, seed: int = 7):
    """Medusa heads with random non-zero weights (zero heads would draft the main token again)."""
    model = add_medusa_heads(base, MedusaConfig(num_heads=heads)).eval()
    _randomize(model.heads, seed)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _md_rows(text: str) -> dict[str, dict[str, str]]:
    """benchmark.md as {method label: {column: cell}}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = dict(zip(head, cells))
    return out


def test_medusa_row_decodes_the_baselines_tokens_and_reports_its_parameters(tiny_dir, tmp_path, data_file):
    streamed = _streamed(tiny_dir, tmp_path / "ckpt")
    heads = _medusa_on(AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa"), tmp_path / "medusa")
    saved = load_medusa(tmp_path / "medusa", AutoModelForCausalLM.from_pretrained(tiny_dir))
    assert all(p.abs().sum() > 0 for p in saved.heads.parameters())  # drafts are not the main token
    out = tmp_path / "report"
    summary = bench.run_benchmark(
        str(tmp_path / "ckpt"), data=str(data_file), limit=2, thresholds=(), tree_top_k=(2, 1, 1),
        lookup=PromptLookup(3, 1), tree_budget=4, max_new_tokens=6, out_dir=str(out), medusa=str(tmp_path / "medusa"),
    )
    assert {"baseline", "streamed_ar", *DRAFT_ROWS, "medusa"} <= set(summary)
    medusa = summary["medusa"]
    assert medusa["identical_to_autoregressive"] is True
    assert medusa["identical_to_baseline"] is True  # lossless streams measured against their own base
    assert medusa["tree_top_k"] == [2, 1, 1] and medusa["tree_chosen_on_validation"] is False
    assert medusa["crr"] >= 1.0 and medusa["tokens"] == summary["baseline"]["tokens"] > 0
    # what each draft method adds: the heads for medusa, the streams (with adapters) for the others
    assert medusa["draft_parameters"] == heads.num_draft_parameters() == 3 * (64 * 64 + 64)
    assert streamed.num_stream_parameters() != heads.num_draft_parameters()
    for name in DRAFT_ROWS:
        assert summary[name]["draft_parameters"] == streamed.num_stream_parameters(), name
    for name in ("baseline", "prompt_lookup", "streamed_ar"):
        assert "draft_parameters" not in summary[name], name
    # the report: both plots, a draft_parameters column with each row's figure, medusa's histogram
    for name in ("methods.png", "tokens_per_pass.png", "benchmark.md", "benchmark.json"):
        assert (out / name).stat().st_size > 0, name
    table = _md_rows((out / "benchmark.md").read_text())
    medusa_label = next(label for label in table if label.startswith("medusa"))
    assert table[medusa_label]["draft_parameters"] == str(heads.num_draft_parameters())
    assert table[next(label for label in table if label.startswith("chain"))]["draft_parameters"] == \
        str(streamed.num_stream_parameters())
    assert table["baseline"]["draft_parameters"] == ""
    saved_summary = json.loads((out / "benchmark.json").read_text())["methods"]
    assert saved_summary["medusa"]["accepted_per_pass_histogram"]
    assert saved_summary["medusa"]["draft_parameters"] == heads.num_draft_parameters()


def test_benchmark_without_medusa_has_no_medusa_row(tiny_dir, tmp_path, data_file):
    _streamed(tiny_dir, tmp_path / "ckpt")
    summary = bench.run_benchmark(str(tmp_path / "ckpt"), data=str(data_file), limit=1, thresholds=(), tree_top_k=2,
                                  lookup=None, tree_budget=None, max_new_tokens=4, cpu_kernels=False)
    assert "medusa" not in summary
    assert summary["chain"]["draft_parameters"] == summary["tree"]["draft_parameters"] > 0


def _other_base(tiny_dir, shape: str):
    config = AutoModelForCausalLM.from_pretrained(tiny_dir).config
    if shape == "other weights":  # the same shape, another initialisation
        torch.manual_seed(99)
    else:
        config.hidden_size, config.intermediate_size = 32, 64
        torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("shape", ["other weights", "other shape"])
def test_medusa_made_on_another_base_is_refused_before_decoding(shape, tiny_dir, tmp_path, monkeypatch):
    """Strict: heads trained on another model are refused with a CheckpointError, and before the
    validation prompts choose anything (no time spent decoding first)."""
    _streamed(tiny_dir, tmp_path / "ckpt")
    _medusa_on(_other_base(tiny_dir, shape), tmp_path / "medusa")

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the Medusa checkpoint was checked")

    monkeypatch.setattr(bench, "run_methods", no_decoding)
    with pytest.raises(CheckpointError, match="another base"):
        bench.run_benchmark(str(tmp_path / "ckpt"), task="sql", limit=1, validation_limit=1, thresholds=(0.05,),
                            tree_top_k="auto", max_new_tokens=4, cpu_kernels=False, medusa=str(tmp_path / "medusa"))


def test_a_tree_deeper_than_the_heads_is_refused_before_decoding(tiny_dir, tmp_path, monkeypatch):
    streamed = _streamed(tiny_dir, tmp_path / "ckpt")
    assert streamed.stream_config.num_streams >= 3  # the shape fits the streams, not the 2 heads
    _medusa_on(AutoModelForCausalLM.from_pretrained(tiny_dir), tmp_path / "medusa", heads=2)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the tree shape was checked against the heads")

    monkeypatch.setattr(bench, "run_methods", no_decoding)
    with pytest.raises(ValueError, match="tree_top_k"):
        bench.run_benchmark(str(tmp_path / "ckpt"), task="sql", limit=1, validation_limit=1, thresholds=(0.05,),
                            tree_top_k=(2, 1, 1), max_new_tokens=4, cpu_kernels=False, medusa=str(tmp_path / "medusa"))


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def test_eval_help_lists_the_new_options(capsys):
    from streamspec.cli import main

    with pytest.raises(SystemExit) as done:
        main(["eval", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for option in ("--medusa", "--schema-style", "--validation-limit", "--thresholds", "--skip"):
        assert option in shown, option
    for style in SCHEMA_STYLES:  # the command offers exactly the library's styles
        assert style in shown, style


def test_eval_refuses_an_unknown_schema_style(capsys):
    from streamspec.cli import main

    with pytest.raises(SystemExit) as done:
        main(["eval", "--checkpoint", "nowhere", "--schema-style", "bogus"])
    assert done.value.code == 2
    error = capsys.readouterr().err
    assert "--schema-style" in error and "bogus" in error


def test_eval_passes_the_new_options_to_the_benchmark(monkeypatch):
    from streamspec.cli import main

    seen = {}
    monkeypatch.setattr(bench, "run_benchmark", lambda checkpoint, **kwargs: seen.update(kwargs, checkpoint=checkpoint))
    assert main(["eval", "--checkpoint", "ckpt", "--medusa", "heads", "--schema-style", "renamed",
                 "--validation-limit", "3", "--thresholds"]) in (0, None)
    assert seen["checkpoint"] == "ckpt" and seen["medusa"] == "heads" and seen["schema_style"] == "renamed"
    assert seen["validation_limit"] == 3 and seen["thresholds"] == ()
    main(["eval", "--checkpoint", "ckpt", "--thresholds", "0.1", "0.3"])
    assert seen["thresholds"] == (0.1, 0.3) and seen["medusa"] is None and seen["schema_style"] == "spider"
    assert seen["validation_limit"] == 10 and seen["skip"] == ()
    main(["eval", "--checkpoint", "ckpt", "--skip", "streamed_ar", "baseline_default_kernels"])
    assert seen["skip"] == ("streamed_ar", "baseline_default_kernels")


def test_eval_refuses_a_row_it_cannot_skip(capsys):
    from streamspec.cli import main

    with pytest.raises(SystemExit) as done:
        main(["eval", "--checkpoint", "ckpt", "--skip", "chain"])
    assert done.value.code == 2
    error = capsys.readouterr().err
    assert "--skip" in error and "chain" in error and "streamed_ar" in error


# ---------------------------------------------------------------------------------------------
# shipped stream weights
# ---------------------------------------------------------------------------------------------


def test_unknown_shipped_streams_name_what_is_shipped(tmp_path, monkeypatch):
    import streamspec.assets as assets

    with pytest.raises(FileNotFoundError, match="no-such-streams"):
        assets.shipped_streams_path("no-such-streams")
    # in a package with two shipped folders (a stand-in, not the real weights folder)
    package = tmp_path / "streamspec"
    for name in ("sql-a", "sql-b"):
        (package / "weights" / name).mkdir(parents=True)
        (package / "weights" / name / "stream_config.json").write_text("{}")
    monkeypatch.setattr(assets, "__file__", str(package / "assets.py"))
    assert assets.shipped_streams_path("sql-b") == package / "weights" / "sql-b"
    with pytest.raises(FileNotFoundError) as missing:
        assets.shipped_streams_path("sql-c")
    assert "'sql-c'" in str(missing.value) and "['sql-a', 'sql-b']" in str(missing.value)
