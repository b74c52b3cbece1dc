"""Stream rows through bfloat16 copies of the MSA layers' linear layers
(`StreamedModel.use_bf16_stream_rows`, `streamspec.kernels.LowPrecisionRows`): the main rows' bits
are those of the float32 model, the stream rows are float32's up to bf16 rounding, the tokens a
float32 model decodes are its own (eager and compiled), the copies are never saved, follow the
weights, and apply only where streamspec's bf16 kernels run on a float32 model."""

from __future__ import annotations

import pytest
import torch

from conftest import packed_streamed_model, random_ids
from streamspec import StreamConfig, add_streams, native
from streamspec.decoding import generate, generate_autoregressive
from streamspec.kernels import PackedLinear, packed_dtypes
from streamspec.loading import load_for_inference

pytestmark = pytest.mark.skipif(not native.cpu_has_avx512_bf16() or torch.bfloat16 not in packed_dtypes(),
                                reason="streamspec's bf16 kernels do not run on this CPU")

# with stream adapters (stream modules in the MSA layers, which pass the row split on) and without
CONFIGS = {"adapters": dict(stream_adapter_rank=4), "plain": {}}


def _pass(model, ids):
    """One pass over `ids` with streams at every position: (main, streams) hidden states."""
    n = ids.shape[1]
    positions = torch.arange(n)[None]
    main_ok = torch.ones(1, n, n, dtype=torch.bool).tril()
    with torch.no_grad():
        return model.step(ids, positions, main_ok, torch.arange(n)[None])


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_main_rows_keep_their_bits_and_stream_rows_are_bf16_close(kind):
    model = packed_streamed_model(**CONFIGS[kind])
    ids = random_ids(1, 9, seed=1)
    main, streams = _pass(model, ids)
    keys = set(model.state_dict())
    assert model.use_bf16_stream_rows()
    assert set(model.state_dict()) == keys  # the copies are not saved with the model
    low_main, low_streams = _pass(model, ids)
    assert torch.equal(low_main, main)  # main rows: float32, computed row by row as before
    assert low_streams.dtype == torch.float32 and not torch.equal(low_streams, streams)
    torch.testing.assert_close(low_streams, streams, rtol=0.05, atol=0.05)
    assert not model.use_bf16_stream_rows(False)
    assert torch.equal(_pass(model, ids)[1], streams)  # off: float32 again


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_bf16_stream_rows_decode_the_models_own_tokens(kind):
    model = packed_streamed_model(**CONFIGS[kind])
    ids = random_ids(1, 12, seed=3)
    reference = generate_autoregressive(model, ids, 40).tolist()
    assert model.use_bf16_stream_rows()
    for options in (dict(tree_top_k=(2, 1, 1)), dict(tree_top_k=1), dict(tree_top_k=3, tree_budget=7)):
        assert generate(model, ids, 40, **options).tokens.tolist() == reference, options
    compiled = generate(model, ids, 40, tree_top_k=(2, 1, 1), compile="aot_eager")
    assert compiled.tokens.tolist() == reference
    assert compiled.accepted_per_pass == generate(model, ids, 40, tree_top_k=(2, 1, 1)).accepted_per_pass


def test_a_compiled_pass_tells_a_split_layer_from_a_plain_one():
    """The split is read through an attribute compiled graphs guard on: the same function over a
    model with the bf16 rows and one without gives each its own outputs, never the other's graph."""
    with_rows, without = packed_streamed_model(), packed_streamed_model()
    assert with_rows.use_bf16_stream_rows()
    ids = random_ids(1, 9, seed=4)
    step = torch.compile(_pass, backend="aot_eager", fullgraph=True, dynamic=False)
    plain = step(without, ids)[1]
    split = step(with_rows, ids)[1]
    assert torch.equal(plain, _pass(without, ids)[1])
    assert torch.equal(split, _pass(with_rows, ids)[1])
    assert not torch.equal(split, plain)


def test_the_copies_follow_the_weights_and_apply_only_to_float32():
    model = packed_streamed_model()
    assert model.use_bf16_stream_rows()
    ids = random_ids(1, 9, seed=2)
    linear = next(m for m in model.layers[-1].modules() if type(m) is PackedLinear)
    with torch.no_grad():
        linear.weight.mul_(2.0)  # changed in place: copied again at the next eager call
        low = _pass(model, ids)[1]
        model.use_bf16_stream_rows(False)
        exact = _pass(model, ids)[1]
    assert not torch.equal(low, exact)
    torch.testing.assert_close(low, exact, rtol=0.05, atol=0.05)
    half = packed_streamed_model().to(torch.bfloat16)
    assert not half.use_bf16_stream_rows()  # a bf16 model's stream rows are bf16 already
    assert not packed_streamed_model("gpt2").use_bf16_stream_rows()  # GPT-2's Conv1D layers are not packed
    assert not packed_streamed_model(mode="shared").use_bf16_stream_rows()  # its main stream sees the streams
    cast = packed_streamed_model()
    assert cast.use_bf16_stream_rows()
    cast.to(torch.bfloat16)  # the weights cast after the split was made: every row in bf16, no copy used
    main, streams = _pass(cast, ids.clone())
    assert main.dtype == streams.dtype == torch.bfloat16


def test_load_for_inference_runs_stream_rows_in_bf16_for_float32_on_the_cpu(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa")
    streamed = add_streams(base, StreamConfig(stream_layers=2, mode="lossless"))
    streamed.save_pretrained(tmp_path / "ckpt", tokenizer=load_for_inference(tiny_dir, cpu_kernels=False).tokenizer)

    def split(**options) -> int:
        model = load_for_inference(tmp_path / "ckpt", **options).model
        return sum(getattr(m, "_streamspec_low_rows", None) is not None for m in model.modules())

    assert split(dtype="float32") == 2 * 7  # every linear of the 2 MSA layers
    assert split(dtype="float32", bf16_stream_rows=False) == 0
    assert split(dtype="bfloat16") == 0
    assert split(dtype="float32", cpu_kernels=False) == 0


def test_turning_the_bf16_copies_on_announces_a_graph_of_their_own(capfd):
    """A compiled loop's graph includes the bf16 copies a float32 model drafts through: turning
    them on traces a new graph, announced as such, and the tokens stay the model's own."""
    model = packed_streamed_model()
    ids = random_ids(1, 12, seed=5)
    reference = generate_autoregressive(model, ids, 16).tolist()

    def compiled() -> str:
        assert generate(model, ids, 16, tree_top_k=1, compile="aot_eager").tokens.tolist() == reference
        return capfd.readouterr().err

    assert "compiling the decode step" in compiled()
    assert "compiling the decode step" not in compiled()  # the same graph again
    assert model.use_bf16_stream_rows()
    assert "compiling the decode step" in compiled()
    assert model.use_bf16_draft_head()
    assert "compiling the decode step" in compiled()
    assert "compiling the decode step" not in compiled()
