"""`streamspec export --format vllm`: the drafter folder vLLM loads, and what it refuses. No vLLM
needed here (tests/vllm/test_vllm_drafter.py runs the folders in vLLM)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from streamspec import StreamConfig, add_streams
from streamspec.cli import main
from streamspec.patch.saving import CheckpointError
from streamspec.patch.stream_modules import stream_modules_taken_out
from streamspec.vllm import ARCHITECTURES
from streamspec.vllm.export import check_drafter_folder, export_for_vllm, streams_parameters
from streamspec.vllm.format import check_target

from conftest import make_config

LOSSLESS = dict(mode="lossless", num_streams=3, stream_layers=2, stream_adapter_rank=4, main_weight=0.0)


def streamed_checkpoint(tmp_path, arch: str, seed: int = 0, **config) -> tuple:
    """A tiny base saved as a folder and a streamed checkpoint of it with random (non-zero) stream
    weights; returns (base folder, checkpoint folder, the streamed model)."""
    torch.manual_seed(seed)
    base_dir, ckpt = tmp_path / f"{arch}-base", tmp_path / f"{arch}-streams"
    AutoModelForCausalLM.from_config(make_config(arch)).save_pretrained(base_dir)
    model = add_streams(AutoModelForCausalLM.from_pretrained(base_dir).eval(), StreamConfig(**{**LOSSLESS, **config}))
    with torch.no_grad():
        for p in model.streams.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(ckpt)
    return base_dir, ckpt, model


def drafting_parameters(model) -> int:
    """The streams' parameters a drafter runs: all but the early-exit head, which only trains."""
    return sum(p.numel() for n, p in model.streams.named_parameters() if not n.startswith("exit_"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_export_writes_the_top_layers_norm_streams_and_adapters(tmp_path, arch):
    _, ckpt, model = streamed_checkpoint(tmp_path, arch)
    out = export_for_vllm(ckpt, tmp_path / "drafter", layout="peagle")
    config = check_drafter_folder(out)
    facts = config["streamspec"]
    hf = model.hf_model.config
    assert config["architectures"] == [ARCHITECTURES[arch]]
    assert config["num_hidden_layers"] == 2 and facts["num_hidden_layers"] == hf.num_hidden_layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [hf.num_hidden_layers - 2] == [facts["first_layer"]]
    assert facts["num_streams"] == 3 and facts["num_speculative_tokens"] == 4 and facts["stream_adapter_rank"] == 4
    assert 0 <= config["mask_token_id"] < hf.vocab_size
    tensors = load_file(str(out / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in tensors)  # vLLM shares the served model's
    with stream_modules_taken_out(model.hf_model):
        for i, layer in enumerate(model.layers[-2:]):
            for name, value in layer.state_dict().items():
                assert torch.equal(tensors[f"layers.{i}.{name}"], value), name
    assert torch.equal(tensors["stream_vectors"], model.streams.stream_embeddings)
    pair = model.streams.adapters.layers[1]["self_attn-q_proj"]
    assert torch.equal(tensors["adapters.1.self_attn-q_proj.up"], pair.up.weight)
    assert torch.equal(tensors["norm.weight"], model.decoder.norm.weight)
    assert streams_parameters(out) == drafting_parameters(model)


def test_export_refuses_what_the_vllm_drafter_cannot_run(tmp_path):
    _, shared, _ = streamed_checkpoint(tmp_path, "llama", mode="shared", stream_adapter_rank=None, main_weight=1.0)
    with pytest.raises(CheckpointError, match="only lossless checkpoints"):
        export_for_vllm(shared, tmp_path / "a")
    _, gpt2, _ = streamed_checkpoint(tmp_path, "gpt2")
    with pytest.raises(CheckpointError, match="'gpt2'"):
        export_for_vllm(gpt2, tmp_path / "b")
    _, rotation, _ = streamed_checkpoint(tmp_path, "qwen2", stream_init="value_rotation")
    with pytest.raises(CheckpointError, match="value_rotation"):
        export_for_vllm(rotation, tmp_path / "c")
    assert not any((tmp_path / d).exists() for d in "abc")


def test_a_folder_missing_its_tensors_is_refused(tmp_path):
    _, ckpt, _ = streamed_checkpoint(tmp_path, "llama")
    out = export_for_vllm(ckpt, tmp_path / "drafter")
    tensors = load_file(str(out / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({k: v for k, v in tensors.items() if not k.startswith("layers.1.")}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="layers"):
        check_drafter_folder(out)


def test_the_drafter_refuses_a_served_model_of_another_shape(tmp_path):
    _, ckpt, _ = streamed_checkpoint(tmp_path, "llama")
    facts = json.loads((export_for_vllm(ckpt, tmp_path / "d") / "config.json").read_text())["streamspec"]
    config = make_config("llama")
    check_target(facts, config, config.num_hidden_layers)  # its own base: accepted
    with pytest.raises(ValueError, match="num_hidden_layers: drafter 4, served 6"):
        check_target(facts, config, 6)
    config.hidden_size = 48
    with pytest.raises(ValueError, match="hidden_size"):
        check_target(facts, config, 4)


def test_export_command(tmp_path, capsys):
    _, ckpt, _ = streamed_checkpoint(tmp_path, "mistral")
    assert main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--out", str(tmp_path / "v")]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "v")  # the default layout: DFlash, γ drafts
    assert '"method": "dflash"' in captured.err and '"num_speculative_tokens": 3' in captured.err
    assert main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--layout", "peagle", "--out",
                 str(tmp_path / "p")]) == 0
    captured = capsys.readouterr()
    assert '"method": "eagle3"' in captured.err and '"parallel_drafting": true' in captured.err
    assert '"num_speculative_tokens": 4' in captured.err
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(ckpt), "--layout", "dflash", "--out", str(tmp_path / "s")])
    assert "--layout is the vLLM drafter's draft layout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--merge", "--out", str(tmp_path / "w")])
    assert "--merge" in capsys.readouterr().err


def test_the_vllm_rows_become_a_docs_result_file(tmp_path):
    from streamspec.evaluation.results import load_result, render_table
    from streamspec.evaluation.vllm_peers import result_table

    def row(tps, concurrency, acceptance, identical=True):
        return {"tokens_per_second": tps, "concurrency": concurrency, "mean_acceptance_length": acceptance,
                "identical_to_vllm": identical, "identical_to_baseline": identical}

    summary = {"baseline": {"tokens_per_second": 20.0}, "vllm": row(20.0, 1, None), "vllm_streams": row(25.0, 1, 2.0),
               "vllm@8": row(80.0, 8, None), "vllm_streams@8": row(40.0, 8, 2.0, identical=False)}
    table = result_table(summary, title="t", command="c", machine="m", threads=1, date="2026-12-04")
    assert [(r["method"], r["concurrency"], r["x_vllm"]) for r in table["rows"]] == [
        ("vllm", 1, 1.0), ("vllm_streams", 1, 1.25), ("vllm", 8, 1.0), ("vllm_streams", 8, 0.5)]
    (tmp_path / "v.json").write_text(json.dumps(table))
    text = render_table(load_result(tmp_path / "v.json"))
    assert "| vllm_streams | 8 | 40.0 | 0.50× | 2.00 | no |" in text
    # with what vLLM counts per draft position and what a trained drafter cost: two more columns
    summary["vllm_streams"].update(acceptance_per_position=[0.6, 0.3, 0.1], draft_parameters=2616000)
    table = result_table(summary, title="t", command="c", machine="m", threads=1, date="2026-12-04",
                         plot_positions="v")
    assert [c["key"] for c in table["columns"]] == ["method", "concurrency", "tokens_per_second", "x_vllm",
                                                   "mean_acceptance_length", "acceptance_per_position",
                                                   "draft_parameters", "identical"]
    (tmp_path / "v.json").write_text(json.dumps(table))
    assert "| vllm_streams | 1 | 25.0 | 1.25× | 2.00 | 0.60 / 0.30 / 0.10 | 2,616,000 | yes |" in render_table(
        load_result(tmp_path / "v.json"))
    from streamspec.evaluation.results import write_figures

    assert [p.name for p in write_figures({"v": load_result(tmp_path / "v.json")}, tmp_path / "figures")] == [
        "v_acceptance_per_position.png"]
    with pytest.raises(ValueError, match="no vLLM rows"):
        result_table({"baseline": {"tokens_per_second": 1.0}})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_dflash_layout_folder(tmp_path, arch):
    """``--layout dflash``: the same tensors as the P-EAGLE folder; vLLM's dflash method, the
    target's states entering every copied layer, causal query rows, γ drafts a step."""
    from streamspec.vllm import DFLASH_ARCHITECTURES
    from streamspec.vllm.export import serve_command
    from streamspec.vllm.run import speculative_config

    _, ckpt, model = streamed_checkpoint(tmp_path, arch)
    peagle = export_for_vllm(ckpt, tmp_path / "peagle", layout="peagle")
    dflash = export_for_vllm(ckpt, tmp_path / "dflash", layout="dflash")
    config, facts = check_drafter_folder(dflash), check_drafter_folder(peagle)["streamspec"]
    assert config["architectures"] == [DFLASH_ARCHITECTURES[arch]] != [ARCHITECTURES[arch]]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3] and facts["first_layer"] == 2
    assert config["dflash_config"] == {"mask_token_id": config["mask_token_id"], "causal": True}
    assert config["streamspec"]["layout"] == "dflash" and facts["layout"] == "peagle"
    assert config["streamspec"]["num_speculative_tokens"] == 3 and facts["num_speculative_tokens"] == 4
    ours, theirs = load_file(str(dflash / "model.safetensors")), load_file(str(peagle / "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    run = speculative_config({"drafter": "streams", "folder": str(dflash)})
    assert run["method"] == "dflash" and run["num_speculative_tokens"] == 3
    # the DFlash layout reads cached prompt blocks as plain decoding does (`streams_speculative_config`), unless a run asks
    assert run["disable_eagle_block_drop"] is True
    assert not speculative_config({"drafter": "streams", "folder": str(dflash), "block_drop": True})[
        "disable_eagle_block_drop"]
    other = speculative_config({"drafter": "streams", "folder": str(peagle)})
    assert other["method"] == "eagle3" and "disable_eagle_block_drop" not in other
    assert '"method": "dflash"' in serve_command(dflash) and "parallel_drafting" not in serve_command(dflash)
    assert '"disable_eagle_block_drop": true' in serve_command(dflash)
    assert "disable_eagle_block_drop" not in serve_command(peagle)
    with pytest.raises(ValueError, match="layout must be one of peagle, dflash, got 'eagle'"):
        export_for_vllm(ckpt, tmp_path / "x", layout="eagle")
    assert not (tmp_path / "x").exists()


def test_streams_that_read_the_next_token_export_their_map_in_the_dflash_layout(tmp_path):
    """``next_token_input`` streams: the DFlash folder also holds the map W and says so; a folder
    whose map and config disagree is refused, and so is the P-EAGLE layout (its drafter is not
    handed the next token)."""
    from safetensors.torch import save_file

    _, ckpt, model = streamed_checkpoint(tmp_path, "llama", next_token_input=True)
    out = export_for_vllm(ckpt, tmp_path / "dflash", layout="dflash")
    facts = check_drafter_folder(out)["streamspec"]
    assert facts["next_token_input"] is True
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["next_token_map.weight"], model.streams.next_token_map.weight)
    assert streams_parameters(out) == drafting_parameters(model)
    assert not check_drafter_folder(export_for_vllm(streamed_checkpoint(tmp_path / "plain", "llama")[1],
                                                    tmp_path / "plain-dflash"))["streamspec"]["next_token_input"]
    with pytest.raises(CheckpointError, match="--layout dflash"):
        export_for_vllm(ckpt, tmp_path / "peagle", layout="peagle")
    assert not (tmp_path / "peagle").exists()
    save_file({k: v for k, v in tensors.items() if k != "next_token_map.weight"}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="next_token_input=True but the next_token_map tensor is missing"):
        check_drafter_folder(out)


def test_a_folder_served_with_the_other_layouts_method_is_refused():
    """vLLM names a folder's class by the method it was started with (a DFlash folder under
    ``"method": "eagle3"`` becomes ``Eagle3DFlash…``): that class refuses the folder, naming the
    method it needs."""
    from streamspec.vllm import _CLASSES
    from streamspec.vllm.format import check_folder_layout

    assert _CLASSES["Eagle3DFlashLlamaStreamsDrafter"] == _CLASSES["Eagle3LlamaStreamsDrafter"]
    assert _CLASSES["DFlashEagle3Qwen2StreamsDrafter"] == _CLASSES["DFlashQwen2StreamsDrafter"]
    check_folder_layout({"layout": "dflash"}, "dflash")
    check_folder_layout({}, "peagle")  # folders exported before layouts existed
    with pytest.raises(ValueError, match='runs with "method": "dflash"; it was started with "method": "eagle3"'):
        check_folder_layout({"layout": "dflash"}, "peagle")
    with pytest.raises(ValueError, match='runs with "method": "eagle3"'):
        check_folder_layout({}, "dflash")


def test_the_layout_comparison_rows():
    """`eval/vllm_layouts.py`'s rows: tokens/s over the rounds against plain vLLM at the same
    concurrency, acceptance per draft position over vLLM's drafts, identical outputs."""
    from streamspec.evaluation.vllm_layouts import layout_rows, layout_runs
    from streamspec.vllm.run import PER_POSITION

    runs = layout_runs({"peagle": "P", "dflash": "D"}, concurrency=(1, 8), rounds=2)
    assert [(r["layout"], r["concurrency"], r["round"]) for r in runs[:6]] == [
        ("none", 1, 0), ("none", 8, 0), ("peagle", 1, 0), ("peagle", 8, 0), ("dflash", 1, 0), ("dflash", 8, 0)]
    assert runs[2]["folder"] == "P" and len(runs) == 12

    def result(run):
        k = {"none": None, "peagle": 4, "dflash": 3}[run["layout"]]
        seconds = {"none": 10.0, "peagle": 8.0, "dflash": 5.0}[run["layout"]] * (1 + run["round"])
        counters = {} if k is None else {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens": 12,
                                         PER_POSITION: [6, 4, 2, 0][:k]}
        return {"tokens": 100, "seconds": seconds, "tokens_per_s": 100 / seconds, "num_speculative_tokens": k,
                "counters": counters,
                "outputs": [[1, 2]] if run["layout"] != "dflash" or run["concurrency"] == 1 else [[1, 3]]}

    rows = {(r["layout"], r["concurrency"]): r for r in layout_rows(runs, [result(r) for r in runs])}
    assert rows[("none", 1)]["x_vllm"] == 1.0 and rows[("none", 1)]["mean_acceptance_length"] is None
    assert rows[("dflash", 1)]["tokens_per_second"] == pytest.approx(200 / 15, abs=0.01)
    assert rows[("dflash", 1)]["tokens_per_second_by_round"] == [20.0, 10.0]
    assert rows[("dflash", 1)]["x_vllm"] == 2.0 and rows[("peagle", 8)]["x_vllm"] == 1.25
    assert rows[("peagle", 1)]["mean_acceptance_length"] == 2.2
    assert rows[("peagle", 1)]["acceptance_per_position"] == [0.6, 0.4, 0.2, 0.0]
    assert rows[("dflash", 8)]["acceptance_per_position"] == [0.6, 0.4, 0.2]
    assert rows[("dflash", 1)]["identical"] and not rows[("dflash", 8)]["identical"]
    with pytest.raises(ValueError, match="no plain vLLM run at concurrency 1 to compare the .peagle. rows"):
        layout_rows(runs[2:4], [result(r) for r in runs[2:4]])


def test_the_acceptance_comparison_rows():
    """`eval/vllm_acceptance.py`: checkpoints named on the command line, plain vLLM first at every
    concurrency, each row against plain at its own concurrency, outputs compared with plain's."""
    from streamspec.evaluation.vllm_acceptance import (acceptance_rows, acceptance_runs, acceptance_table,
                                                       lookup_row_name, named_checkpoints)

    checkpoints = named_checkpoints(["a=runs/x/final", "streamspec:smollm2-135m-sql-streams"])
    assert checkpoints == {"a": "runs/x/final", "streamspec:smollm2-135m-sql-streams": "streamspec:smollm2-135m-sql-streams"}
    for bad, match in ((["a=x", "a=y"], "'a' is taken"), (["vllm=x"], "'vllm' is taken"), (["a+b=x"], "without '\\+'"),
                       (["=x"], "NAME=CHECKPOINT")):
        with pytest.raises(ValueError, match=match):
            named_checkpoints(bad)
    runs = acceptance_runs({"a": "A"}, (1, 8))
    assert [(r["name"], r["concurrency"], r.get("folder")) for r in runs] == [
        ("vllm", 1, None), ("vllm", 8, None), ("a", 1, "A"), ("a", 8, "A")]
    results = [{**r, "tokens_per_s": {1: 10.0, 8: 40.0}[r["concurrency"]] * (1.5 if r["name"] == "a" else 1),
                "outputs": [[1, 2]] if r["concurrency"] == 1 or r["name"] == "vllm" else [[1, 3]],
                **({"mean_acceptance_length": 2.0, "acceptance_per_position": [0.6, 0.3, 0.1]} if r["name"] == "a" else {})}
               for r in runs]
    rows = acceptance_rows(results, {"a": "A"})
    assert [(r["name"], r["x_vllm"], r["identical"]) for r in rows] == [
        ("vllm", 1.0, True), ("vllm", 1.0, True), ("a", 1.5, True), ("a", 1.5, False)]
    assert rows[2]["checkpoint"] == "A" and rows[0]["mean_acceptance_length"] is None
    table = acceptance_table(rows)
    assert "| a | 1 | 15.0 | 1.50× | 2.000 | 60.0% / 30.0% / 10.0% | yes |" in table and "| NO |" in table
    # vLLM's lookup drafters beside them, after plain; a checkpoint's +lookup row names its checkpoint
    # (with K drafts a step asked for, its own row)
    assert lookup_row_name("a", None) == "a+lookup" and lookup_row_name("a", 4) == "a+lookup+K4"
    # suffix decoding's drafts merged: their own rows (+suffix0 for suffix:0, no global tree)
    assert lookup_row_name("a", None, "suffix") == "a+suffix" and lookup_row_name("a", 5, "suffix:0") == "a+suffix0+K5"
    runs = acceptance_runs({"a": "A", "a+lookup": "AL", "a+lookup+K4": "AL4", "a+suffix0+K5": "AS5"}, (1,),
                           ("ngram", "suffix"))
    assert [(r["name"], r["drafter"]) for r in runs] == [
        ("vllm", "none"), ("vllm_ngram", "ngram"), ("vllm_suffix", "suffix"), ("a", "streams"), ("a+lookup", "streams"),
        ("a+lookup+K4", "streams"), ("a+suffix0+K5", "streams")]
    assert runs[1]["num_speculative_tokens"] == runs[1]["prompt_lookup_max"] == 4
    results = [{**r, "tokens_per_s": 10.0, "outputs": [[1]]} for r in runs]
    assert [r["checkpoint"] for r in acceptance_rows(results, {"a": "A"})] == [None, None, None, "A", "A", "A", "A"]
    with pytest.raises(ValueError, match="choose among"):
        acceptance_runs({}, (1,), ("eagle",))
    # trained peers (speculators' folders) after vLLM's lookup drafters, before the streams
    runs = acceptance_runs({"a": "A"}, (1, 8), ("ngram",), {"eagle3": "E", "peagle": "P"})
    assert [(r["name"], r["drafter"], r.get("folder"), r["concurrency"]) for r in runs] == [
        ("vllm", "none", None, 1), ("vllm", "none", None, 8), ("vllm_ngram", "ngram", None, 1),
        ("vllm_ngram", "ngram", None, 8), ("vllm_eagle3", "eagle3", "E", 1), ("vllm_eagle3", "eagle3", "E", 8),
        ("vllm_peagle", "peagle", "P", 1), ("vllm_peagle", "peagle", "P", 8), ("a", "streams", "A", 1),
        ("a", "streams", "A", 8)]
    with pytest.raises(ValueError, match="trained drafters \\['medusa'\\]: choose among"):
        acceptance_runs({}, (1,), (), {"medusa": "M"})


def test_a_draft_vocabulary_variant_is_its_own_row():
    from streamspec.evaluation.vllm_layouts import layout_rows, layout_runs, variant_key, variant_label

    key = variant_key("dflash", 8192)
    assert variant_key("dflash") == "dflash" and key != "dflash"
    assert variant_label(key) == "streams, DFlash layout, 8,192-id draft vocabulary"
    assert variant_label("dflash") == "streams, DFlash layout" and variant_label("none") == "vLLM plain"
    runs = layout_runs({"dflash": "D", key: "V"}, concurrency=(1,))
    assert [(r["layout"], r.get("folder")) for r in runs] == [("none", None), ("dflash", "D"), (key, "V")]
    result = {"tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0, "num_speculative_tokens": 3, "outputs": [[1]],
              "counters": {"vllm:spec_decode_num_drafts": 2, "vllm:spec_decode_num_accepted_tokens": 2}}
    rows = layout_rows(runs, [result] * 3)
    assert [r["row"] for r in rows] == ["vLLM plain", "streams, DFlash layout", variant_label(key)]


def _distilled(path, completions):
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": "x", "completion_ids": ids}) + "\n"
                            for i, ids in enumerate(completions)))
    return path


def test_the_draft_vocabulary_is_the_ids_the_model_writes_most(tmp_path):
    from streamspec.vllm.export import draft_vocabulary

    one = _distilled(tmp_path / "a.jsonl", [[5, 5, 9, 2], [7, 5, 2]])
    two = _distilled(tmp_path / "b.jsonl", [[9, 9, 2, 11]])
    # counts: 5×3, 9×3, 2×3, 7×1, 11×1; ties go to the lower id; ascending
    assert draft_vocabulary([one, two], 3, 16).tolist() == [2, 5, 9]
    assert draft_vocabulary([one, two], 4, 16).tolist() == [2, 5, 7, 9]
    assert draft_vocabulary([one], 2, 16).tolist() == [2, 5]
    with pytest.raises(ValueError, match=r"1\.\.15 ids"):
        draft_vocabulary([one], 16, 16)
    with pytest.raises(ValueError, match="name distilled sets"):
        draft_vocabulary([], 4, 16)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        draft_vocabulary([_distilled(tmp_path / "c.jsonl", [[3, 40]])], 4, 16)
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "q", "completion": "SELECT"}) + "\n")
    with pytest.raises(ValueError, match="without completion_ids"):
        draft_vocabulary([tmp_path / "d.jsonl"], 4, 16)


def test_a_pruned_draft_vocabulary_is_written_and_checked(tmp_path, capsys):
    from safetensors.torch import save_file

    _, ckpt, model = streamed_checkpoint(tmp_path, "llama")
    vocab = model.hf_model.config.vocab_size
    text = _distilled(tmp_path / "text.jsonl", [[i % 40 + 3 for i in range(200)], [vocab - 1] * 50])
    out = tmp_path / "pruned"
    assert main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--out", str(out), "--draft-vocab", "8",
                 "--draft-vocab-from", str(text)]) == 0
    config = check_drafter_folder(out)
    tensors = load_file(str(out / "model.safetensors"))
    assert config["streamspec"]["draft_vocab_size"] == 8
    assert tensors["draft_vocab"].tolist() == [3, 4, 5, 6, 7, 8, 9, vocab - 1]  # 50× the last id; 5× each of 3..42
    plain = load_file(str(export_for_vllm(ckpt, tmp_path / "plain") / "model.safetensors"))
    assert "draft_vocab" not in plain and plain.keys() == tensors.keys() - {"draft_vocab"}
    # `streamspec eval --vllm-streams FOLDER` takes such a folder for the streams rows
    from types import SimpleNamespace

    from streamspec.evaluation.vllm_peers import vllm_options

    options = vllm_options(SimpleNamespace(vllm_concurrency=[1], vllm_schedule=None, vllm_streams=str(out)))
    assert options == {"concurrency": (1,), "streams_folder": str(out)}
    # a folder whose ids do not match its size, or are not ascending, is refused
    save_file({**tensors, "draft_vocab": tensors["draft_vocab"][:4]}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_vocab_size=8"):
        check_drafter_folder(out)
    save_file({**tensors, "draft_vocab": tensors["draft_vocab"].flip(0)}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="ascending"):
        check_drafter_folder(out)
    for wrong in (["--draft-vocab", "8"], ["--draft-vocab-from", str(text)]):
        with pytest.raises(SystemExit):
            main(["export", "--checkpoint", str(ckpt), "--format", "vllm", "--out", str(tmp_path / "x"), *wrong])
        assert "go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "y"), "--draft-vocab", "8",
              "--draft-vocab-from", str(text)])
    assert "goes with --format vllm" in capsys.readouterr().err
