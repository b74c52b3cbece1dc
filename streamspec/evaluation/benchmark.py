"""Side-by-side speed and quality of decoding methods on the same held-out prompts (batch 1,
greedy), in one process: what `streamspec eval` runs.

Methods:
- ``baseline``: transformers `generate` on the model users would run today (the next-token LoRA
  fine-tune given as ``baseline``, or the unpatched base for a lossless checkpoint): speedup 1.0;
- ``baseline_default_kernels``: the same, with torch's default CPU linear kernels, when the others
  run with streamspec's packed oneDNN kernels (`streamspec.kernels`, on by default on a CPU): every
  other method uses the same kernels as ``baseline``, so their speedups are the decoding method's
  own, and this row shows what the kernels alone give;
- ``prompt_lookup``: transformers prompt-lookup decoding on that same model;
- ``streamed_ar``: the streamed model, one token per pass (speculative=False);
- ``chain``, ``tree``, ``tree_pruned``: speculative streaming with tree_top_k 1, the given tree (or
  with ``"auto"`` the fastest shape on validation prompts), and that tree with the pruning
  threshold chosen on validation prompts;
- ``tree_lookup``: that tree with prompt-lookup branches merged in (`streamspec.decoding.lookup`), the
  branch length, number of matches and node budget given or (``"auto"``) the fastest of
  `LOOKUP_CANDIDATES` on validation prompts;
- ``tree_confidence``: each pass's tree grown by confidence from 3 candidates per stream
  (`streamspec.decoding.tree.grow_tree`), its node budget given or (``"auto"``) the fastest of
  `BUDGET_CANDIDATES` on validation prompts;
- ``medusa``: Medusa heads (`streamspec.patch.medusa`) on the baseline's model, when a Medusa
  checkpoint is given, decoded through the same tree verifier with the ``tree`` row's shape (with
  ``"auto"``: its own fastest shape on the validation prompts).

Every draft method reports ``draft_parameters``: the parameters it adds to the model (streams with
their adapters; the heads).

Each method reports tokens/s, walltime speedup over the baseline, CRR (generated tokens ÷ forward
passes), mean tokens per pass, acceptance by depth, whether its outputs equal the streamed
model's autoregressive outputs, and quality (SQL exact match and validity, or ROUGE). For
streamspec's decoders it also splits the time: the prefill call per prompt, then per decoding
step the transformer layers, the LM / early-exit heads and the rest (tree, masks, cache moves).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..decoding.config import DecodeConfig
from ..decoding.lookup import PromptLookup
from ..decoding.tree import tree_shape

from ..data.build import prompt_ids
from .methods import (  # noqa: F401 (part of this module's API)
    CallCounter,
    MethodResult,
    hf_method,
    row_config,
    run_methods,
    streaming_method,
    with_default_kernels,
)
from .vllm_peers import VLLM_PEERS, check_concurrency, check_trained_drafters, vllm_base, vllm_rows
from .peers import peer_methods, peer_summary
from .report import DRAFT_METHODS, markdown_table, quality, report, save_report  # noqa: F401
from .tuning import (  # noqa: F401
    BUDGET_CANDIDATES,
    CONFIDENCE_TOP_K,
    DEFAULT_BUDGET,
    DEFAULT_LOOKUP,
    LOOKUP_CANDIDATES,
    TREE_CANDIDATES,
    choose_budget,
    choose_config,
    choose_lookup,
    choose_threshold,
    choose_tree,
    lookup_name,
)

# Rows a caller may leave out (`run_benchmark(skip=...)`): the two reference rows, neither a
# speculative method, and the fixed tree alone (its shape still shapes the pruned and lookup rows);
# `make demo` leaves all three out of its shipped-streams step to stay within its minutes (each
# row a compiled graph is a first compile of ~1 minute on a CPU).
SKIPPABLE_ROWS = ("baseline_default_kernels", "streamed_ar", "tree")
EVAL_TASKS = ("sql", "summarize", "chat")


def held_out_rows(task: str, data: str | None = None, split: str = "test", schema_style: str = "spider") -> list[dict]:
    """Prompts to benchmark: Spider's held-out databases (their schemas in `schema_style`, see
    `streamspec.data.schema_styles`), ACLSum, MT-bench's first turns (chat), or a JSONL file with
    prompt and completion fields."""
    if schema_style != "spider" and (task != "sql" or data is not None):
        raise ValueError(f"schema_style {schema_style!r} re-renders Spider prompts: it needs task 'sql' and no data file")
    if data is not None:
        from ..data.build import load_rows

        return load_rows(path=data)
    if task == "sql" and schema_style != "spider":
        from ..data.schema_styles import styled_spider_rows

        return styled_spider_rows(schema_style, split)
    if task not in EVAL_TASKS:
        raise ValueError(f"task must be one of {list(EVAL_TASKS)} (or give data=FILE), got {task!r}")
    from ..data.tasks import task_rows

    return task_rows(task, split)


def run_benchmark(
    checkpoint: str,
    task: str = "sql",
    data: str | None = None,
    baseline: str | None = None,
    limit: int | None = 50,
    validation_limit: int = 10,
    tree_top_k: int | tuple[int, ...] | str = 3,
    thresholds: tuple[float, ...] = (0.01, 0.05, 0.1, 0.2),
    sweep_top_k: tuple[int, ...] = (),
    lookup: PromptLookup | str | None = "auto",
    tree_budget: int | str | None = "auto",
    max_new_tokens: int = 128,
    out_dir: str | None = None,
    cpu_kernels: bool = True,
    device: str = "auto",
    dtype: str = "auto",
    medusa: str | None = None,
    schema_style: str = "spider",
    decode: DecodeConfig | None = None,
    peers: tuple[str, ...] | str = (),
    gguf: str | None = None,
    skip: tuple[str, ...] = (),
    drafters: dict[str, str | None] | None = None,
    vllm_options: dict | None = None,
) -> dict:
    """The whole side-by-side benchmark; see the module docstring. Returns the summary.

    Args:
        checkpoint: a streamed checkpoint (a folder, or shipped weights: ``streamspec:NAME``).
        baseline: a peft adapter folder of the next-token fine-tune on the same base; default the
            unpatched base model (the right baseline for a lossless checkpoint).
        limit / validation_limit: how many test / validation prompts (fixed order).
        tree_top_k: the ``tree`` method's shape (see `streamspec.decoding.generate`), or ``"auto"``:
            the fastest of `TREE_CANDIDATES` on the validation prompts.
        sweep_top_k: also measure speedup and CRR for these tree_top_k, with and without pruning.
        lookup: the ``tree_lookup`` row's `PromptLookup`, ``"auto"`` (the fastest of
            `LOOKUP_CANDIDATES` on validation prompts; `DEFAULT_LOOKUP` with `data`, which has
            no validation split) or None (no such row).
        tree_budget: the ``tree_confidence`` row's node budget, ``"auto"`` (the fastest of
            `BUDGET_CANDIDATES` on validation prompts; `DEFAULT_BUDGET` with `data`) or None.
        cpu_kernels: on a CPU, run every model's fp32 linear layers through packed oneDNN kernels
            (`streamspec.kernels.pack_linear_layers`) and add the ``baseline_default_kernels`` row.
        device / dtype: where and in what precision both models run (`streamspec.loading`;
            ``auto``: CUDA in bfloat16 when available, else the CPU in float32).
        schema_style: SQL prompts with the schema in another style (`streamspec.data.schema_styles`:
            untyped, compact, renamed, long), test and validation alike.
        medusa: a Medusa checkpoint folder (`streamspec.patch.medusa`) trained on the baseline's
            model: adds the ``medusa`` row. Refused when its base is another model.
        peers: rows of `streamspec.evaluation.peers.PEERS` (``transformers_compiled``, ``vllm``, ...,
            ``llama_cpp``, ``llama_cpp_lookup``, ``memory_floor``), or ``"auto"``: every one, the
            llama.cpp rows only when a GGUF is known (`gguf`, or the default model's own).
        gguf: the GGUF the llama.cpp rows run (a path; default: the default model's own GGUF when
            the baseline is the default model).
        skip: rows not to run, of `SKIPPABLE_ROWS` (``baseline_default_kernels``, ``streamed_ar``,
            ``tree``). Without ``streamed_ar`` a lossless checkpoint's rows are still checked token
            for token against the baseline (``identical_to_baseline``); without ``tree``, the
            tree shape `tree_top_k` is still the one the ``tree_pruned`` and ``tree_lookup`` rows
            grow (and the sweep measures its point itself).
        drafters: the folders of the trained drafters the ``vllm_eagle3`` / ``vllm_peagle`` rows
            decode with (``{"eagle3": FOLDER, "peagle": FOLDER}``; `streamspec.evaluation.peer_drafters`);
            a row asked for without its folder is refused before anything runs.
        vllm_options: more for the vLLM rows (`vllm_rows`): ``schedule`` (the streams drafter's
            drafts by batch size: adds the ``vllm_streams_schedule`` row), ``concurrency``.
    """
    from ..patch.checkpoint import read_checkpoint_meta, recorded_base
    from ..loading import load_for_inference

    if vllm_options and "concurrency" in vllm_options:
        check_concurrency(vllm_options["concurrency"])
    if not isinstance(peers, str):
        check_trained_drafters(peers, drafters)
    bad_skip = [name for name in skip if name not in SKIPPABLE_ROWS]
    if isinstance(skip, str) or bad_skip:
        raise ValueError(f"skip takes rows of {list(SKIPPABLE_ROWS)}, got {skip!r}")
    auto_tree = tree_top_k == "auto"
    if isinstance(tree_top_k, list):
        tree_top_k = tuple(tree_top_k)
    if (auto_tree or thresholds) and data is None and validation_limit < 1:
        raise ValueError(f"validation_limit must be >= 1 to choose a tree or threshold on validation, got {validation_limit}")
    if auto_tree and data is not None:
        raise ValueError("tree_top_k='auto' chooses on the task's validation split; with data=FILE give a shape")
    auto_lookup = lookup == "auto"
    if isinstance(lookup, str) and not auto_lookup:
        raise ValueError(f"lookup must be a PromptLookup, 'auto' or None, got {lookup!r}")
    if auto_lookup and data is not None:  # no validation split: the usual setting
        lookup, auto_lookup = DEFAULT_LOOKUP, False
    auto_budget = tree_budget == "auto"
    if isinstance(tree_budget, str) and not auto_budget:
        raise ValueError(f"tree_budget must be an int, 'auto' or None, got {tree_budget!r}")
    if auto_budget and data is not None:
        tree_budget, auto_budget = DEFAULT_BUDGET, False
    if auto_budget and validation_limit < 1:
        raise ValueError(f"validation_limit must be >= 1 to choose the tree budget on validation, got {validation_limit}")
    if auto_lookup and validation_limit < 1:
        raise ValueError(f"validation_limit must be >= 1 to choose the lookup on validation, got {validation_limit}")
    from ..assets import shipped_or_path

    checkpoint = shipped_or_path(checkpoint)
    meta = read_checkpoint_meta(checkpoint)
    loaded = load_for_inference(checkpoint, device=device, dtype=dtype, cpu_kernels=False)  # packed below, with the baseline
    model, tokenizer = loaded.model, loaded.tokenizer
    if not auto_tree:
        tree_shape(tree_top_k, model.num_drafts)  # a bad shape fails before any decoding
    rows = held_out_rows(task, data, schema_style=schema_style)[:limit]
    base_model = _baseline_model(meta, checkpoint, baseline, loaded.device, loaded.dtype)
    eos = tokenizer.eos_token_id
    packed = cpu_kernels and _pack_for_cpu(model, base_model)
    heads = None
    if medusa is not None:  # refused (another base, a tree deeper than the heads) before anything is decoded
        heads = _medusa_model(medusa, base_model)
        if not auto_tree:
            tree_shape(tree_top_k, heads.num_drafts)

    threshold = None
    validation = None
    if data is None and (auto_tree or thresholds or auto_lookup or auto_budget):
        validation = held_out_rows(task, split="validation", schema_style=schema_style)[:validation_limit]
    if auto_tree:
        tree_top_k, tree_table = choose_tree(model, tokenizer, validation, TREE_CANDIDATES, max_new_tokens, decode)
    if validation is not None and thresholds:
        threshold, threshold_table = choose_threshold(model, tokenizer, validation, tree_top_k, list(thresholds),
                                                      max_new_tokens, decode)
    if auto_budget:
        tree_budget, budget_table = choose_budget(model, tokenizer, validation, BUDGET_CANDIDATES, max_new_tokens,
                                                  decode)
    if heads is not None:
        if auto_tree:
            medusa_shape, medusa_table = choose_tree(heads, tokenizer, validation, TREE_CANDIDATES, max_new_tokens,
                                                     decode)
        else:
            medusa_shape = tree_top_k
    if auto_lookup:
        lookup, lookup_table = choose_lookup(model, tokenizer, validation, tree_top_k, LOOKUP_CANDIDATES, max_new_tokens,
                                             decode)
    methods = {
        "baseline": hf_method("baseline", base_model, eos),
        **({"baseline_default_kernels": with_default_kernels(hf_method("baseline", base_model, eos), base_model)}
           if packed else {}),
        "prompt_lookup": hf_method("prompt_lookup", base_model, eos, prompt_lookup_num_tokens=10),
        "streamed_ar": streaming_method(model, eos, decode, speculative=False),
        "chain": streaming_method(model, eos, decode, tree_top_k=1),
        "tree": streaming_method(model, eos, decode, tree_top_k=tree_top_k),
    }
    if threshold is not None:
        methods["tree_pruned"] = streaming_method(model, eos, decode, tree_top_k=tree_top_k, prune_threshold=threshold)
    if lookup is not None:
        methods["tree_lookup"] = streaming_method(model, eos, decode, tree_top_k=tree_top_k, lookup=lookup)
    if tree_budget is not None:
        methods["tree_confidence"] = streaming_method(model, eos, decode, tree_top_k=CONFIDENCE_TOP_K,
                                                      tree_budget=tree_budget)
    if heads is not None:
        methods["medusa"] = streaming_method(heads, eos, decode, tree_top_k=medusa_shape)
    for name in skip:
        methods.pop(name, None)
    peer_rows, peer_context = peer_methods(peers, gguf, base_model, eos, baseline)
    methods.update(peer_rows)
    lossless_on_base = baseline is None and model.stream_config.mode == "lossless"
    save_partial = None
    if out_dir is not None:
        partial = Path(out_dir) / "partial.json"
        partial.parent.mkdir(parents=True, exist_ok=True)

        def save_partial(so_far: dict[str, MethodResult], done: int) -> None:
            # every method's figures on the prompts finished so far: a late failure loses nothing
            entry = {"prompts_done": done, "prompts": len(rows),
                     "methods": report(task, rows[:done], so_far, baseline_is_base=lossless_on_base)}
            partial.write_text(json.dumps(entry, indent=2) + "\n")

    with peer_context:
        results = run_methods(methods, tokenizer, rows, max_new_tokens, on_prompt=save_partial)
    summary = report(task, rows, results, baseline_is_base=lossless_on_base)
    peer_summary(summary, results, methods, peers, rows, tokenizer, model, base_model, heads, gguf_of=peer_context)
    if not isinstance(peers, str) and set(peers) & set(VLLM_PEERS):  # vLLM in its own environment
        summary.update(vllm_rows(peers, checkpoint, vllm_base(recorded_base(checkpoint, meta)),
                                 [prompt_ids(tokenizer, row)[0].tolist() for row in rows], max_new_tokens,
                                 results["baseline"].token_ids, summary["baseline"]["tokens_per_second"],
                                 dtype=str(loaded.dtype).removeprefix("torch."), drafters=drafters,
                                 **(vllm_options or {})))
    shape = tree_top_k if isinstance(tree_top_k, int) else list(tree_top_k)
    if "tree" in summary:
        summary["tree"]["tree_top_k"] = shape
        summary["tree"]["tree_chosen_on_validation"] = auto_tree
        if auto_tree:  # what each candidate did on the validation prompts
            summary["tree"]["validation"] = tree_table
    if threshold is not None:
        summary["tree_pruned"]["tree_top_k"] = shape
        summary["tree_pruned"]["prune_threshold"] = threshold
        summary["tree_pruned"]["validation"] = threshold_table
    if tree_budget is not None:
        summary["tree_confidence"].update(tree_top_k=CONFIDENCE_TOP_K, tree_budget=tree_budget,
                                          budget_chosen_on_validation=auto_budget)
        if auto_budget:
            summary["tree_confidence"]["validation"] = budget_table
    if lookup is not None:
        summary["tree_lookup"]["tree_top_k"] = shape
        summary["tree_lookup"]["lookup"] = lookup_name(lookup)
        summary["tree_lookup"]["lookup_chosen_on_validation"] = auto_lookup
        if auto_lookup:
            summary["tree_lookup"]["validation"] = lookup_table

    if heads is not None:
        summary["medusa"].update(tree_top_k=medusa_shape if isinstance(medusa_shape, int) else list(medusa_shape),
                                 tree_chosen_on_validation=auto_tree, draft_parameters=heads.num_draft_parameters())
        if auto_tree:
            summary["medusa"]["validation"] = medusa_table
    for name in DRAFT_METHODS:
        if name in summary:
            summary[name]["draft_parameters"] = model.num_stream_parameters()
    for name, method in methods.items():  # how each row of ours verified, and whether it was compiled
        config = getattr(method, "config", None)
        if config is not None and name in summary:
            summary[name].update(verify=config.verify, compile=config.compile)

    if out_dir is not None:
        save_report(summary, out_dir)  # the main table is safe before the sweep runs
    sweep = []
    if sweep_top_k:
        base_tps = results["baseline"].tokens / results["baseline"].seconds
        measured = {(1, False): "chain", (tree_top_k, False): "tree", (tree_top_k, True): "tree_pruned"}
        for k in sweep_top_k:
            for pruned in (False, True):
                if pruned and threshold is None:
                    continue
                if measured.get((k, pruned)) in results:  # already run above, on the same prompts
                    run = results[measured[(k, pruned)]]
                else:
                    run = run_methods({"m": streaming_method(model, eos, tree_top_k=k, prune_threshold=threshold if pruned else None)},
                                      tokenizer, rows, max_new_tokens)["m"]
                entry = run.summary(base_tps)
                sweep.append({"tree_top_k": k, "pruned": pruned, "speedup": entry["speedup"], "crr": entry["crr"]})
    if out_dir is not None:
        paths = save_report(summary, out_dir, sweep)
        summary_paths = {k: str(v) for k, v in paths.items()}
        print(markdown_table(summary))
        print("plots: " + ", ".join(v for k, v in summary_paths.items() if v.endswith(".png")))
    return summary




def _medusa_model(folder: str, base_model):
    """Medusa heads from `folder` on the benchmark's baseline model (shared, not loaded twice);
    refused strictly when the heads were trained on another base (`load_medusa_heads`)."""
    from ..patch.medusa import MedusaConfig, MedusaModel, load_medusa_heads, read_medusa_meta

    heads = MedusaModel(base_model, MedusaConfig(**read_medusa_meta(folder)["medusa_config"]))
    load_medusa_heads(heads, folder)
    p = next(base_model.parameters())
    return heads.to(device=p.device, dtype=p.dtype).eval()


def _pack_for_cpu(*models) -> bool:
    """Switch all the models to streamspec's CPU kernels (see `streamspec.kernels`), as
    `streamspec.loading.load_for_inference` does: the decoding attention, and their linear layers
    packed for oneDNN when this CPU packs their dtype. False (nothing switched) when one is on
    another device or this torch has no oneDNN."""
    from ..kernels import cpu_kernels_available, pack_linear_layers, packed_dtypes, use_decode_attention

    if not cpu_kernels_available() or any(next(m.parameters()).device.type != "cpu" for m in models):
        return False
    pack = all(next(m.parameters()).dtype in packed_dtypes() for m in models)
    for m in models:
        if pack:
            pack_linear_layers(m)
        use_decode_attention(m)
    return True


def _baseline_model(meta: dict, checkpoint: str, baseline: str | None, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32):
    from ..assets import load_base_model
    from ..patch.checkpoint import recorded_base

    base_name = recorded_base(checkpoint, meta)
    model = load_base_model(base_name, dtype=dtype)
    if baseline is not None:
        from ..patch.checkpoint import load_adapter

        model = load_adapter(model, Path(baseline)).merge_and_unload().eval()
    return model.to(device)
