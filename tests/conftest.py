"""Shared helpers: tiny, randomly initialised causal LMs of every supported architecture.

Everything is built from a config (no download) and is small enough that a forward pass takes
milliseconds on a CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from streamspec import load_default_tokenizer
from streamspec.patch.layout import position_ids_from_mask

pytest_plugins = ["pytester"]  # tests/top/test_suite_budget.py runs small suites of its own

VOCAB = 101
HIDDEN = 32
LAYERS = 4
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 64
MAX_POS = 64

ARCHS = ("llama", "qwen2", "mistral", "gpt2")

# LoRA target modules per architecture (attention projections).
LORA_TARGETS = {
    "llama": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
}


def make_config(arch: str, attn_implementation: str = "sdpa"):
    """A tiny transformers config of the given architecture family."""
    llama_like = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POS,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        config = LlamaConfig(**llama_like)
    elif arch == "qwen2":
        config = Qwen2Config(use_sliding_window=False, **llama_like)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=None, **llama_like)
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=INTERMEDIATE,
            n_positions=MAX_POS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    else:  # pragma: no cover - misuse of the helper
        raise KeyError(arch)
    return config


def make_model(arch: str, seed: int = 0, attn_implementation: str = "sdpa"):
    """A tiny randomly initialised causal LM (eval mode, float32) of the given architecture."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch), attn_implementation=attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    return model.float().eval()


def packed_streamed_model(arch: str = "llama", mode: str = "lossless", **config):
    """A tiny streamed model (3 streams, 2 stream layers) whose streams agree with the main stream
    now and then (adapters given a say), its linear layers packed and on the decoding attention."""
    from streamspec import StreamConfig, add_streams
    from streamspec.kernels import pack_linear_layers, use_decode_attention

    torch.manual_seed(0)
    model = add_streams(make_model(arch), StreamConfig(num_streams=3, stream_layers=2, mode=mode, **config)).eval()
    with torch.no_grad():
        model.streams.stream_embeddings.mul_(0.1)
        for p in model.streams.parameters():
            if p.dim() == 2 and not p.any():  # adapters' zero-initialised halves
                p.normal_(0.0, 0.05)
    pack_linear_layers(model)
    use_decode_attention(model)
    return model


def reference_logits(model, input_ids, attention_mask=None):
    """Logits of the unpatched HF model with the position ids streamspec uses."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask.bool()),
        ).logits


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """transformers `generate(do_sample=False)` of an unpatched model: exactly `max_new_tokens` new
    tokens (no EOS), without the prompt."""
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1]:]


def random_ids(batch: int, length: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def within_bf16_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                         unfused: bool = False):
    """`out` is ``x @ w.T + b`` in bf16: float32 sums of K products rounded once to bf16 (2^-8
    relative), or, `unfused` (torch's bf16 `F.linear`, which rounds the product before adding the
    bias), rounded twice, relative to the magnitudes summed."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    if x.numel() == 0:
        return
    if unfused:
        magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0.0)
        rounding = magnitude * 2.0 ** -7
    else:
        rounding = exact.abs() * 2.0 ** -8
    bound = rounding + 1e-6 * x.shape[-1] * (x.double().abs().max() * w.double().abs().max() + 1)
    assert ((out.double() - exact).abs() <= bound).all(), (out.double() - exact).abs().max()


def within_float32_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    assert out.dtype == torch.float32 and out.shape == exact.shape
    if x.numel() == 0:
        return
    # float32 sums of K products: K roundings of at most 2^-24 of the running sum's magnitude
    scale = (x.double().abs() @ w.double().abs().T) + (b.double().abs() if b is not None else 0.0)
    assert ((out.double() - exact).abs() <= scale * x.shape[-1] * 2.0 ** -23 + 1e-30).all()


def within_rounding(out, x, w, b):
    (within_bf16_rounding if out.dtype == torch.bfloat16 else within_float32_rounding)(out, x, w, b)


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return make_model(arch)


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def single_thread():
    """Tiny models run much faster on one intra-op thread (no spin-waiting on a busy second
    core); restored afterwards so tests with real-size models keep every core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved with the SmolLM2 tokenizer (its chat template, its vocabulary)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# The slow tier (`make test` runs everything; `make test-quick` leaves these out): whole modules
# that start servers, compile or load the real SmolLM2 throughout, and single tests that train,
# spawn processes or sample thousands of times. About a quarter of the suite's time each way.
SLOW_MODULES = {"test_smollm2", "test_compile", "test_serving", "test_reason_server", "test_vllm_drafter"}
SLOW_TESTS = {
    "test_speculative_sampling_matches_the_exact_distribution",
    "test_deepspeed_two_processes_train_and_resume_smollm2",
    "test_killed_run_resumes_on_the_same_curve",
    "test_gguf",
    "test_real_small_model_joins_loads_and_matches_its_metadata",
    "test_slurm_template_launches_torchrun_on_every_node_and_resumes_on_requeue",
    "test_demo_trains_exports_and_benchmarks",
    "test_export_command_merges_into_a_self_contained_folder",
    "test_real_model_distilled_set_is_its_greedy_text",
    "test_shipped_streams_export_merged_and_decode_through_custom_generate",
    "test_readme_python_example_and_generate_command_run",
}


#: Seconds one phase of one test (its set-up, with the module's shared fixtures it builds first; its
#: call; its tear-down) may take before it fails as too slow, so that a slow test is caught the day it
#: lands rather than the day the whole suite outgrows CI's time. `STREAMSPEC_TEST_BUDGET` sets
#: another figure (0 turns the check off, e.g. under a debugger).
TEST_BUDGET_SECONDS = 240.0


def test_budget() -> float:
    raw = os.environ.get("STREAMSPEC_TEST_BUDGET", "").strip()
    if not raw:
        return TEST_BUDGET_SECONDS
    try:
        budget = float(raw)
    except ValueError:
        raise pytest.UsageError(f"STREAMSPEC_TEST_BUDGET must be a number of seconds (0: no budget), got {raw!r}") from None
    if budget < 0:
        raise pytest.UsageError(f"STREAMSPEC_TEST_BUDGET must be >= 0 seconds (0: no budget), got {raw!r}")
    return budget


test_budget.__test__ = False  # a helper, not a test


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running tests (real SmolLM2 throughout, servers, DeepSpeed "
                                       "processes, torch.compile); `make test` runs them, `make test-quick` leaves "
                                       "them out (-m 'not slow')")
    config.stash[_BUDGET] = test_budget()


_BUDGET = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase that passed but ran past the budget (`TEST_BUDGET_SECONDS`) is reported failed."""
    outcome = yield
    report = outcome.get_result()
    budget = item.config.stash.get(_BUDGET, TEST_BUDGET_SECONDS)
    if budget and report.passed and call.duration > budget:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: its {call.when} took {call.duration:.1f} s, over the per-test budget of "
                           f"{budget:g} s (tests/conftest.py TEST_BUDGET_SECONDS; STREAMSPEC_TEST_BUDGET overrides "
                           "it): share what is expensive across the module, or move the measurement into eval/")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


class NativeSpy:
    """Stands in for streamspec's kernel module (`streamspec.native._MODULE`), counting the calls
    of its products and attention by name (so a test can assert the kernel, not a fallback, ran)."""

    def __init__(self, module):
        self.module, self.counts = module, {"linear": 0, "decode_attention": 0}

    @property
    def calls(self) -> int:
        return sum(self.counts.values())

    def __getattr__(self, name):
        return getattr(self.module, name)

    def linear(self, *args):
        self.counts["linear"] += 1
        return self.module.linear(*args)

    def decode_attention(self, *args):
        self.counts["decode_attention"] += 1
        return self.module.decode_attention(*args)



def native_op_calls(fn) -> dict[str, int]:
    """Calls of streamspec's C++ dispatcher operators (``streamspec_native::*``) while `fn` runs,
    by kernel ("linear": `linear` and `linear_of`; "decode_attention"), from torch's profiler:
    compiled graphs call them directly, not through the Python module a `NativeSpy` stands in for."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = {"linear": 0, "decode_attention": 0}
    for event in prof.key_averages():
        if event.key.startswith("streamspec_native::"):
            name = event.key.split("::", 1)[1]
            counts["linear" if name.startswith("linear") else name] += event.count
    return counts
