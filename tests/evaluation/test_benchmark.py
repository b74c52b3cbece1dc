"""The side-by-side benchmark runs every method on real held-out prompts and writes its report."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamspec import StreamConfig, add_streams
from streamspec.evaluation.benchmark import (
    BUDGET_CANDIDATES,
    LOOKUP_CANDIDATES,
    TREE_CANDIDATES,
    choose_tree,
    lookup_name,
    markdown_table,
    run_benchmark,
)
from streamspec.decoding.lookup import PromptLookup
from streamspec.kernels import cpu_kernels_available


def test_benchmark_reports_every_method(tiny_dir, tmp_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    model = add_streams(base, StreamConfig(stream_layers=2))
    model.save_pretrained(tmp_path / "ckpt")
    summary = run_benchmark(
        str(tmp_path / "ckpt"), task="sql", limit=2, validation_limit=1, thresholds=(0.0, 0.05),
        sweep_top_k=(1, 2), max_new_tokens=6, out_dir=str(tmp_path / "report"),
    )
    methods = {"baseline", "prompt_lookup", "streamed_ar", "chain", "tree", "tree_pruned", "tree_lookup", "tree_confidence"}
    if cpu_kernels_available():
        methods.add("baseline_default_kernels")
        # the same baseline with torch's default kernels gives the same tokens (fp32 rounding aside)
        assert summary["baseline_default_kernels"]["identical_to_baseline"] is True
        assert "identical_to_autoregressive" not in summary["baseline_default_kernels"]
    assert set(summary) == methods
    assert summary["baseline"]["speedup"] == 1.0
    for name in ("streamed_ar", "chain", "tree", "tree_pruned", "tree_lookup", "tree_confidence"):
        assert summary[name]["identical_to_autoregressive"], name
        assert summary[name]["crr"] >= 1.0
        assert {"exact_match", "valid"} <= set(summary[name])
        # where the time goes: prefill, then per decoding step the layers, the heads, the rest
        assert summary[name]["ms_prefill"] > 0 and summary[name]["ms_per_step_forward"] > 0
        assert summary[name]["ms_per_step_head"] > 0 and summary[name]["ms_per_step_overhead"] >= 0
    assert "identical_to_autoregressive" not in summary["baseline"]
    assert summary["tree_pruned"]["prune_threshold"] in (0.0, 0.05)
    assert set(summary["tree_pruned"]["validation"]) == {"0.0", "0.05"}
    lookup = summary["tree_lookup"]  # chosen on validation: every candidate tried, the fastest kept
    assert lookup["lookup_chosen_on_validation"] and set(lookup["validation"]) == {lookup_name(c) for c in LOOKUP_CANDIDATES}
    assert lookup["validation"][lookup["lookup"]]["tokens_per_second"] == max(
        e["tokens_per_second"] for e in lookup["validation"].values())
    confident = summary["tree_confidence"]  # its budget chosen the same way
    assert confident["budget_chosen_on_validation"] and set(confident["validation"]) == {str(b) for b in BUDGET_CANDIDATES}
    assert confident["validation"][str(confident["tree_budget"])]["tokens_per_second"] == max(
        e["tokens_per_second"] for e in confident["validation"].values())
    report = json.loads((tmp_path / "report" / "benchmark.json").read_text())
    assert len(report["sweep"]) == 4
    for name in ("benchmark.md", "tokens_per_pass.png", "speedup_vs_tree_top_k.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert markdown_table(summary).count("\n") == len(summary) + 1
    assert summary["tree"]["tree_top_k"] == 3 and not summary["tree"]["tree_chosen_on_validation"]
    plain = run_benchmark(str(tmp_path / "ckpt"), task="sql", limit=1, validation_limit=1, thresholds=(), max_new_tokens=4,
                          cpu_kernels=False, tree_top_k="auto", lookup=None, tree_budget=None)
    assert set(plain) == {"baseline", "prompt_lookup", "streamed_ar", "chain", "tree"}
    assert plain["tree"]["tree_chosen_on_validation"]
    tried = plain["tree"]["validation"]  # every candidate's validation figures, the chosen one the fastest
    assert set(tried) == {str(c) for c in TREE_CANDIDATES}
    chosen = plain["tree"]["tree_top_k"]
    key = str(chosen if isinstance(chosen, int) else tuple(chosen))
    assert tried[key]["tokens_per_second"] == max(e["tokens_per_second"] for e in tried.values())
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "How many singers?", "completion": "SELECT count(*) FROM singer"}) + "\n")
    with pytest.raises(ValueError, match="auto"):
        run_benchmark(str(tmp_path / "ckpt"), data=str(data), limit=1, tree_top_k="auto")
    for bad in [(2, 0), (1, 1, 1, 1)]:  # refused before anything is decoded
        with pytest.raises(ValueError, match="tree_top_k"):
            run_benchmark(str(tmp_path / "ckpt"), data=str(data), limit=1, tree_top_k=bad)
    with pytest.raises(ValueError, match="validation_limit"):
        run_benchmark(str(tmp_path / "ckpt"), limit=1, validation_limit=0, tree_top_k="auto")
    with pytest.raises(ValueError, match="lookup"):
        run_benchmark(str(tmp_path / "ckpt"), limit=1, lookup="sometimes")
    with pytest.raises(ValueError, match="tree_budget"):
        run_benchmark(str(tmp_path / "ckpt"), limit=1, tree_budget="wide")
    for bad in [(), (1, 0), (8, -1)]:
        with pytest.raises(ValueError, match="concurrency must be requests at once"):
            run_benchmark(str(tmp_path / "ckpt"), limit=1, vllm_options={"concurrency": bad})
    given = run_benchmark(str(tmp_path / "ckpt"), data=str(data), limit=1, thresholds=(), max_new_tokens=4,
                          cpu_kernels=False, lookup=PromptLookup(3, 1))
    assert given["tree_lookup"]["lookup"] == "3,1,3" and not given["tree_lookup"]["lookup_chosen_on_validation"]


def test_lossless_checkpoint_reproduces_its_base_in_the_benchmark(tiny_dir, tmp_path):
    """Lossless streams with stream-only adapters, measured against their own base: every method's
    tokens are the base model's `generate` tokens, and the report says so."""
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    model = add_streams(base, StreamConfig(stream_layers=2, mode="lossless", stream_adapter_rank=4))
    with torch.no_grad():
        for p in model.streams.adapters.parameters():
            p.normal_(std=0.2)
    model.save_pretrained(tmp_path / "ckpt")
    summary = run_benchmark(
        str(tmp_path / "ckpt"), task="sql", limit=2, validation_limit=1, thresholds=(0.05,), tree_top_k=(2, 1, 1),
        max_new_tokens=6, out_dir=str(tmp_path / "report"),
    )
    for name in ("prompt_lookup", "streamed_ar", "chain", "tree", "tree_pruned"):
        assert summary[name]["identical_to_baseline"] is True, name
    assert "identical_to_baseline" not in summary["baseline"]
    assert "identical_to_baseline" in (tmp_path / "report" / "benchmark.md").read_text()


def test_choose_tree_keeps_shapes_that_fit_the_streams(tiny_dir, tmp_path):
    from streamspec import load_default_tokenizer
    from streamspec.evaluation.benchmark import held_out_rows

    model = add_streams(AutoModelForCausalLM.from_pretrained(tiny_dir), StreamConfig(stream_layers=2, num_streams=2)).eval()
    rows = held_out_rows("sql", split="validation")[:1]
    tokenizer = load_default_tokenizer()
    shape, table = choose_tree(model, tokenizer, rows, [(1, 1, 1), (2, 1)], 4)
    assert shape == (2, 1) and set(table) == {"(2, 1)"}  # 3 depths > 2 streams: not tried
    with pytest.raises(ValueError, match="2 streams"):
        choose_tree(model, tokenizer, rows, [(1, 1, 1)], 4)


def test_generate_command_streams_the_same_text(tiny_dir, tmp_path):
    import io

    from streamspec.cli import main
    from streamspec.decoding.text import generate_text

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    add_streams(base, StreamConfig(stream_layers=2)).save_pretrained(tmp_path / "ckpt")
    streamed, plain = io.StringIO(), io.StringIO()
    text = generate_text(tmp_path / "ckpt", "How many singers are there?", stream=True, out=streamed, max_new_tokens=12)
    again = generate_text(tmp_path / "ckpt", "How many singers are there?", out=plain, max_new_tokens=12, speculative=False)
    assert text == again
    for shown in (streamed.getvalue(), plain.getvalue()):
        body, summary = shown.rsplit("\n[", 1)
        assert body == text and "tokens per pass" in summary
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "Hi", "--max-new-tokens", "3"]) == 0


def test_benchmark_skips_the_rows_asked_and_still_checks_exactness(tiny_dir, tmp_path):
    """`skip` leaves out the reference rows and the fixed tree (what `make demo` does for its
    minutes); a lossless checkpoint's rows are then checked against `generate` on the base, the
    lookup row still grows the tree asked for; anything else is refused before a model loads."""
    from streamspec.evaluation.benchmark import SKIPPABLE_ROWS

    assert set(SKIPPABLE_ROWS) == {"baseline_default_kernels", "streamed_ar", "tree"}
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    add_streams(base, StreamConfig(stream_layers=2, mode="lossless")).save_pretrained(tmp_path / "ckpt")
    summary = run_benchmark(str(tmp_path / "ckpt"), task="sql", limit=2, tree_top_k=(2, 1), thresholds=(),
                            lookup=PromptLookup(4, 1), tree_budget=None, max_new_tokens=6, skip=SKIPPABLE_ROWS,
                            out_dir=str(tmp_path / "report"))
    assert set(summary) == {"baseline", "prompt_lookup", "chain", "tree_lookup"}
    assert summary["tree_lookup"]["tree_top_k"] == [2, 1]
    assert all(summary[name]["identical_to_baseline"] is True for name in ("chain", "tree_lookup"))
    assert json.loads((tmp_path / "report" / "benchmark.json").read_text())  # the report is written without the row
    from streamspec.evaluation.report import user_table

    # what a user reads: without the one-token-a-pass row, exactness is the baseline's
    rows = {line.split(" | ")[0].lstrip("| ").split(" ")[0]: line.rstrip(" |").rsplit(" | ", 1)[1]
            for line in user_table(summary).splitlines()[2:]}
    assert rows == {"baseline": "–", "prompt_lookup": "yes", "chain": "yes", "tree_lookup": "yes"}
    kept = run_benchmark(str(tmp_path / "ckpt"), task="sql", limit=1, tree_top_k=1, thresholds=(), lookup=None,
                         tree_budget=None, max_new_tokens=4, skip=("streamed_ar",))
    assert set(kept) == {"baseline", "baseline_default_kernels", "prompt_lookup", "chain", "tree"} - (
        set() if cpu_kernels_available() else {"baseline_default_kernels"})
    assert kept["tree"]["tree_top_k"] == 1
    for bad in (("chain",), "streamed_ar", ("tree_lookup",)):
        with pytest.raises(ValueError, match="skip takes rows of"):
            run_benchmark(str(tmp_path / "no-such-checkpoint"), skip=bad)


def test_demo_trains_exports_and_benchmarks(tiny_dir, tmp_path, capsys):
    """`make demo`'s job end to end (on a tiny base instead of SmolLM2 to stay quick): fine-tune,
    export a loadable streamed checkpoint, benchmark, print the table and the plots' paths."""
    from streamspec import load_streamed
    from streamspec.demo import run_demo

    result = run_demo(steps=2, limit=1, fine_tune_limit=1, out_dir=tmp_path / "demo", model=str(tiny_dir),
                      max_new_tokens=6)
    shown = capsys.readouterr().out
    assert result["shipped"] is None  # the shipped streams are for SmolLM2, not this base
    summary = result["fine_tune"]
    assert set(summary) >= {"baseline", "prompt_lookup", "streamed_ar", "chain", "tree_lookup"}
    assert "tree" not in summary  # (the fixed tree alone: left out for the demo's minutes)
    assert all(summary[name]["identical_to_autoregressive"] for name in ("chain", "tree_lookup"))
    # the columns a user reads; exact match and validity stay in the JSON
    assert "| method | tokens/s | speedup | CRR | identical |" in shown and "tokens_per_pass.png" in shown
    table = [line for line in shown.splitlines() if line.startswith("| ")]
    assert table and not any("valid" in line or "exact" in line or "ms_" in line for line in table)
    chain_row = next(line for line in table if line.startswith("| chain "))
    assert chain_row.endswith("| yes |") and "×" in chain_row
    saved = json.loads((tmp_path / "demo" / "benchmark" / "benchmark.json").read_text())["methods"]
    assert "exact_match" in saved["chain"]
    assert (tmp_path / "demo" / "benchmark" / "benchmark.json").is_file()
    load_streamed(tmp_path / "demo" / "train" / "final")
    with pytest.raises(ValueError, match="steps, limit and fine_tune_limit"):
        run_demo(steps=0)
    with pytest.raises(ValueError, match="fine_tune_limit=0"):
        run_demo(fine_tune_limit=0)


def test_the_demo_sizes_the_shipped_streams_step_to_the_time_left_at_the_measured_speed(monkeypatch, tmp_path, capsys):
    import streamspec.demo as demo
    import streamspec.evaluation.benchmark as benchmark
    import streamspec.training.trainer as trainer

    # more time or a faster machine: never fewer questions; always within the bounds
    counts = [demo.shipped_questions(left, speed, 96) for speed in (2.0, 5.0, 20.0, 80.0) for left in (0, 200, 400, 2000)]
    assert all(demo.MIN_QUESTIONS <= n <= demo.MAX_QUESTIONS for n in counts)
    for speed in (2.0, 5.0, 20.0, 80.0):
        row = [demo.shipped_questions(left, speed, 96) for left in (0, 200, 400, 2000)]
        assert row == sorted(row)
    assert demo.shipped_questions(2000, 5.0, 96) >= demo.shipped_questions(2000, 2.0, 96)
    assert demo.shipped_questions(100, None, 96) == demo.MAX_QUESTIONS  # no measurement: the full step

    monkeypatch.setattr(demo, "introduce", lambda *a, **k: None)
    monkeypatch.setattr(trainer, "run_training", lambda recipe: {"export": str(tmp_path), "wall_seconds": 0,
                                                                 "seconds_per_step": 0, "steps": 3, "stopped_by_time": True})
    limits = []
    monkeypatch.setattr(benchmark, "run_benchmark", lambda checkpoint, **k: limits.append(k["limit"]) or
                        {"baseline": {"tokens_per_second": 4.0}})
    monkeypatch.setattr(demo, "_show", lambda summary, folder: None)
    result = demo.run_demo(steps=8, fine_tune_limit=1, out_dir=tmp_path, minutes=11.0)
    # (the stand-ins take no time: the whole budget is left, (660 - 150) s at 96 s a question)
    assert limits[1] == demo.shipped_questions(11.0 * 60, 4.0, 96) == 5
    shown = capsys.readouterr().out
    assert "stopped by the time budget after 3 of 8 steps" in shown and "generate ran at 4.0 tokens/s here" in shown
    for part in ("[1/3] took", "[2/3] took", "[3/3] took", "the demo took"):
        assert part in shown
    assert set(result["seconds"]) == {"introduction", "fine_tune", "fine_tune_benchmark", "shipped", "total"}
    limits.clear()
    demo.run_demo(steps=1, limit=5, fine_tune_limit=1, out_dir=tmp_path)  # a limit given is kept
    assert limits[1] == 5
    with pytest.raises(ValueError, match="minutes must be > 0"):
        demo.run_demo(minutes=0)


def test_demo_compiles_the_shipped_streams_rows_only(monkeypatch, tmp_path):
    """`streamspec demo --compile` reaches the shipped streams' benchmark (default ``auto``, as
    every decoding command), the few-step fine-tune's rows stay eager, and a bad value is refused
    before any work. The fine-tune and the benchmarks are replaced by recorders here: the real
    ones are what test_demo_trains_exports_and_benchmarks and `make demo` run."""
    import streamspec.demo as demo
    import streamspec.evaluation.benchmark as benchmark
    import streamspec.training.trainer as trainer
    from streamspec.cli import build_parser

    calls = []
    monkeypatch.setattr(demo, "introduce", lambda *a, **k: None)
    recipes = []
    monkeypatch.setattr(trainer, "run_training", lambda recipe: recipes.append(recipe) or {
        "export": str(tmp_path), "wall_seconds": 0, "seconds_per_step": 0, "steps": 1})
    lookups, skips = [], []
    monkeypatch.setattr(benchmark, "run_benchmark",
                        lambda checkpoint, **k: calls.append(k.get("decode")) or lookups.append(k["lookup"])
                        or skips.append(k.get("skip")) or {})
    demo.run_demo(steps=1, limit=1, fine_tune_limit=1, out_dir=tmp_path)
    assert calls[0] is None and calls[1].compile == "auto"
    # the shipped streams' step runs no reference row (one token a pass would be one more graph to
    # compile); the fine-tune's keeps one token a pass, its exactness reference (shared streams);
    # neither runs the fixed tree alone (the confidence tree of its size is the step's tree row)
    assert skips == [("baseline_default_kernels", "tree"), ("baseline_default_kernels", "streamed_ar", "tree")]
    assert build_parser().parse_args(["demo"]).steps == 8
    # the fine-tune is held to its share of the demo's minutes, two examples a step
    assert recipes[0].training.max_minutes == pytest.approx(demo.DEMO_MINUTES * demo.TRAIN_SHARE)
    assert recipes[0].training.batch_size == 2
    # the shipped streams' lookup: one branch a pass, two padded sizes to compile (7 and 15 nodes)
    assert lookups[1].matches == 1 and lookups[1].tokens == 8
    calls.clear()
    demo.run_demo(steps=1, limit=1, fine_tune_limit=1, out_dir=tmp_path, compile=False)
    assert calls[1].compile is False
    with pytest.raises(ValueError, match="compile must be"):
        demo.run_demo(compile="fast")
    assert build_parser().parse_args(["demo"]).compile == "auto"
    assert build_parser().parse_args(["demo", "--compile", "off"]).compile is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--compile", "fast"])


@pytest.mark.parametrize("name, options", [
    ("benchmark.py", ("--checkpoint", "--task", "--baseline", "--sweep", "--data")),
    ("decode_crr.py", ("--checkpoint", "--task", "--split", "--limit", "--trees", "--pruned")),
    ("reason_draft_speed.py", ("--drafter", "--offset", "--limit", "--trees", "--repeats")),
    ("draft_accuracy.py", ("--recipe", "--checkpoints", "--batch-size", "--limit")),
    ("draft_parameters.py", ("--num-drafts", "--stream-layers", "--adapter-rank")),
])
def test_eval_entry_points_parse_their_options(name, options):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "eval" / name
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True).stdout
    for option in options:
        assert option in shown


def test_draft_parameter_counts_follow_the_formulas():
    """eval/draft_parameters.py: streams add γ·h + 2·h·8 (identifiers, early-exit adapter), and
    Medusa heads γ·(h² + h), on the meta device for SmolLM2's and Llama-3.1-8B's shapes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "eval" / "draft_parameters.py"
    out = subprocess.run([sys.executable, str(script), "--num-drafts", "2"], capture_output=True, text=True, check=True).stdout
    rows = {r["model"]: r for r in map(json.loads, out.splitlines())}
    for name, h in (("SmolLM2-135M", 576), ("Llama-3.1-8B", 4096)):
        assert rows[name]["streams"] == 2 * h + 2 * h * 8
        assert rows[name]["medusa_heads"] == 2 * (h * h + h)
        assert rows[name]["streams"] < rows[name]["streams_with_rank_32_adapters"] < rows[name]["base_parameters"]
    assert rows["SmolLM2-135M"]["base_parameters"] == 134_515_008  # the default model's count (README)


@pytest.mark.parametrize("task", ["sql", "summarize"])
def test_eval_data_of_a_user_runs_end_to_end(task, tiny_dir, tmp_path, capsys):
    """`streamspec eval --data` with rows that have only prompt and completion (no Spider fields):
    quality is measured against the completion and every file is written."""
    from streamspec.cli import main

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    add_streams(base, StreamConfig(stream_layers=2)).save_pretrained(tmp_path / "ckpt")
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": "How many singers?", "completion": "SELECT count(*) FROM singer"},
            {"prompt": "Summarise: the cat sat on the mat.", "completion": "A cat sat."}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report"
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--task", task, "--data", str(data), "--limit", "2",
                 "--max-new-tokens", "4", "--tree-top-k", "2", "--device", "cpu", "--peers", "memory_floor",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "benchmark.json").read_text())["methods"]
    assert summary.pop("memory_floor")["ms_per_pass"] > 0  # a line, not a method: no outputs to score
    for name, entry in summary.items():
        if task == "sql":
            assert "exact_match" in entry and "valid" not in entry, name  # no schema in the user's rows
        else:
            assert "rouge1" in entry, name
    assert (out / "benchmark.md").stat().st_size > 0


def test_a_late_failure_keeps_what_was_measured(tiny_dir, tmp_path, monkeypatch):
    """Results are saved after every prompt and the main table before the sweep: a sweep that
    fails leaves partial.json and benchmark.json with every method's figures."""
    import streamspec.evaluation.benchmark as bench

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    add_streams(base, StreamConfig(stream_layers=2)).save_pretrained(tmp_path / "ckpt")
    real = bench.run_methods
    calls = []

    def failing_sweep(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the machine went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "run_methods", failing_sweep)
    out = tmp_path / "report"
    with pytest.raises(RuntimeError, match="went away"):
        bench.run_benchmark(str(tmp_path / "ckpt"), task="sql", limit=2, thresholds=(), sweep_top_k=(2,),
                            tree_top_k=1, lookup=None, tree_budget=None, max_new_tokens=4, out_dir=str(out))
    partial = json.loads((out / "partial.json").read_text())
    assert partial["prompts_done"] == partial["prompts"] == 2
    assert {"baseline", "chain", "tree"} <= set(partial["methods"])
    assert {"baseline", "chain", "tree"} <= set(json.loads((out / "benchmark.json").read_text())["methods"])


def test_the_warm_up_meets_every_cache_size_each_compiled_method_needs():
    """Every method whose pass fits in `COMPILED_ROOM` rows (one token, chain, trees, lookup trees
    of the usual sizes) reserves the same compiled cache size for a prompt, so the warm-up's one
    prompt per size meets every size any of them meets on the timed prompts."""
    from streamspec.assets import load_default_tokenizer
    from streamspec.data.build import prompt_ids
    from streamspec.data.tasks import task_rows
    from streamspec.decoding.compiled import COMPILED_ROOM, compiled_capacity
    from streamspec.evaluation.methods import _warm_up_prompts

    tokenizer = load_default_tokenizer()
    rows = task_rows("sql", "test")[:60]
    lengths = [prompt_ids(tokenizer, row).shape[1] for row in rows]
    warmed = {ids.shape[1] for ids in _warm_up_prompts(tokenizer, rows, 96)}
    for pass_rows in (0, 16, 28, 60, COMPILED_ROOM):  # one token, chain, (2,1,1), (2,1,1) + 8-token branch
        needed = {compiled_capacity(n + 96, pass_rows) for n in lengths}
        assert needed == {compiled_capacity(n + 96, pass_rows) for n in warmed}, pass_rows
    assert len(needed) > 1, "the prompts must span more than one cache size for this test to mean anything"
    assert compiled_capacity(300, COMPILED_ROOM + 200) > compiled_capacity(300)  # a larger tree gets its own
