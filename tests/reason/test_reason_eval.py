"""`streamspec reason-eval` and `streamspec reason` end to end on tiny models with SmolLM2's
tokenizer: every method on the same problems, traces written as they finish, resumed."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoModelForCausalLM

from streamspec import StreamConfig, add_streams
from streamspec.cli import main
from streamspec.reason.evaluate import TRACES_FILE, evaluate, method_names, read_traces
from streamspec.reason.backends import LocalBackend
from streamspec.reason.config import ReasonConfig
from streamspec.reason.tasks import Problem

pytestmark = pytest.mark.usefixtures("single_thread")
SMALL = ["--token-budget", "30", "--step-max-tokens", "8", "--answer-max-tokens", "4", "--seed", "1"]


@pytest.fixture(scope="module")
def folders(tiny_dir, tmp_path_factory):
    """A base folder and a streamed drafter checkpoint (lossless streams on the same tiny model)."""
    out = tmp_path_factory.mktemp("reason")
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    add_streams(base, StreamConfig(stream_layers=2, mode="lossless")).save_pretrained(out / "drafter")
    data = out / "problems.jsonl"
    data.write_text('{"question": "What is 2+3?", "answer": "5"}\n{"question": "What is 4*3?", "answer": "12"}\n')
    return tiny_dir, out / "drafter", data


def test_method_names():
    assert method_names([5, 7], drafter=True, base=True, plain=True) == [
        "base_only", "drafter_only", "specreason@5", "specreason_plain@5", "specreason@7", "specreason_plain@7"]
    assert method_names([7], drafter=False, base=True, plain=False) == ["base_only"]


def test_evaluate_writes_each_run_and_resumes(folders, tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    drafter = add_streams(model, StreamConfig(stream_layers=2, mode="lossless")).eval()
    base = LocalBackend(model, tokenizer, name="base")
    streamed = LocalBackend(drafter, tokenizer, name="drafter")
    plain = LocalBackend(drafter, tokenizer, streams=False, name="plain")
    problems = [Problem("a", "What is 2+3?", "5", "numeric"), Problem("b", "What is 4*3?", "12", "numeric")]
    cfg = ReasonConfig(token_budget=24, step_max_tokens=8, answer_max_tokens=4, temperature=0.0)
    traces = evaluate(problems, cfg, tmp_path, base=base, drafter=streamed, plain_drafter=plain, progress=False)
    lines = (tmp_path / TRACES_FILE).read_text().splitlines()
    assert len(lines) == len(traces) == 2 * 4
    assert {json.loads(line)["method"] for line in lines} == {"base_only", "drafter_only", "specreason@0.4",
                                                             "specreason_plain@0.4"}
    for trace in traces:
        assert trace.tokens["total"] <= 24 and trace.correct is not None and trace.reference in ("5", "12")
    # the streamed and the plain drafter write the same text (lossless streams, greedy)
    by = {(t.method, t.problem_id): t for t in traces}
    assert by[("specreason@0.4", "a")].text == by[("specreason_plain@0.4", "a")].text
    # a second run does nothing; a torn last line is run again, nothing else
    again = evaluate(problems, cfg, tmp_path, base=base, drafter=streamed, plain_drafter=plain, progress=False)
    assert len((tmp_path / TRACES_FILE).read_text().splitlines()) == 8 and len(again) == 8
    (tmp_path / TRACES_FILE).write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])
    evaluate(problems, cfg, tmp_path, base=base, drafter=streamed, plain_drafter=plain, progress=False)
    assert len(read_traces(tmp_path / TRACES_FILE)) == 8
    with pytest.raises(ValueError, match="available"):
        evaluate(problems, cfg, tmp_path, base=base, drafter=None, methods=["specreason@0.4"], progress=False)


def test_reason_eval_command(folders, tmp_path, capsys):
    base, drafter, data = folders
    out = tmp_path / "eval"
    code = main(["reason-eval", "--data", str(data), "--base", str(base), "--drafter", str(drafter), "--limit", "1",
                 "--judge-request", "score_0_9", "--thresholds", "5", "9", "--device", "cpu", "--out", str(out),
                 *SMALL])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == {"base_only", "drafter_only", "specreason@5", "specreason_plain@5",
                                       "specreason@9", "specreason_plain@9"}
    assert (out / "summary.md").is_file() and (out / "latency.png").stat().st_size > 0
    assert "| method |" in capsys.readouterr().out


def test_reason_command_prints_steps_and_summary(folders, capsys):
    base, drafter, _ = folders
    code = main(["reason", "--base", str(base), "--drafter", str(drafter), "--problem", "What is 2+3?",
                 "--threshold", "0", *SMALL])
    printed = capsys.readouterr().out
    assert code == 0
    assert "drafted, kept (score" in printed and "answer:" in printed and "drafts kept" in printed


def test_reason_command_refuses_missing_roles(folders, capsys):
    base, _, _ = folders
    assert main(["reason", "--base", str(base), "--problem", "x"]) == 2
    assert capsys.readouterr().err.startswith("streamspec: error: streamspec reason needs --base and --drafter")
    assert main(["reason", "--base", str(base), "--drafter", str(base), "--problem", "x", "--threshold", "12"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'error_yes_no_fewshot' read as 'p_no_error' must be in [0, 1], got 12.0" in err
    with pytest.raises(ValueError, match="threshold"):
        main(["--debug", "reason", "--base", str(base), "--drafter", str(base), "--problem", "x", "--threshold", "12"])


def test_runs_that_ended_in_an_error_are_run_again(folders, tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    from streamspec.reason.trace import ReasonTrace

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    base = LocalBackend(model, tokenizer, name="base")
    problems = [Problem("a", "What is 2+3?", "5", "numeric")]
    failed = ReasonTrace(problem="What is 2+3?", method="base_only", problem_id="a", stop_reason="error", error="x")
    (tmp_path / TRACES_FILE).write_text(json.dumps(failed.to_dict()) + "\n")
    cfg = ReasonConfig(token_budget=16, step_max_tokens=8, answer_max_tokens=4, temperature=0.0)
    traces = evaluate(problems, cfg, tmp_path, base=base, drafter=None, progress=False)
    assert [t.stop_reason for t in traces] != ["error"] and len(traces) == 1
    assert len(read_traces(tmp_path / TRACES_FILE)) == 1


def test_reason_command_reads_a_yaml_config(folders, tmp_path, capsys):
    base, drafter, _ = folders
    config = tmp_path / "reason.yaml"
    config.write_text(f"reason:\n  threshold: 0\n  token_budget: 30\n  step_max_tokens: 8\n  answer_max_tokens: 4\n"
                      f"base:\n  source: {base}\n  device: cpu\ndrafter:\n  source: {drafter}\n  tree_top_k: [2, 1, 1]\n")
    assert main(["reason", "--config", str(config), "--problem", "What is 2+3?", "--set", "reason.seed=3"]) == 0
    printed = capsys.readouterr().out
    assert "drafted, kept" in printed and "answer:" in printed


def test_resuming_refuses_traces_made_with_other_settings(tiny_dir, tmp_path):
    """traces.jsonl written with another judge request (or budget, ...) is never counted as this
    run's: the resume is refused, naming the setting, before anything runs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    base = LocalBackend(model, tokenizer, name="base")
    problems = [Problem("a", "What is 2+3?", "5", "numeric")]
    cfg = ReasonConfig(token_budget=16, step_max_tokens=8, answer_max_tokens=4, temperature=0.0)
    evaluate(problems, cfg, tmp_path, base=base, drafter=None, progress=False)
    other = ReasonConfig(token_budget=20, step_max_tokens=8, answer_max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="token_budget: 16 there, 20 now"):
        evaluate(problems, other, tmp_path, base=base, drafter=None, progress=False)
    # the same settings resume (nothing run again); base-only runs do not depend on the judge's
    another_judge = ReasonConfig(token_budget=16, step_max_tokens=8, answer_max_tokens=4, temperature=0.0,
                                 judge_request="error_yes_no")
    assert len(evaluate(problems, cfg, tmp_path, base=base, drafter=None, progress=False)) == 1
    assert len(evaluate(problems, another_judge, tmp_path, base=base, drafter=None, progress=False)) == 1
    # a judged run made with another judge request is refused
    from streamspec.reason.trace import ReasonTrace

    judged = ReasonTrace(problem="What is 2+3?", method="specreason@0.4", problem_id="b",
                         config=dataclasses.asdict(cfg))
    with (tmp_path / TRACES_FILE).open("a") as handle:
        handle.write(json.dumps(judged.to_dict()) + "\n")
    with pytest.raises(ValueError, match="judge_request: 'error_yes_no_fewshot' there, 'error_yes_no' now"):
        evaluate(problems, another_judge, tmp_path, base=base, drafter=None, progress=False)
