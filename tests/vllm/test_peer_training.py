"""Peer drafters trained by speculators (in vLLM's environment) with the target's hidden states
computed as training reads each row ("online": no files) train the same drafter as with the hidden
states written first: the same rows, the same states, the same steps, so the same weights."""

from __future__ import annotations

import pytest
import torch

from streamspec.evaluation.peer_drafters import train_peer_drafter
from streamspec.vllm.client import VLLMRunError, vllm_python

try:
    vllm_python()
except FileNotFoundError as err:  # `make vllm` not run: `make test` runs it first
    pytest.skip(str(err), allow_module_level=True)


def test_online_hidden_states_train_the_drafter_the_files_train(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(0)
    examples = []
    for prompt, completion in ((9, 12), (14, 8), (6, 15), (11, 10), (7, 9), (12, 11)):
        ids = torch.randint(3, 512, (prompt + completion,), generator=gen).tolist()
        examples.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * completion})
    common = dict(method="eagle3", epochs=2, max_steps=3, total_seq_len=64, draft_vocab_size=128,
                  train_data_ratio=0.75, threads=1)
    try:
        files = train_peer_drafter(str(tiny_dir), examples, tmp_path / "files", work=tmp_path / "work-files",
                                   keep_hidden_states=True, **common)
        # a file lost after the set was complete (a copied work folder): written again, the rest reused
        (tmp_path / "work-files" / "data" / "hidden_states" / "hs_2.safetensors").unlink()
        again_files = train_peer_drafter(str(tiny_dir), examples, tmp_path / "files-again", work=tmp_path / "work-files",
                                         **common)
        online = train_peer_drafter(str(tiny_dir), examples, tmp_path / "online", work=tmp_path / "work-online",
                                    hidden_states="online", **common)
    except VLLMRunError as err:
        pytest.fail(str(err)[-3000:])
    assert files["hidden_states"] == "files" and files["hidden_state_tokens"] == sum(len(e["input_ids"]) for e in examples)
    assert online["hidden_states"] == "online" and online["hidden_state_tokens"] == 0
    assert not (tmp_path / "work-online" / "data" / "hidden_states").exists()  # nothing written
    assert again_files["hidden_state_tokens"] == len(examples[2]["input_ids"]) and not again_files["hidden_states_reused"]
    assert files["steps"] == online["steps"] == 3 and files["tokens_seen"] == online["tokens_seen"] > 0
    trained, again = load_file(str(tmp_path / "files" / "model.safetensors")), load_file(str(tmp_path / "online" / "model.safetensors"))
    assert trained.keys() == again.keys()
    rewritten = load_file(str(tmp_path / "files-again" / "model.safetensors"))
    for name, tensor in trained.items():
        assert torch.equal(tensor, again[name]), name
        assert torch.equal(tensor, rewritten[name]), name
