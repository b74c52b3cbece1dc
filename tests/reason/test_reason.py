"""SpecReason (`streamspec.reason`): the step loop's rules with scripted backends, then the real
thing on tiny models and SmolLM2's tokenizer: KV reuse is exact, streams change no text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamspec import StreamConfig, add_streams
from streamspec.reason.backends import Backend, Generation, Judgement, LocalBackend, TextStop, chat_frame
from streamspec.reason.config import BackendConfig, ReasonConfig, load_reason_config
from streamspec.reason.reasoner import SpecReasoner
from streamspec.reason.judging import judge_request

pytestmark = pytest.mark.usefixtures("single_thread")


class Scripted(Backend):
    """A backend whose steps and scores are given: it tests the loop's rules, not a model. A
    "token" is a word; `calls` records every generate's cap."""

    def __init__(self, steps, scores=(), name="scripted", fail_at=None):
        self.steps, self.scores, self.name, self.fail_at = list(steps), list(scores), name, fail_at
        self.calls: list[int] = []
        self.text = ""

    def start(self, problem):
        self.text, self.i, self.j = f"<{problem}>", 0, 0

    def mark(self):
        return len(self.text)

    def rollback(self, mark):
        self.text = self.text[:mark]

    def append(self, text):
        self.text += text

    def generate(self, max_tokens, sampling, stop):
        self.calls.append(max_tokens)
        if self.fail_at is not None and len(self.calls) > self.fail_at:
            raise ConnectionError("server went away")
        source = self.steps[min(self.i, len(self.steps) - 1)].replace("{i}", f"{self.name}{self.i}")
        self.i += 1
        words = source.split(" ")[:max_tokens]
        text = " ".join(words)
        self.text += text
        return Generation(text=text, tokens=len(words), passes=max(1, len(words) // 2), seconds=0.0)

    def judge(self, step):
        self.text += step
        score = self.scores[min(self.j, len(self.scores) - 1)]
        self.j += 1
        probs = [0.0] * 10
        probs[score] = 1.0
        return Judgement(probs, score, 3, 0.0)


def reasoner(drafter_steps, base_steps, scores, **cfg):
    cfg = {"token_budget": 1000, "answer_max_tokens": 8, "judge_request": "score_0_9", **cfg}  # Scripted scores 0-9
    drafter, base = Scripted(drafter_steps, name="drafter"), Scripted(base_steps, scores, name="base")
    return SpecReasoner(drafter, base, ReasonConfig(**cfg)), drafter, base


def test_accepts_high_scores_and_rewrites_low_ones():
    r, drafter, base = reasoner(["d1\n\n", "d2\n\n", "so \\boxed{7}\n\n"], ["b1\n\n"], [9, 3, 8], threshold=7)
    trace = r.solve("p")
    assert [s.author for s in trace.steps] == ["drafter", "base", "drafter"]
    assert trace.steps[1].drafted_text == "d2\n\n" and trace.steps[1].text == "b1\n\n"
    assert [s.score for s in trace.steps] == [9, 3, 8]
    assert trace.stop_reason == "answered" and trace.answer == "7"
    # every conversation holds exactly the kept steps: the rejected draft left all of them
    kept = "<p>" + trace.text
    assert drafter.text == kept and base.text == kept
    assert trace.acceptance_rate == pytest.approx(2 / 3)


def test_budget_counts_every_token_and_is_never_overshot():
    step = "w{i} " + " ".join(["w"] * 8) + "\n\n"  # 10 words, a different first one each time
    for budget in (30, 47, 61, 100):
        r, drafter, base = reasoner([step], [step], [9, 2], token_budget=budget, answer_max_tokens=5, step_max_tokens=20)
        trace = r.solve("p")
        assert trace.tokens["total"] <= budget
        assert trace.tokens["total"] == trace.tokens["draft_kept"] + trace.tokens["draft_rejected"] + \
            trace.tokens["base"] + trace.tokens["answer"]
        assert trace.tokens["draft_rejected"] > 0  # rejected drafts count
        assert trace.stop_reason == "budget"
        assert trace.answer_text  # the answer phase ran within what was kept back
        assert all(cap <= 20 for cap in drafter.calls + base.calls)


def test_two_identical_steps_stop_with_repetition_not_answered():
    r, *_ = reasoner(["same step\n\n"], ["x\n\n"], [9])
    trace = r.solve("p")
    assert trace.stop_reason == "repetition" and len(trace.steps) == 2


def test_mentioning_boxed_is_not_an_answer():
    r, *_ = reasoner(["we will write \\boxed{ later\n\n", "then \\boxed{12}\n\n"], ["x\n\n"], [9])
    trace = r.solve("p")
    assert len(trace.steps) == 2 and trace.stop_reason == "answered" and trace.answer == "12"


def test_first_base_steps_are_unjudged():
    r, *_ = reasoner(["d\n\n", "\\boxed{1}\n\n"], ["b0\n\n", "b1\n\n"], [9], first_base_steps=2)
    trace = r.solve("p")
    assert [(s.author, s.score) for s in trace.steps[:2]] == [("base", None), ("base", None)]
    assert trace.steps[2].author == "drafter"


def test_a_backend_error_is_recorded_and_the_run_goes_on():
    drafter = Scripted(["d\n\n"], name="drafter", fail_at=1)
    r = SpecReasoner(drafter, Scripted(["b\n\n"], [9]), ReasonConfig(token_budget=100, answer_max_tokens=4,
                                                                           judge_request="score_0_9"))
    trace = r.solve("p")
    assert trace.stop_reason == "error" and "server went away" in trace.error
    assert r.solve("q").stop_reason == "error"  # the reasoner itself is still usable


def test_baselines_use_the_same_loop():
    r, drafter, base = reasoner(["d \\boxed{3}\n\n"], ["b \\boxed{4}\n\n"], [9])
    assert r.base_only("p").answer == "4" and r.drafter_only("p").answer == "3"
    assert r.base_only("p").steps[0].author == "base"


@pytest.mark.parametrize("bad", [dict(threshold=9.5), dict(threshold=-1), dict(token_budget=0), dict(score="max"),
                                 dict(step_delimiter=""), dict(token_budget=10, answer_max_tokens=10),
                                 dict(top_p=0), dict(first_base_steps=-1)])
def test_bad_config_names_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ReasonConfig(**bad)


def test_empty_problem_is_refused():
    r, *_ = reasoner(["d\n\n"], ["b\n\n"], [9])
    with pytest.raises(ValueError, match="empty"):
        r.solve("  ")


def test_yaml_config_and_overrides(tmp_path):
    path = tmp_path / "reason.yaml"
    path.write_text("reason:\n  judge_request: score_0_9\n  threshold: 5\n  token_budget: 300\nbase:\n  source: some/folder\n")
    setup = load_reason_config(path, ["reason.score=expected", "drafter.source=http://127.0.0.1:1/v1",
                                      "drafter.model=m"])
    assert setup.reason.threshold == 5 and setup.reason.score == "expected" and setup.base.source == "some/folder"
    assert setup.drafter.is_server and setup.judge is None
    with pytest.raises(ValueError, match="unknown"):
        load_reason_config(path, ["reason.thresold=3"])
    with pytest.raises(ValueError, match="model"):
        BackendConfig(source="http://127.0.0.1:1/v1")


def test_text_stop():
    assert TextStop(delimiter="\n\n").end("\n\nabc\n\ndef") == 2  # as servers cut: an empty step
    assert TextStop(delimiter="\n\n").end("abc.\n\ndef") == 6
    assert TextStop(delimiter="\n\n").end("abc") is None
    assert TextStop(boxed=True).end("\\frac{1}{2}} more") == 12
    assert TextStop(boxed=True).end("12") is None


# -- real models --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    torch.manual_seed(5)
    drafter_base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():  # a different model from the base, so the judge has something to judge
        for p in drafter_base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    drafter = add_streams(drafter_base, StreamConfig(stream_layers=2, mode="lossless")).eval()
    return tokenizer, base, drafter


CFG = dict(token_budget=120, step_max_tokens=24, answer_max_tokens=6, temperature=0.0, judge_request="score_0_9")
PROBLEM = "Tom has 3 apples and buys 5 more. How many apples does he have?"


def test_judge_with_kept_cache_equals_a_fresh_forward(tiny):
    from streamspec.reason.backends import _digit_ids

    tokenizer, base, _ = tiny
    frame = chat_frame(tokenizer, "score_0_9")
    backend = LocalBackend(base, tokenizer, name="base")
    backend.start(PROBLEM)
    backend.judge("First, 3 + 5.\n\n", "score_0_9")  # kept: its entries stay in the cache
    verdict = backend.judge("So he has 8.\n\n", "score_0_9")
    text = frame.prefix(PROBLEM) + "First, 3 + 5.\n\n" + "So he has 8.\n\n"
    assert tokenizer.decode(backend.session.ids) == text  # the request was dropped again
    suffix_ids = tokenizer.encode(frame.judge_suffix, add_special_tokens=False)
    with torch.no_grad():
        probs = base(torch.tensor([backend.session.ids + suffix_ids])).logits[0, -1].softmax(-1)
    expected = [float(probs[list(ids)].sum()) for ids in _digit_ids(tokenizer)]
    assert verdict.digit_probs == pytest.approx(expected, abs=1e-5)
    assert all(len(ids) >= 1 for ids in _digit_ids(tokenizer))
    # only the new step and the request were read, not the prefix or the first step
    step_ids = tokenizer.encode("So he has 8.\n\n", add_special_tokens=False)
    assert verdict.tokens_read == len(step_ids) + len(suffix_ids)


def test_streams_change_no_text(tiny):
    """Threshold 0 keeps every draft: SpecReason with the lossless streamed drafter writes what the
    same drafter without streams writes, token for token (greedy)."""
    tokenizer, base, drafter = tiny
    with_streams = SpecReasoner(LocalBackend(drafter, tokenizer, name="drafter"), LocalBackend(base, tokenizer),
                                ReasonConfig(threshold=0, **CFG)).solve(PROBLEM)
    plain = SpecReasoner(LocalBackend(drafter, tokenizer, streams=False, name="drafter"), LocalBackend(base, tokenizer),
                         ReasonConfig(threshold=0, **CFG)).solve(PROBLEM)
    assert with_streams.stop_reason != "error", with_streams.error
    assert with_streams.text == plain.text and len(with_streams.steps) >= 1
    assert all(s.author == "drafter" for s in with_streams.steps)
    assert with_streams.tokens["total"] <= CFG["token_budget"]
    alone = SpecReasoner(LocalBackend(drafter, tokenizer, streams=False), None, ReasonConfig(**CFG)).drafter_only(PROBLEM)
    assert "".join(s.text for s in alone.steps) == "".join(s.text for s in plain.steps)


def test_rejections_hand_the_step_to_the_base(tiny):
    """With an impossible bar (expected score 9) every draft is rewritten: the text is the base's
    own, as if it had written alone."""
    tokenizer, base, drafter = tiny
    cfg = ReasonConfig(threshold=9, score="expected", **CFG)
    spec = SpecReasoner(LocalBackend(drafter, tokenizer, name="drafter"), LocalBackend(base, tokenizer), cfg)
    trace = spec.solve(PROBLEM)
    assert trace.stop_reason != "error", trace.error
    assert all(s.author == "base" and s.drafted_text is not None for s in trace.steps)
    alone = spec.base_only(PROBLEM)
    assert "".join(s.text for s in trace.steps)[:40] == "".join(s.text for s in alone.steps)[:40]
    assert trace.tokens["total"] <= cfg.token_budget


def test_a_streamed_base_keeps_its_own_outputs(tiny):
    """Lossless streams on the base speed up its rewrites and change nothing it writes or judges."""
    tokenizer, base, drafter = tiny
    streamed_base = add_streams(base, StreamConfig(stream_layers=2, mode="lossless")).eval()
    cfg = ReasonConfig(threshold=9, score="expected", **CFG)
    plain = SpecReasoner(LocalBackend(drafter, tokenizer), LocalBackend(base, tokenizer), cfg).solve(PROBLEM)
    fast = SpecReasoner(LocalBackend(drafter, tokenizer), LocalBackend(streamed_base, tokenizer), cfg).solve(PROBLEM)
    assert fast.stop_reason != "error", fast.error
    assert fast.text == plain.text
    assert [s.score for s in fast.steps] == pytest.approx([s.score for s in plain.steps], abs=1e-4)


def test_a_tokenizer_that_cannot_render_the_prompt_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import make_model

    words = ["[UNK]", "Solve", "the", "problem", "step", "by"] + [str(d) for d in range(10)]
    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="[UNK]")
    backend = LocalBackend(make_model("llama"), tokenizer, name="drafter")
    with pytest.raises(ValueError, match="drafter's tokenizer cannot render the prompt"):
        backend.start("Wie viele Äpfel hat Tom?")


def test_a_judge_without_requests_gives_only_the_0_9_score():
    """A backend written before judge requests (``judge(step)``) still judges the paper's 0-9
    score, and any other request is refused by name, not misread."""
    r, *_ = reasoner(["d\n\n"], ["b\n\n"], [9], judge_request="error_yes_no_fewshot", threshold=0.4)
    trace = r.solve("p")
    assert trace.stop_reason == "error" and "takes no judge request" in trace.error
    assert "judge_request='score_0_9'" in trace.error


def test_judges_take_the_request_by_name():
    """A backend whose judge names its request (keyword-only too) gets it by name; one whose
    second parameter is something else is not handed the request for it."""
    class KeywordJudge(Scripted):
        def judge(self, step, *, request=None):
            assert request == "error_yes_no_fewshot"
            self.text += step
            return Judgement.of_answers(judge_request(request), {"Yes": 0.1, "No": 0.9}, "No", 3, 0.0)

    class OtherParameter(Scripted):
        def judge(self, step, max_tokens=8):
            raise AssertionError("not to be called with a request in max_tokens")

    drafter = Scripted(["d \\boxed{3}\n\n"], name="drafter")
    kept = SpecReasoner(drafter, KeywordJudge(["b\n\n"]), ReasonConfig(token_budget=100, answer_max_tokens=4)).solve("p")
    assert kept.stop_reason != "error" and kept.steps[0].author == "drafter"
    refused = SpecReasoner(Scripted(["d\n\n"], name="drafter"), OtherParameter(["b\n\n"]),
                           ReasonConfig(token_budget=100, answer_max_tokens=4)).solve("p")
    assert refused.stop_reason == "error" and "takes no judge request" in refused.error
