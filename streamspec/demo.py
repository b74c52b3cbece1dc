"""`make demo` / `streamspec demo`: the product's main job end to end, on the default model.

1. `introduce`: SmolLM2-135M-Instruct (offline) with streams: the parameter overhead, that lossless
   mode reproduces the base exactly, and what main and streams predict on a real Spider question.
2. `run_demo`: a short CPU fine-tune with streams on Spider text-to-SQL (the shipped sql.yaml
   recipe, cut to a few steps), the exported streamed checkpoint, then the side-by-side benchmark
   on held-out questions: the table printed and the plots' paths shown.
3. The same benchmark with the stream weights that ship in the package
   (`streamspec.assets.shipped_streams_path`: self-distilled lossless streams for the default
   model): what trained streams give, on held-out questions (the first of them the fine-tune's), with the base model's exact outputs.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .config import StreamConfig
from .data import load_spider, sql_prompt
from .decoding.lookup import PromptLookup
from .patch.layout import position_ids_from_mask
from .patch.model import add_streams


def introduce(example_index: int = 0, device: str = "auto", dtype: str = "auto") -> dict:
    """Print what the streams add to the default model and what they predict; return the numbers.
    The model runs on `device` in `dtype` (see `streamspec.loading`)."""
    from .assets import DEFAULT_MODEL_ID
    from .devices import dtype_name
    from .loading import load_for_inference

    torch.manual_seed(0)
    loaded = load_for_inference(DEFAULT_MODEL_ID, device=device, dtype=dtype, cpu_kernels=False)
    tokenizer, base = loaded.tokenizer, loaded.model
    config = StreamConfig()
    model = add_streams(base, config).eval()
    base_params = sum(p.numel() for p in base.parameters())
    added = model.num_stream_parameters()
    print(f"model: SmolLM2-135M-Instruct ({base_params:,} parameters, {base.config.num_hidden_layers} layers)")
    print(
        f"streams: γ={config.num_streams} in the top Ns={config.stream_layers} layers, mode={config.mode}; "
        f"added parameters: {added:,} ({100 * added / base_params:.4f}% of the base)"
    )

    example = load_spider()[example_index]
    messages = [{"role": "user", "content": sql_prompt(example["schema"], example["question"])}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text += example["query"]  # teacher-force the gold SQL so every position has a known future
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(loaded.device)
    print(f"\nprompt: Spider '{example['db_id']}' — {example['question']!r} ({ids.shape[1]} tokens with the gold SQL)")

    with torch.no_grad():
        out = model(ids)
        lossless = add_streams(base, StreamConfig(mode="lossless")).eval()
        diff = (lossless(ids).logits - base(ids, position_ids=position_ids_from_mask(torch.ones_like(ids, dtype=torch.bool))).logits).abs().max().item()
    print(f"lossless mode: max |logits − base logits| = {diff:.2e} (the base model's outputs, up to {dtype_name(loaded.dtype)} rounding)")

    # Read predictions at the position just before the SQL's 4th token.
    prompt_len = len(tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids)
    t = prompt_len + 2
    show = lambda token_id: repr(tokenizer.decode([int(token_id)]))  # noqa: E731
    print(f"\nat position {t} (after {tokenizer.decode(ids[0, prompt_len:t + 1])!r}):")
    print(f"  main     predicts t+1: {show(out.logits[0, t].argmax())}   (truth {show(ids[0, t + 1])})")
    for j in range(config.num_streams):
        truth = ids[0, t + 2 + j] if t + 2 + j < ids.shape[1] else None
        print(
            f"  stream {j + 1} predicts t+{j + 2}: {show(out.stream_logits[0, t, j].argmax())}   "
            f"(truth {show(truth) if truth is not None else '-'})"
        )
    print(f"  early exit (layer {model.num_lower_layers}) predicts t+1: {show(out.early_exit_logits[0, t].argmax())}")
    print("\nThe streams are untrained here: fine-tuning teaches stream j to predict the token j+1 steps ahead.")
    return {"base_parameters": base_params, "added_parameters": added, "lossless_max_diff": diff}


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m" / "sql.yaml"
# The shipped streams' tree and lookup branches: the settings chosen on validation prompts for them
# (docs/benchmarks.md). One branch of 8 tokens a pass: compiled, two padded sizes (7 and 15 nodes)
# where two branches would add a third (23), another graph to compile and a pass of 23 rows.
SHIPPED_TREE = (2, 1, 1)
SHIPPED_LOOKUP = PromptLookup(8, 1, 3)
# The rows the shipped streams' step leaves out, for the demo's minutes: torch's default kernels
# (docs/benchmarks.md has that row), one token a pass and the fixed (2,1,1) tree alone, each a graph
# of its own to compile (~1 min cold on a CPU; the rows' exactness is checked against `generate` on
# the base instead: identical_to_baseline). The tree still shapes the lookup row; the confidence
# tree, of the same size, is the demo's tree row (docs/benchmarks.md has the fixed tree's figures).
DEMO_SKIPS = ("baseline_default_kernels", "streamed_ar", "tree")
# The few-step fine-tune's benchmark keeps one token a pass, its exactness reference (its streams
# are shared, not lossless: the base's tokens are not its own), and leaves out the fixed tree too.
FINE_TUNE_SKIPS = ("baseline_default_kernels", "tree")


def _show(summary: dict, folder: Path) -> None:
    """Save a benchmark's report (JSON with every column, Markdown, plots) in `folder` and print
    what a user reads of it: tokens/s, speedup, CRR and whether the outputs are identical."""
    if not summary:
        return
    from .evaluation.report import save_report, user_table

    paths = save_report(summary, folder)
    print(user_table(summary))
    print(f"every column (SQL exact match and validity too) in {paths['json']}; plots: {paths['methods']}, "
          f"{paths['histogram']}")


#: `make demo`'s time budget on a 2-core CPU (minutes, installs aside): the fine-tune gets
#: `TRAIN_SHARE` of it, and the shipped streams' questions are sized to what is left (below).
DEMO_MINUTES = 9.0
TRAIN_SHARE = 0.25
#: The shipped streams' step: at most / at least this many questions, whatever the machine.
MAX_QUESTIONS, MIN_QUESTIONS = 8, 3
#: Seconds its compiled rows' first calls take on a 2-core CPU (three graphs, cold caches; untimed in
#: the table but not in the demo's minutes), and its rows' decoding time per question in units of
#: the baseline's (`generate` and prompt lookup at ~1, three stream rows at ~0.6 each).
COMPILE_SECONDS, ROWS_PER_QUESTION = 150.0, 4.0


def shipped_questions(seconds_left: float, baseline_tokens_per_second: float | None, max_new_tokens: int,
                      compiled: bool = True) -> int:
    """How many held-out questions the shipped streams' step can decode in `seconds_left`, read from
    the baseline's speed that the fine-tune's benchmark measured on this machine (`generate`'s
    tokens/s): between `MIN_QUESTIONS` and `MAX_QUESTIONS`."""
    if not baseline_tokens_per_second:
        return MAX_QUESTIONS
    per_question = ROWS_PER_QUESTION * max_new_tokens / baseline_tokens_per_second
    room = seconds_left - (COMPILE_SECONDS if compiled else 0.0)
    return int(min(MAX_QUESTIONS, max(MIN_QUESTIONS, room // per_question)))


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def run_demo(
    steps: int = 8,
    limit: int | None = None,
    out_dir: str | Path = "runs/demo",
    model: str | None = None,
    max_new_tokens: int = 96,
    example_index: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    fine_tune_limit: int = 3,
    compile: bool | str = "auto",
    minutes: float | None = DEMO_MINUTES,
) -> dict:
    """The main job: introduce, fine-tune `steps` steps (validated on 8 held-out examples),
    export, benchmark the export on `fine_tune_limit` held-out questions (it shows the pipeline
    end to end; a few steps barely train the streams), then the shipped streams on `limit`
    questions. Returns both benchmark summaries (``fine_tune``, ``shipped``; files under
    `out_dir`/benchmark and `out_dir`/shipped) and each part's seconds (``seconds``).

    The demo sizes itself to the machine it finds, within `minutes`: the fine-tune (batch 2) stops
    after the step that ends past `TRAIN_SHARE` of the budget (``training.max_minutes``), and
    with `limit` None the shipped streams' questions are as many as the time left allows at the
    speed the fine-tune's benchmark measured (`shipped_questions`). Each part prints its time.

    Args:
        model: another base (a local path or hub id) instead of the default SmolLM2 (the shipped
            streams are for SmolLM2: that step is then skipped).
        device / dtype: where and in what precision the introduction and the benchmark run
            (`streamspec.loading`); the fine-tune runs where the Trainer puts it.
        minutes: the budget above; None: no budget (every step, `MAX_QUESTIONS` questions).
        compile: how the shipped streams' rows decode (`DecodeConfig.compile`: ``"auto"``, compiled
            where `streamspec.decoding.config.compile_pays` says it is faster, as every command
            decodes; True, False or a backend). Their graphs' first calls compile (announced on
            stderr, ~1 min each on a CPU; a later run reads inductor's cache) in an untimed
            warm-up. The few-step fine-tune's rows decode eager: three questions would not repay
            a compile.
    """
    from .decoding.config import DecodeConfig
    from .evaluation.benchmark import DEFAULT_BUDGET, run_benchmark
    from .training.recipe import load_recipe
    from .training.trainer import run_training

    shipped_decode = DecodeConfig(compile=compile)  # a bad value fails here, before any work
    if steps < 1 or (limit is not None and limit < 1) or fine_tune_limit < 1:
        raise ValueError(f"steps, limit and fine_tune_limit must be >= 1, got steps={steps}, limit={limit}, "
                         f"fine_tune_limit={fine_tune_limit}")
    if minutes is not None and not minutes > 0:
        raise ValueError(f"minutes must be > 0 (the demo's time budget) or None (no budget), got {minutes!r}")
    began, seconds = time.perf_counter(), {}
    if not RECIPE.is_file():
        raise FileNotFoundError(f"the demo fine-tunes with {RECIPE.name} from the repository's recipes/; not found at {RECIPE}")
    if model is None:
        introduce(example_index, device=device, dtype=dtype)
        seconds["introduction"] = time.perf_counter() - began
    out = Path(out_dir)
    overrides = [f"training.output_dir={out / 'train'}", f"training.max_steps={steps}", "training.report_to=none",
                 f"training.save_steps={steps}", f"training.logging_steps={max(1, steps // 6)}",
                 "training.batch_size=2", "data.max_validation_examples=8"]
    if minutes is not None:
        overrides.append(f"training.max_minutes={minutes * TRAIN_SHARE}")
    if model is not None:
        overrides.append(f"model.name_or_path={model}")
    recipe = load_recipe(RECIPE, overrides)
    budget_note = f", at most {_minutes(minutes * TRAIN_SHARE * 60)}" if minutes is not None else ""
    print(f"\n[1/3] fine-tuning {steps} steps of 2 examples on Spider (recipe {RECIPE.name}, LoRA + streams, CPU"
          f"{budget_note}) ...")
    part = time.perf_counter()
    summary = run_training(recipe)
    stopped = (f"; stopped by the time budget after {summary['steps']} of {steps} steps"
               if summary.get("stopped_by_time") else "")
    print(f"streamed checkpoint exported to {summary['export']} ({summary['wall_seconds']} s, "
          f"{summary['seconds_per_step']} s/step{stopped})")
    seconds["fine_tune"] = time.perf_counter() - part
    print(f"[1/3] took {_minutes(seconds['fine_tune'])}")
    print(f"\n[2/3] benchmark on {fine_tune_limit} held-out Spider questions (batch 1, greedy; baseline: transformers "
          "generate on the base model, since the demo trains no next-token baseline) ...")
    part = time.perf_counter()
    # Fixed settings (the tree, the lookup; no pruning or confidence rows): choosing them on
    # validation prompts would add minutes.
    result = run_benchmark(summary["export"], task="sql", limit=fine_tune_limit, tree_top_k=SHIPPED_TREE, thresholds=(),
                           lookup=SHIPPED_LOOKUP, tree_budget=None, max_new_tokens=max_new_tokens,
                           device=device, dtype=dtype, skip=FINE_TUNE_SKIPS)
    _show(result, out / "benchmark")
    seconds["fine_tune_benchmark"] = time.perf_counter() - part
    print(f"[2/3] took {_minutes(seconds['fine_tune_benchmark'])}")
    print(f"\n{summary['steps']} fine-tuning steps barely train the streams. Trained ones ship with streamspec:")
    shipped = None
    if model is None:
        from .assets import shipped_streams_path

        folder = shipped_streams_path()
        if limit is None:
            left = minutes * 60 - (time.perf_counter() - began) if minutes is not None else float("inf")
            speed = (result.get("baseline") or {}).get("tokens_per_second")
            limit = shipped_questions(left, speed, max_new_tokens, compiled=bool(shipped_decode.compile))
            if speed:
                print(f"(generate ran at {speed:.1f} tokens/s here: {limit} questions fit the "
                      f"{_minutes(max(left, 0))} left of the demo's {minutes:g} minutes)" if minutes is not None
                      else f"(no time budget: {limit} questions)")
        part = time.perf_counter()
        print(f"\n[3/3] the shipped streams ({folder.name}: self-distilled lossless streams for SmolLM2, trained "
              "last by recipes/smollm2-135m/sql_streams_scale.yaml on ~2M tokens of the model's own SQL; "
              f"streamspec/weights/README.md has every stage) on {limit} questions; the base model's outputs, "
              "token for token" + (" (rows compiled where it pays: their first calls compile, untimed)"
                                   if compile else "") + " ...")
        shipped = run_benchmark(str(folder), task="sql", limit=limit, tree_top_k=SHIPPED_TREE, thresholds=(),
                                lookup=SHIPPED_LOOKUP, tree_budget=DEFAULT_BUDGET, max_new_tokens=max_new_tokens,
                                device=device, dtype=dtype, decode=shipped_decode, skip=DEMO_SKIPS)
        _show(shipped, out / "shipped")
        seconds["shipped"] = time.perf_counter() - part
        print(f"[3/3] took {_minutes(seconds['shipped'])}")
    seconds["total"] = time.perf_counter() - began
    print(f"\nthe demo took {_minutes(seconds['total'])}: " + ", ".join(
        f"{name.replace('_', ' ')} {_minutes(value)}" for name, value in seconds.items() if name != "total"))
    print("\ndocs/benchmarks.md has the figures of longer runs (more questions, the Medusa peer, other schema "
          "styles) and what limits speculative decoding on a CPU.")
    return {"fine_tune": result, "shipped": shipped, "seconds": seconds}
