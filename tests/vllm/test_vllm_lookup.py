"""Lookup drafts merged into the streams' drafts in vLLM (`streamspec.vllm.lookup`): what the
lookup finds, how it is merged, the text each request is looked up in, and the drafter folder that
asks for it. No vLLM needed here (tests/vllm/test_vllm_drafter.py runs such a folder in vLLM)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from streamspec.cli import main
from streamspec.vllm.export import check_drafter_folder, export_for_vllm
from streamspec.vllm.lookup import SUFFIX_SETTINGS, lookup_drafts, lookup_name, merge_lookup, parse_lookup, request_texts

from test_vllm_export import streamed_checkpoint


def reference_lookup(text: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The lookup written plainly: the longest n whose last n tokens occur earlier (followed by at
    least one token), at their latest such occurrence."""
    for n in range(min(max_n, len(text) - 1), min_n - 1, -1):
        for start in range(len(text) - n - 1, -1, -1):
            if text[start:start + n] == text[len(text) - n:]:
                return text[start + n:start + n + k]
    return []


def test_the_lookup_takes_the_longest_suffix_at_its_latest_earlier_occurrence():
    text = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    # "5 6 7" (n = 3) occurs at 0 only: what followed it there, even though "6 7" occurs later
    assert lookup_drafts(np.array(text), 3, 1, 4).tolist() == [8, 1, 6]
    # with n at most 2: "6 7" at its latest earlier occurrence (5), followed by 9, 2, 5
    assert lookup_drafts(np.array(text), 3, 1, 2).tolist() == [9, 2, 5]
    # the continuation may end at the text's end; none found: empty
    assert lookup_drafts(np.array([1, 2, 3, 1, 2]), 5, 2, 2).tolist() == [3, 1, 2]
    assert lookup_drafts(np.array([1, 2, 3, 4]), 3, 1, 4).size == 0
    assert lookup_drafts(np.array([4, 4]), 3, 2, 4).size == 0  # a text shorter than MIN + 1
    generator = np.random.default_rng(0)
    for _ in range(300):
        text = generator.integers(0, 6, size=int(generator.integers(1, 40))).tolist()
        k, low = int(generator.integers(1, 5)), int(generator.integers(1, 4))
        high = low + int(generator.integers(0, 4))
        assert lookup_drafts(np.array(text), k, low, high).tolist() == reference_lookup(text, k, low, high)


def test_lookup_drafts_replace_the_first_drafts_and_the_streams_keep_the_rest():
    drafts = torch.tensor([[70, 71, 72], [80, 81, 82], [90, 91, 92]])
    texts = [np.array([1, 2, 3, 1, 2]),  # "1 2" found: followed by 3 1 2 → all three replaced
             np.array([4, 5, 4]),        # "4" (n = 1 < MIN 2) only: kept
             None]                       # not drafting this step: kept
    assert merge_lookup(drafts, texts, 2, 4) == 1
    assert drafts.tolist() == [[3, 1, 2], [80, 81, 82], [90, 91, 92]]
    short = torch.tensor([[70, 71, 72]])
    assert merge_lookup(short, [np.array([7, 8, 9, 7, 8])], 2, 2) == 1  # "7 8" → 9 7 8
    assert short.tolist() == [[9, 7, 8]]
    partial = torch.tensor([[70, 71, 72]])
    merge_lookup(partial, [np.array([1, 2, 3, 9, 1, 2])], 2, 2)  # "1 2" → 3 9 1
    assert partial.tolist() == [[3, 9, 1]]
    tail = torch.tensor([[70, 71, 72]])
    merge_lookup(tail, [np.array([3, 1, 2, 8, 1, 2])], 2, 2)  # followed by 8 1 2 at 1
    assert tail.tolist() == [[8, 1, 2]]
    end = torch.tensor([[70, 71, 72]])
    merge_lookup(end, [np.array([6, 1, 2, 1, 2])], 2, 2)  # "1 2" earlier at 1 only, followed by 1 2
    assert end.tolist() == [[1, 2, 72]]  # two tokens found: the streams keep the third


def test_a_requests_text_is_its_tokens_so_far_and_the_steps_valid_sampled_tokens():
    batch = SimpleNamespace(token_ids_cpu=np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [6, 0, 0, 0, 0]]),
                            num_tokens_no_spec=np.array([3, 2, 1]))
    sampled = torch.tensor([[7, 8, -1], [-1, -1, -1], [9, -1, -1]])
    texts = request_texts(batch, sampled, 3)
    assert texts[0].tolist() == [1, 2, 3, 7, 8] and texts[1] is None and texts[2].tolist() == [6, 9]
    # as lists (vLLM's unpadded drafter batch) the runner has already appended them to its copy
    appended = SimpleNamespace(token_ids_cpu=np.array([[1, 2, 3, 7, 0], [4, 5, 0, 0, 0], [6, 9, 10, 0, 0]]),
                               num_tokens_no_spec=np.array([4, 2, 3]))
    assert [t if t is None else t.tolist() for t in request_texts(appended, [[7], [], [9, 10]], 3)] == [
        [1, 2, 3, 7], None, [6, 9, 10]]


@pytest.mark.parametrize("value", ["2", "0:3", "3:2", "a:b", "2:99", [1], None])
def test_lookup_lengths_are_checked(value):
    if value is None:
        assert parse_lookup(None) is None
        return
    with pytest.raises(ValueError, match="MIN:MAX"):
        parse_lookup(value)
    assert parse_lookup("2:4") == [2, 4] and parse_lookup([1, 1]) == [1, 1]


def test_a_drafter_folder_with_lookup(tmp_path, capsys):
    _, ckpt, _ = streamed_checkpoint(tmp_path, "llama")
    out = tmp_path / "lookup"
    assert main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--out", str(out), "--lookup", "2:4"]) == 0
    assert check_drafter_folder(out)["streamspec"]["lookup"] == [2, 4]
    plain = export_for_vllm(ckpt, tmp_path / "plain")
    assert "lookup" not in check_drafter_folder(plain)["streamspec"]
    assert (out / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    config["streamspec"]["lookup"] = [4, 2]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MIN:MAX"):
        check_drafter_folder(out)
    assert main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--out", str(tmp_path / "x"),
                 "--lookup", "5"]) == 2
    assert "MIN:MAX" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "y"), "--lookup", "2:4"])
    assert "--lookup" in capsys.readouterr().err


def test_lookup_lets_a_dflash_folder_ask_for_more_drafts_than_streams(tmp_path, capsys):
    """Without lookup a DFlash folder drafts 1..γ a step; with it up to 2γ (lookup fills the
    positions past the streams'); the P-EAGLE layout keeps 2..γ+1; a folder edited past its range
    is refused."""
    _, ckpt, _ = streamed_checkpoint(tmp_path, "llama")
    gamma = check_drafter_folder(export_for_vllm(ckpt, tmp_path / "plain"))["streamspec"]["num_streams"]
    wide = export_for_vllm(ckpt, tmp_path / "wide", lookup="2:4", drafts=gamma + 1)
    assert check_drafter_folder(wide)["streamspec"]["num_speculative_tokens"] == gamma + 1
    assert main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--out", str(tmp_path / "cli"),
                 "--lookup", "2:4", "--drafts", str(2 * gamma)]) == 0
    assert check_drafter_folder(tmp_path / "cli")["streamspec"]["num_speculative_tokens"] == 2 * gamma
    for kwargs in ({"drafts": gamma + 1}, {"drafts": 0}, {"lookup": "2:4", "drafts": 2 * gamma + 1},
                   {"layout": "peagle", "lookup": "2:4", "drafts": gamma + 2}):
        with pytest.raises(ValueError, match=r"drafts a step must be \d+\.\.\d+"):
            export_for_vllm(ckpt, tmp_path / "refused", **kwargs)
    assert export_for_vllm(ckpt, tmp_path / "peagle", layout="peagle", drafts=2).exists()
    config = json.loads((wide / "config.json").read_text())
    del config["streamspec"]["lookup"]  # γ+1 drafts without lookup to fill them
    (wide / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="up to 2γ with lookup drafts"):
        check_drafter_folder(wide)
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "y"), "--drafts", "2"])
    assert "--drafts" in capsys.readouterr().err


def test_calibration_measures_a_lookup_folder_past_gamma(tmp_path):
    """`streamspec vllm-calibrate` on a folder with lookup drafts: by default every K up to what the
    folder asks for, and any K up to 2γ when asked; without lookup, past γ is refused."""
    from streamspec.vllm.calibrate import calibration_ks

    _, ckpt, _ = streamed_checkpoint(tmp_path, "llama")
    wide = check_drafter_folder(export_for_vllm(ckpt, tmp_path / "wide", lookup="2:4", drafts=4))["streamspec"]
    plain = check_drafter_folder(export_for_vllm(ckpt, tmp_path / "plain"))["streamspec"]
    gamma = plain["num_streams"]
    assert gamma == 3  # the figures below are γ's
    assert calibration_ks(wide) == [0, 1, 2, 3, 4] and calibration_ks(plain) == [0, 1, 2, 3]
    assert calibration_ks(wide, [0, 6]) == [0, 6]
    with pytest.raises(ValueError, match=r"--ks \[7\]: .* 0 \(off\) or 1\.\.6 a step \(γ = 3, with lookup drafts\)"):
        calibration_ks(wide, [0, 7])
    with pytest.raises(ValueError, match=r"--ks \[4\]: .* 0 \(off\) or 1\.\.3 a step \(γ = 3\)"):
        calibration_ks(plain, [0, 4])


@pytest.mark.parametrize("value", ["suffix:x", "suffix:-1", "suffix:", "sufix", {"method": "suffix", "depth": 3},
                                   {"method": "suffix", "max_tree_depth": 0}, {"method": "ngram"}])
def test_suffix_lookup_settings_are_checked(value):
    with pytest.raises(ValueError, match="suffix"):
        parse_lookup(value)
    default = parse_lookup("suffix")
    assert default == {"method": "suffix", **SUFFIX_SETTINGS} and parse_lookup(default) == default
    assert parse_lookup("suffix:0")["max_cached_requests"] == 0
    assert [lookup_name(parse_lookup(v)) for v in ("suffix", "suffix:0", "2:4")] == ["suffix", "suffix:0", "2:4"]


def test_a_drafter_folder_with_suffix_lookup(tmp_path):
    _, ckpt, _ = streamed_checkpoint(tmp_path, "llama")
    out = tmp_path / "suffix"
    assert main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--out", str(out), "--lookup", "suffix:0",
                 "--layout", "dflash", "--drafts", "5"]) == 0
    facts = check_drafter_folder(out)["streamspec"]
    assert facts["lookup"] == {"method": "suffix", **SUFFIX_SETTINGS, "max_cached_requests": 0}
    assert facts["num_speculative_tokens"] == 5  # past γ: suffix drafts fill those positions too


# Fed the same requests step after step, SuffixLookup drafts what vLLM's own suffix drafter would:
# run in vLLM's environment, where arctic-inference's suffix trees are built (`make vllm`).
SUFFIX_AGREEMENT = r"""
import json, sys
from types import SimpleNamespace
import numpy as np
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
from streamspec.vllm.lookup import SuffixLookup, parse_lookup, request_texts

cached, k = int(sys.argv[1]), 5
settings = parse_lookup(f"suffix:{cached}")
config = SimpleNamespace(
    speculative_config=SimpleNamespace(num_speculative_tokens=k, **{
        f"suffix_decoding_{name}": value for name, value in settings.items() if name != "method"}),
    model_config=SimpleNamespace(max_model_len=4096))
theirs, ours = SuffixDecodingProposer(config), SuffixLookup(settings)
rng = np.random.default_rng(0)
motif = rng.integers(3, 40, size=12)
def text(n):  # repeats of a motif with noise: the trees find matches, and miss some
    out = np.concatenate([motif] * (n // 12 + 1))[:n].copy()
    out[rng.random(n) < 0.15] = rng.integers(3, 40)
    return out
# each request: id, the step it joins, its prompt, its output (decoded a few tokens a step)
requests = [(f"r{i}", 2 * i, text(int(rng.integers(8, 30))), text(int(rng.integers(20, 45)))) for i in range(6)]
steps, compared, nonempty = 40, 0, 0
done = {}
for step in range(steps):
    batch = [r for r in requests if r[1] <= step and done.get(r[0], 0) < len(r[3])]
    if not batch:
        continue
    size = max(len(p) + len(o) for _, _, p, o in batch) + 8
    tokens = np.zeros((len(batch), size), dtype=np.int32)
    sampled, lengths = [], []
    for i, (rid, start, prompt, output) in enumerate(batch):
        new = int(rng.integers(1, 4)) if rid in done else 1
        upto = min(done.get(rid, 0) + new, len(output))
        sampled.append(output[done.get(rid, 0):upto].tolist())
        done[rid] = upto
        seq = np.concatenate([prompt, output[:upto]])
        tokens[i, :len(seq)] = seq
        lengths.append(len(seq))
    ids = [r[0] for r in batch]
    input_batch = SimpleNamespace(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                  num_prompt_tokens=np.array([len(r[2]) for r in batch]),
                                  num_tokens_no_spec=np.array(lengths), token_ids_cpu=tokens)
    expected = theirs.propose(k, input_batch, sampled)
    found = ours.drafts(input_batch, request_texts(input_batch, sampled, len(batch)), k)
    for a, b in zip(expected, found):
        assert list(a) == b.tolist(), (step, a, b)
        compared += 1
        nonempty += bool(len(a))
print(json.dumps({"compared": compared, "nonempty": nonempty}))
"""


@pytest.mark.parametrize("cached", [0, 100])
def test_suffix_lookup_drafts_what_vllms_suffix_drafter_drafts(cached):
    """The suffix lookup keeps arctic-inference's trees as vLLM's suffix drafter does (each request
    started from its prompt, given what its text gained, stopped when it leaves the batch; with a
    global tree of finished requests' outputs or without): step for step, the same drafts."""
    import subprocess

    from streamspec.vllm.client import check_suffix_decoding, vllm_python

    try:
        python = vllm_python()
    except FileNotFoundError as err:  # `make test` builds the environment first
        pytest.skip(str(err))
    check_suffix_decoding()  # fails naming the fix (`make vllm`) when the trees are not built
    proc = subprocess.run([str(python), "-c", SUFFIX_AGREEMENT, str(cached)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["compared"] > 60 and 0 < counts["nonempty"] < counts["compared"]
