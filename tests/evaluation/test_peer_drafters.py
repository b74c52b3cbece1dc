"""The vllm_eagle3 / vllm_peagle drafters' training data: a distilled set's rows as token rows with
a loss mask, the same tokens the streams train on (tests/vllm/test_vllm_drafter.py trains the
drafters with speculators and decodes with them in vLLM)."""

from __future__ import annotations

import json

import pytest

from streamspec.assets import DEFAULT_MODEL_ID, load_default_tokenizer
from streamspec.data.build import prompt_ids
from streamspec.evaluation.peer_drafters import distilled_examples, train_peer_drafter


def test_distilled_rows_become_the_streams_token_rows(tmp_path):
    tokenizer = load_default_tokenizer()
    rows = [{"prompt": "How many singers are there?", "completion": "SELECT count(*) FROM singer",
             "completion_ids": [19, 20, 21, 2]},
            {"prompt": "List the names. " * 200, "completion": "x", "completion_ids": [5, 2]},  # over max_length
            {"prompt": "Which stadium is the largest?", "completion": "SELECT", "completion_ids": [30, 31, 2]}]
    path = tmp_path / "distilled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, counts = distilled_examples(DEFAULT_MODEL_ID, path, max_length=128, seed=0)
    assert counts == {"distilled_rows": 3, "kept": 2, "dropped_too_long": 1, "dropped_no_completion": 0, "used": 2,
                      "max_length": 128}
    by_completion = {tuple(e["input_ids"][-len(r["completion_ids"]):]): (e, r) for e in examples for r in rows
                     if e["input_ids"][-len(r["completion_ids"]):] == r["completion_ids"]}
    assert len(by_completion) == 2
    for example, row in by_completion.values():
        prompt = prompt_ids(tokenizer, row)[0].tolist()  # the chat template around the prompt, as decoding sees it
        assert example["input_ids"] == prompt + row["completion_ids"]  # the model's own ids, as generated
        assert example["loss_mask"] == [0] * len(prompt) + [1] * len(row["completion_ids"])
    # the first N after a seeded shuffle
    again, _ = distilled_examples(DEFAULT_MODEL_ID, path, max_length=128, max_rows=1, seed=0)
    assert again == examples[:1]
    # in the set's own order, whatever the seed: the first kept row of the file (the rows
    # data.max_train_examples takes); seed 1 shuffles the third row before the first
    shuffled, _ = distilled_examples(DEFAULT_MODEL_ID, path, max_length=128, max_rows=1, seed=1)
    first, _ = distilled_examples(DEFAULT_MODEL_ID, path, max_length=128, max_rows=1, seed=1, shuffle=False)
    assert shuffled[0]["input_ids"][-3:] == rows[2]["completion_ids"]
    assert first[0]["input_ids"][-4:] == rows[0]["completion_ids"]


def test_training_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="method must be one of"):
        train_peer_drafter("base", [{"input_ids": [1], "loss_mask": [1]}], tmp_path / "d", method="medusa")
    with pytest.raises(ValueError, match="no rows"):
        train_peer_drafter("base", [], tmp_path / "d")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="holds no trained drafter"):
        train_peer_drafter("base", [{"input_ids": [1, 2], "loss_mask": [0, 1]}], tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me" and not (tmp_path / "mine-work").exists()


def test_hidden_states_resume_where_a_stopped_run_stopped(tiny_dir, tmp_path):
    """The peers' hidden-state files (speculators' layout): the residual stream entering each named
    layer and the last layer's output before the final norm; a second call writes only the rows
    whose file is missing, and those files equal the first call's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from streamspec.vllm.peer_training import write_hidden_states

    rows = [{"input_ids": torch.tensor([1, 5, 9, 13, 2])}, {"input_ids": torch.tensor([3, 4, 6])},
            {"input_ids": torch.tensor([7, 8, 10, 11])}]
    folder = tmp_path / "hidden_states"
    assert write_hidden_states(str(tiny_dir), rows, [1, 2, 3], folder, progress=False) == 12
    first = {i: load_file(str(folder / f"hs_{i}.safetensors")) for i in range(3)}
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.model(input_ids=rows[0]["input_ids"][None], output_hidden_states=True)
    assert first[0]["hidden_states"].shape == (5, 4, 64) and first[0]["token_ids"].tolist() == [1, 5, 9, 13, 2]
    for slot, layer in enumerate([1, 2, 3]):
        torch.testing.assert_close(first[0]["hidden_states"][:, slot], out.hidden_states[layer][0])
    (folder / "hs_1.safetensors").unlink()  # a run stopped before row 1 was written
    assert write_hidden_states(str(tiny_dir), rows, [1, 2, 3], folder, progress=False) == 3  # row 1 only
    assert sorted(p.name for p in folder.iterdir()) == [f"hs_{i}.safetensors" for i in range(3)]
    for i in range(3):
        again = load_file(str(folder / f"hs_{i}.safetensors"))
        assert torch.equal(again["hidden_states"], first[i]["hidden_states"])
    assert write_hidden_states(str(tiny_dir), rows, [1, 2, 3], folder, progress=False) == 0
