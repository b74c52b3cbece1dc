"""Judge requests as a setting (`streamspec.reason.judging`): each request's readings and threshold
units, the answer tokens found in a real tokenizer, a yes/no judgement in process equal to a fresh
forward's probabilities, both logprob shapes servers answer with, the calibration that compares
requests plainly and within position (with the position-only baseline and a fitted threshold),
and llama.cpp as a backend: a SpecReason run whose base and judge are the default model's GGUF."""

from __future__ import annotations

import json

import pytest
import torch

from streamspec.reason.backends import Judgement, LocalBackend, chat_frame, top_logprobs
from streamspec.reason.config import ReasonConfig, load_reason_config
from streamspec.reason.evaluate import calibrate
from streamspec.reason.judging import DEFAULT_REQUEST, JUDGE_REQUESTS, answer_token_ids, judge_request
from streamspec.reason.report import auroc_within_position, calibration, fitted_threshold, markdown, summarize
from streamspec.reason.tasks import AnnotatedSolution

PROBLEM = "Tom has 3 apples and buys 5 more. How many apples does he have?"


def test_each_request_reads_its_answers_in_its_own_units():
    digits = judge_request("score_0_9")
    probs = {str(d): 0.0 for d in range(10)} | {"9": 0.6, "3": 0.2}
    assert digits.score(probs, "9", "argmax") == 9.0 and digits.score(probs, None, "argmax") == 0.0
    assert digits.score(probs, "9", "expected") == pytest.approx((9 * 0.6 + 3 * 0.2) / 0.8)
    error = judge_request("error_yes_no")
    assert error.score({"Yes": 0.2, "No": 0.6}, "No", "p_no_error") == pytest.approx(0.75)
    assert error.score({"Yes": 0.2, "No": 0.6}, "No", "log_odds") == pytest.approx(torch.tensor(3.0).log().item())
    correct = judge_request("correct_yes_no")
    assert correct.score({"Yes": 0.2, "No": 0.6}, "No", "p_correct") == pytest.approx(0.25)
    fewshot, verdict = judge_request("error_yes_no_fewshot"), judge_request("correct_or_error")
    assert fewshot.score({"Yes": 0.2, "No": 0.6}, "No", "p_no_error") == pytest.approx(0.75)
    assert "Error: Yes" in fewshot.text and fewshot.text.endswith(error.text.split("? ", 1)[1])
    assert verdict.score({"Correct": 0.1, "Error": 0.3}, "Error", "p_correct") == pytest.approx(0.25)
    assert verdict.score({"Correct": 0.1, "Error": 0.3}, "Error", "log_odds") == pytest.approx(-torch.tensor(3.0).log().item())
    with pytest.raises(ValueError, match="must be its two answers"):
        type(error)(name="odd", text="?", reply_opening="", answers=("Yes", "No"), scores=("p",), default_threshold=0.5,
                    bounds={}, good="Yes", bad="Maybe")
    with pytest.raises(ValueError, match="reads"):
        error.score({}, None, "argmax")
    with pytest.raises(ValueError, match="unknown judge request"):
        judge_request("vibes")
    judgement = Judgement.of_answers(error, {"Yes": 0.1, "No": 0.3}, "No", 5, 0.0)
    assert judgement.score("p_no_error") == pytest.approx(0.75) and judgement.digit_probs == []
    old = Judgement([0.0] * 9 + [1.0], 9, 3, 0.0)  # the 0-9 score as backends made it before
    assert old.score("argmax") == 9.0 and old.answer_probs["9"] == 1.0


def test_the_setting_defaults_to_the_requests_units_and_refuses_mismatches(tmp_path):
    assert (ReasonConfig().judge_request, ReasonConfig().threshold, ReasonConfig().score) == (
        DEFAULT_REQUEST, 0.4, "p_no_error") == ("error_yes_no_fewshot", 0.4, "p_no_error")
    paper = ReasonConfig(judge_request="score_0_9")
    assert (paper.threshold, paper.score) == (7.0, "argmax")
    yes_no = ReasonConfig(judge_request="error_yes_no")
    assert (yes_no.threshold, yes_no.score) == (0.5, "p_no_error")
    assert ReasonConfig(judge_request="error_yes_no", score="log_odds", threshold=-2.0).threshold == -2.0
    with pytest.raises(ValueError, match=r"\[0, 1\], got 7.0; a threshold on the paper's 0-9 score goes with"):
        ReasonConfig(judge_request="error_yes_no", threshold=7)
    with pytest.raises(ValueError, match="judge request 'score_0_9'"):
        ReasonConfig(threshold=7)  # the default request reads a probability
    with pytest.raises(ValueError, match="one of \\['argmax', 'expected'\\]"):
        ReasonConfig(judge_request="score_0_9", score="p_no_error")
    with pytest.raises(ValueError, match="one of \\['p_no_error', 'log_odds'\\]"):
        ReasonConfig(score="expected")
    with pytest.raises(ValueError, match="judge_request must be one of"):
        ReasonConfig(judge_request="vibes")
    config = tmp_path / "reason.yaml"
    config.write_text("judge:\n  request: error_yes_no\n")
    setup = load_reason_config(config, ["reason.threshold=0.8"])
    assert setup.reason.judge_request == "error_yes_no" and setup.reason.threshold == 0.8 and setup.judge is None


def test_answer_tokens_of_a_real_tokenizer():
    from streamspec.assets import DEFAULT_MODEL_ID, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL_ID)
    for name, request in JUDGE_REQUESTS.items():
        found = answer_token_ids(tokenizer, request)
        assert set(found) == set(request.answers) and all(found.values()), name
        for answer, ids in found.items():
            assert all(tokenizer.decode([i]).strip().lower() == answer.lower() for i in ids)
        frame = chat_frame(tokenizer, request)
        assert request.text in frame.judge_suffix and frame.judge_suffix.endswith(request.reply_opening)


def test_a_yes_no_judgement_in_process_equals_a_fresh_forward(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    backend = LocalBackend(base, tokenizer, name="judge")
    backend.start(PROBLEM)
    backend.judge("First, 3 + 5.\n\n")  # the 0-9 request, kept: the yes/no one follows it
    request = judge_request("error_yes_no")
    verdict = backend.judge("So he has 8.\n\n", "error_yes_no")
    suffix = tokenizer.encode(chat_frame(tokenizer, request).judge_suffix, add_special_tokens=False)
    with torch.no_grad():
        probs = base(torch.tensor([backend.session.ids + suffix])).logits[0, -1].softmax(-1)
    for answer, ids in answer_token_ids(tokenizer, request).items():
        assert verdict.answer_probs[answer] == pytest.approx(float(probs[list(ids)].sum()), abs=1e-5)
    assert verdict.request == "error_yes_no" and 0 <= verdict.score("p_no_error") <= 1
    assert tokenizer.decode(backend.session.ids).endswith("So he has 8.\n\n")  # the request was dropped


def test_both_logprob_shapes_are_read():
    legacy = {"text": " Yes", "logprobs": {"top_logprobs": [{" Yes": -0.1, "No": -2.5}]}}
    chat = {"text": "Yes", "logprobs": {"content": [{"token": "Yes", "logprob": -0.1,
                                                     "top_logprobs": [{"token": "Yes", "logprob": -0.1},
                                                                      {"token": " No", "logprob": -2.5}]}]}}
    assert sorted(top_logprobs(legacy)) == sorted([(" Yes", -0.1), ("No", -2.5)])
    assert top_logprobs(chat) == [("Yes", -0.1), (" No", -2.5)]
    assert top_logprobs({"text": "x"}) == []


def test_within_position_auroc_and_the_fitted_threshold():
    # position alone: every good step comes early; within a position the score separates perfectly
    scored = [(0.9, True, 0), (0.2, False, 0), (0.8, True, 1), (0.3, False, 1), (0.1, False, 2)]
    within, pairs = auroc_within_position(scored)
    assert (within, pairs) == (1.0, 2)
    assert auroc_within_position([(0.5, True, 0), (0.5, False, 1)]) == (None, 0)
    fit = fitted_threshold([0.9, 0.8], [0.2, 0.3, 0.1])
    assert fit["threshold"] == 0.8 and fit["good_accepted"] == 1.0 and fit["bad_rejected"] == 1.0
    result = calibration(scored, grid=None)
    assert result["auroc_within_position"] == 1.0 and result["thresholds"] == [] and result["fitted"]["threshold"] == 0.8


class _Judge:
    """A judge whose yes/no answer knows which steps are wrong and whose 0-9 score knows only the
    position (the confound the within-position figure removes)."""

    def start(self, problem):
        self.k = 0

    def judge(self, step, request=None):
        request = judge_request(request or "score_0_9")
        k, self.k = self.k, self.k + 1
        if request.name == "score_0_9":
            return Judgement.of_answers(request, {str(d): float(d == 9 - k) for d in range(10)}, str(9 - k), 1, 0.0)
        wrong = "wrong" in step
        no, yes = (0.2, 0.8) if wrong else (0.8, 0.2)
        good, bad = request.good, request.bad
        return Judgement.of_answers(request, {good: no, bad: yes}, good if not wrong else bad, 1, 0.0)


def test_calibration_compares_requests_within_position_and_resumes(tmp_path):
    solutions = [AnnotatedSolution(problem_id=f"p{i}", question="q", steps=steps, first_wrong_step=wrong)
                 for i, (steps, wrong) in enumerate([
                     (["a", "b wrong", "c wrong"], 1), (["a", "b", "c wrong"], 2), (["a", "b", "c"], None),
                     (["a wrong", "b wrong"], 0)])]
    result = calibrate(_Judge(), solutions, tmp_path, progress=False, requests=["score_0_9", "error_yes_no"])
    digits, errors = result["requests"]["score_0_9"]["argmax"], result["requests"]["error_yes_no"]["p_no_error"]
    assert digits["auroc"] > 0.5 and digits["auroc_within_position"] == 0.5  # position only
    assert errors["auroc_within_position"] == 1.0 and errors["fitted"]["threshold"] == 0.8
    assert result["position_only"]["auroc"] == digits["auroc"] and result["position_only"]["auroc_within_position"] == 0.5
    assert result["best"]["request"] == "error_yes_no" and result["steps"] == 11 and result["solutions"] == 4
    lines = (tmp_path / "calibration.jsonl").read_text().splitlines()
    assert len(lines) == 22 and {json.loads(line)["request"] for line in lines} == {"score_0_9", "error_yes_no"}
    again = calibrate(None, solutions, tmp_path, progress=False, requests=["score_0_9", "error_yes_no"])  # all done
    assert again["best"] == result["best"]
    summary = summarize([])
    summary["calibration"] = result
    table = markdown(summary)
    assert f"| error_yes_no | p_no_error | {errors['auroc']:.3f} | 1.000 | 0.800 | 100.0% | 100.0% |" in table
    assert "Best within position: `error_yes_no`" in table and "(the step's position alone)" in table
    assert "| method | n |" not in table and "stop reasons" not in table  # no method ran: no empty tables
    assert markdown(summarize([])).strip() == "No method ran."


@pytest.mark.slow
def test_specreason_on_llama_cpp_base_and_judge(single_thread, tmp_path):
    pytest.importorskip("xllamacpp")
    from streamspec.reason.backends import LlamaCppBackend
    from streamspec.reason.config import BackendConfig
    from streamspec.reason.backends import backend_from_config
    from streamspec.reason.reasoner import SpecReasoner

    with pytest.raises(ValueError, match="needs a GGUF"):
        BackendConfig(source="llama.cpp:")
    base = backend_from_config(BackendConfig(source="llama.cpp:streamspec:SmolLM2-135M-Instruct"), "base")
    drafter = LlamaCppBackend("streamspec:SmolLM2-135M-Instruct", threads=1, name="drafter")
    try:
        assert isinstance(base, LlamaCppBackend) and base.url.startswith("http://127.0.0.1:")
        config = ReasonConfig(token_budget=80, step_max_tokens=16, answer_max_tokens=6, temperature=0.0,
                              judge_request="error_yes_no", threshold=0.0)
        trace = SpecReasoner(drafter, base, config).solve("What is 2 + 3?")
        assert trace.stop_reason != "error" and trace.drafted_steps
        assert all(s.author == "drafter" for s in trace.drafted_steps)  # threshold 0: every draft kept
        for step in trace.drafted_steps:
            assert set(step.answer_probs) == {"Yes", "No"} and 0 < sum(step.answer_probs.values()) <= 1 + 1e-6
        base.start("What is 2 + 3?")
        digits = base.judge("2 + 3 = 5.\n\n", "score_0_9")
        assert 0 < sum(digits.digit_probs) <= 1 + 1e-6 and len(digits.digit_probs) == 10
    finally:
        base.close()
        drafter.close()
    from streamspec.reason.cli import _backends
    from streamspec.reason.config import ReasonSetup

    *_, plain = _backends(ReasonSetup(), need_plain=True, plain_source="llama.cpp:streamspec:SmolLM2-135M-Instruct")
    try:  # reason-eval --plain-drafter: the plain-drafter peer on llama.cpp
        assert isinstance(plain, LlamaCppBackend) and plain.name == "drafter (no streams)"
    finally:
        plain.close()


def test_a_preamble_request_puts_its_examples_before_the_conversation():
    """``error_yes_no_fewshot_first``: the judge's conversation opens with the examples (a system
    message), then the problem and the steps as the solver saw them; the question after the steps
    is the short one, without the examples; an in-process judge refuses it by name."""
    from streamspec.assets import DEFAULT_MODEL_ID, load_tokenizer
    from streamspec.reason.backends import chat_frame
    from streamspec.reason.judging import JUDGE_REQUESTS
    from streamspec.data.reasoning import solve_message

    tokenizer = load_tokenizer(DEFAULT_MODEL_ID)
    first, after = JUDGE_REQUESTS["error_yes_no_fewshot_first"], JUDGE_REQUESTS["error_yes_no_fewshot"]
    assert first.preamble and first.preamble in after.text  # the same examples, moved
    frame, plain = chat_frame(tokenizer, first), chat_frame(tokenizer, after)
    prompt = frame.prefix("What is 2 + 3?")
    assert prompt.index(first.preamble) < prompt.index(solve_message("What is 2 + 3?"))
    assert first.preamble not in frame.judge_suffix and first.text in frame.judge_suffix
    assert frame.tail == plain.tail  # the steps follow the problem as in the solver's own text
    assert len(tokenizer(frame.judge_suffix)["input_ids"]) < len(tokenizer(plain.judge_suffix)["input_ids"]) - 100
    no_template = chat_frame(object(), first)
    assert no_template.prefix("q").startswith(first.preamble)


def test_an_in_process_judge_refuses_a_preamble_request(tiny_dir):
    from streamspec.loading import load_for_inference
    from streamspec.reason.backends import LocalBackend
    from streamspec.reason.reasoner import SpecReasoner

    loaded = load_for_inference(tiny_dir)
    local = LocalBackend(loaded.model, loaded.tokenizer)
    with pytest.raises(ValueError, match="error_yes_no_fewshot_first.*before the conversation"):
        SpecReasoner(local, local, ReasonConfig(judge_request="error_yes_no_fewshot_first"))
    local.start("What is 2 + 3?")
    with pytest.raises(ValueError, match="before the conversation"):
        local.judge("5.\n\n", "error_yes_no_fewshot_first")


@pytest.mark.slow
def test_llama_cpp_judgements_on_their_own_slot_prefill_only_the_new_step(single_thread):
    """On llama.cpp the judge's slot keeps the examples, the problem and the steps cached: a
    judgement with the examples first prefills only the new step and the question, while the
    role's own text keeps its slot (generating after a judgement re-reads nothing judged)."""
    pytest.importorskip("xllamacpp")
    from streamspec.reason.backends import LlamaCppBackend, Sampling, TextStop

    base = LlamaCppBackend("streamspec:SmolLM2-135M-Instruct", threads=1, name="base")
    try:
        assert base.slots == {"generate": 0, "judge": 1}
        base.start("Tom has 3 apples and buys 4 more. How many apples does he have?")
        stop = TextStop("\n\n")
        base.generate(24, Sampling(temperature=0.0), stop)
        first = base.judge("He buys 4 more, so 3 + 4 = 7.\n\n", "error_yes_no_fewshot_first")
        second = base.judge("So Tom has 7 apples.\n\n", "error_yes_no_fewshot_first")
        suffix = len(base._tokenizer(base._frames["error_yes_no_fewshot_first"].judge_suffix)["input_ids"])
        assert 0 < second.tokens_read < 40 + suffix < first.tokens_read  # the second: its step and the question only
        assert set(second.answer_probs) == {"Yes", "No"}
        after = base.judge("So Tom has 7 apples.\n\n", "error_yes_no_fewshot")  # examples after: all again
        assert after.tokens_read > len(base._tokenizer(JUDGE_REQUESTS["error_yes_no_fewshot"].text)["input_ids"])
        # the same problem started again (another method's run of it) finds nothing cached: what
        # it judges costs what it cost the first time, whichever run came before
        base.start("Tom has 3 apples and buys 4 more. How many apples does he have?")
        base.generate(24, Sampling(temperature=0.0), stop)
        again = base.judge("He buys 4 more, so 3 + 4 = 7.\n\n", "error_yes_no_fewshot_first")
        assert again.tokens_read == first.tokens_read
    finally:
        base.close()
