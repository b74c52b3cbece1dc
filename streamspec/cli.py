"""The `streamspec` command line. Subcommands stay thin: the work lives in the library."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .decoding.config import add_decode_arguments, decode_config_from_args, lookup_arg, tree_arg  # noqa: F401

# The decode options `streamspec eval` applies to every row; its tree, lookup, budget and pruning
# flags name each row's own settings (or auto: chosen on validation prompts).
EVAL_DECODE_FLAGS = ("verify", "compile")
# Every command that decodes compiles where it pays (`streamspec.decoding.config.compile_pays`).
CLI_DECODE_DEFAULTS = {"compile": "auto"}


def tree_or_auto_arg(text: str) -> int | tuple[int, ...] | str:
    """`tree_arg`, or ``auto`` (the benchmark picks the fastest shape on validation prompts)."""
    return text if text == "auto" else tree_arg(text)


def lookup_or_auto_arg(text: str):
    """`lookup_arg`, or ``auto`` (chosen on validation prompts) or ``none`` (no lookup row)."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    return lookup_arg(text)


def peers_or_none_arg(text: str):
    """``auto`` (kept for the benchmark to resolve), ``none``, or a list of peer rows (see
    `streamspec.evaluation.peers.peers_arg`)."""
    from .evaluation.peers import peers_arg

    if text == "auto":
        return text
    try:
        return peers_arg(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def budget_or_auto_arg(text: str):
    """``auto``, ``none`` or a node budget >= 1 for --tree-budget."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, none or an int >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto, none or an int >= 1; got {text!r}")
    return value


def add_device_args(parser: argparse.ArgumentParser, device: bool = True, dtype_help: str | None = None) -> None:
    """--device and --dtype, as `streamspec.loading.load_for_inference` takes them (checked by
    `check_device_args` right after parsing, so a typo fails before any work)."""
    if device:
        parser.add_argument("--device", default="auto", help="auto (CUDA when available, else cpu), cpu, cuda, cuda:N, mps")
    parser.add_argument("--dtype", default="auto",
                        help="auto, float32, bfloat16 or float16 (" + (dtype_help or "auto: bfloat16 on CUDA, float32 on a CPU") + ")")


def check_device_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an unknown --device / --dtype (or a CUDA device on a machine without one) at once."""
    from .devices import resolve_device, resolve_dtype

    try:
        if getattr(args, "device", None) is not None:
            resolve_device(args.device)
        if getattr(args, "dtype", None) is not None:
            resolve_dtype(args.dtype, "cpu")
    except ValueError as err:
        parser.error(str(err))


ENGINES = ("streamspec", "vllm")
# `streamspec distill` flags of one engine only, with their defaults: another value with the other engine is refused
_STREAMSPEC_ONLY = {"samples": 1, "temperature": 0.0, "top_p": 1.0, "with_greedy": False, "decoder": None,
                    "server": None, "check_agreement": 0, "batch_size": 8}
_VLLM_ONLY = {"split": "train", "validation_fraction": 0.02, "max_turns": None, "shard_size": 100,
              "max_tokens_total": None, "threads": 1, "max_num_seqs": 32}


def check_distill_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse `streamspec distill` flags the chosen engine does not use (a flag silently ignored
    would make another set than the one asked for)."""
    other = _STREAMSPEC_ONLY if args.engine == "vllm" else _VLLM_ONLY
    given = [name for name, default in other.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        why = ("--engine vllm decodes greedily with vLLM" if args.engine == "vllm"
               else "they are for --engine vllm's shard folders")
        parser.error(f"{flags}: not with --engine {args.engine} ({why})")
    if args.engine == "vllm" and not args.out:
        parser.error("--engine vllm writes a folder of shards: give it with --out")


def build_parser() -> argparse.ArgumentParser:
    """The `streamspec` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="streamspec", description="Speculative Streaming for HF causal LMs")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (default: one line 'streamspec: error: ...', status 2)")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: streams on the default model, a short fine-tune, the benchmark")
    demo.add_argument("--example", type=int, default=0, help="index of the Spider dev question to show")
    demo.add_argument("--steps", type=int, default=8, help="fine-tuning steps (batch 2), fewer where --minutes runs out")
    demo.add_argument("--limit", type=int, default=None,
                      help="held-out questions to benchmark the shipped streams on (default: as many as the time "
                           "budget leaves at this machine's measured speed, 3 to 8)")
    demo.add_argument("--minutes", type=float, default=9.0,
                      help="the demo's time budget: a quarter for the fine-tune, the shipped streams' questions sized "
                           "to the rest (0: no budget)")
    demo.add_argument("--fine-tune-limit", type=int, default=3,
                      help="held-out questions to benchmark the demo's own few-step fine-tune on")
    demo.add_argument("--out", default="runs/demo", help="folder for the checkpoint and the benchmark files")
    demo.add_argument("--intro-only", action="store_true", help="only show the streams on the default model")
    add_decode_arguments(demo, defaults=CLI_DECODE_DEFAULTS, only=("compile",))
    add_device_args(demo)
    sub.add_parser("prepare", help="convert the default model into the cache (done on first use otherwise)")
    train = sub.add_parser("train", help="fine-tune from a YAML recipe")
    train.add_argument("--recipe", required=True, help="a YAML recipe, e.g. recipes/smollm2-135m/sql.yaml")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    # Set by the deepspeed launcher; the rank is read from the environment (LOCAL_RANK).
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    export = sub.add_parser("export", help="turn a training checkpoint into a streamed checkpoint, or a vLLM drafter")
    export.add_argument("--checkpoint", required=True,
                        help="a checkpoint-N or final folder of a training run, or shipped streams (streamspec:NAME)")
    export.add_argument("--format", default="streamspec", choices=("streamspec", "vllm"),
                        help="streamspec: a streamed checkpoint; vllm: the drafter folder vLLM's speculative config "
                             "loads (lossless checkpoints; docs/serving.md)")
    export.add_argument("--out", required=True, help="the folder to write")
    export.add_argument("--layout", default=None, choices=("peagle", "dflash"),
                        help="with --format vllm: the draft layout (default dflash: vLLM's dflash method, γ drafts; "
                             "peagle: its eagle3 method with parallel drafting, γ+1 drafts, the last a filler; "
                             "docs/serving.md)")
    export.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="with --format vllm: draft among the N ids the model writes most often (counted in "
                             "--draft-vocab-from), an LM head of N rows in the drafter's pass (default: every id)")
    export.add_argument("--draft-vocab-from", nargs="+", default=None, metavar="DISTILLED",
                        help="the distilled sets (folders or JSONL) the draft vocabulary is counted in")
    export.add_argument("--lookup", default=None, metavar="MIN:MAX|suffix[:CACHED]",
                        help="with --format vllm: each step, what followed the latest earlier occurrence of the "
                             "request's last MAX..MIN tokens in its own text replaces the streams' first drafts "
                             "(e.g. 2:4), or what suffix decoding's trees of the prompt, the output so far and the "
                             "last CACHED requests' outputs (default 10000; 0: none) continue it with (suffix; needs "
                             "arctic-inference, `make vllm`); default: the streams' drafts only")
    export.add_argument("--drafts", type=int, default=None, metavar="K",
                        help="with --format vllm: the drafts a step the folder asks vLLM for (default: one a stream); "
                             "with --lookup in the dflash layout up to 2γ, lookup filling the positions past γ")
    export.add_argument("--merge", action="store_true", help="merge LoRA into the base and include it (self-contained)")
    add_device_args(export, device=False, dtype_help="auto: the base model's own dtype (its config's torch_dtype)")
    merge = sub.add_parser("merge", help="fold a peft LoRA adapter into its base (a base for lossless streams)")
    merge.add_argument("--adapter", required=True, help="the adapter folder, e.g. a next-token fine-tune's final/")
    merge.add_argument("--out", required=True, help="the folder to write (a plain transformers model + tokenizer)")
    merge.add_argument("--base", default=None,
                       help="the base the adapter was trained on (default: the adapter's base_model_name_or_path, "
                            "else the default model)")
    add_device_args(merge, device=False, dtype_help="auto: the base model's own dtype (its config's torch_dtype)")
    dist = sub.add_parser(
        "distill", help="build a self-distilled set: the model's own completions of a task's prompts or of chats",
        description="The model's own greedy (or sampled) completions of prompts, for training lossless streams. "
                    "--engine streamspec (default) decodes a task's prompts with streamspec's batch decoder into one "
                    "JSONL; --engine vllm decodes with vLLM's offline engine (in `make vllm`'s environment) into a "
                    "folder of resumable shards, task prompts or multi-turn chats from the prompt registry "
                    "(--sources chitchat evals ...), each turn continued with the model's own earlier replies. "
                    "docs/training.md, 'Distillation at scale'.")
    dist.add_argument("--model", default="streamspec:SmolLM2-135M-Instruct",
                      help="the model whose outputs the set holds (a folder, hub id or the default model)")
    dist.add_argument("--engine", default="streamspec", choices=ENGINES,
                      help="streamspec: streamspec's batch decoder (or --server) into one JSONL; vllm: vLLM's offline "
                           "engine, greedy, many prompts in flight, into resumable shards in the --out folder")
    dist.add_argument("--task", default=None, choices=["sql", "summarize", "gsm8k_solutions"],
                      help="the built-in task whose prompts are distilled (default: sql, unless --sources names "
                           "prompt sources of the registry)")
    dist.add_argument("--sources", nargs="+", default=None,
                      help="the task's: train (default), validation, unused_databases (SQL: Spider schemas no split "
                           "uses), schema_questions and self_instruct (the model's own questions about those "
                           "schemas, then its SQL for them: --questions-from), SQL ones also as SOURCE@STYLE with "
                           "the schema in a style of "
                           "streamspec.data.schema_styles (train@untyped, unused_databases@compact, ...); or prompt "
                           "sources of the registry (`streamspec data list`; with --engine vllm), e.g. chitchat "
                           "evals: multi-turn chats")
    dist.add_argument("--split", default="train", choices=["train", "validation"],
                      help="--engine vllm with registry sources: which side of their train/validation split")
    dist.add_argument("--validation-fraction", type=float, default=0.02,
                      help="--engine vllm with registry sources: the share held out as validation")
    dist.add_argument("--questions-per-database", type=int, default=4, help="template questions per unused schema")
    dist.add_argument("--questions-from", default=None,
                      help="--engine vllm, SQL source self_instruct: the set of the model's own questions "
                           "(distilled with --sources schema_questions; streamspec.data.self_instruct)")
    dist.add_argument("--samples", type=int, default=1, help="completions per prompt (>1 needs --temperature)")
    dist.add_argument("--temperature", type=float, default=0.0)
    dist.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of sampled completions")
    dist.add_argument("--with-greedy", action="store_true",
                      help="with --temperature > 0: each prompt's greedy completion too, beside the --samples sampled ones")
    dist.add_argument("--max-new-tokens", type=int, default=160)
    dist.add_argument("--max-prompt-tokens", type=int, default=None,
                      help="skip longer prompts (keep within the recipe's data.max_length less --max-new-tokens); "
                           "--engine vllm: a longer turn ends its chat (default: the model's context)")
    dist.add_argument("--batch-size", type=int, default=8)
    dist.add_argument("--seed", type=int, default=0)
    dist.add_argument("--limit", type=int, default=None,
                      help="only the first N prompts (--engine vllm: conversations, in the set's seeded order)")
    dist.add_argument("--max-turns", type=int, default=None, help="--engine vllm: at most N turns of each conversation")
    dist.add_argument("--shard-size", type=int, default=100, help="--engine vllm: conversations per shard file")
    dist.add_argument("--max-tokens-total", type=int, default=None, metavar="N",
                      help="--engine vllm: stop once the set holds N generated tokens (at a shard boundary; the same "
                           "command again resumes up to the same total, a larger N goes on)")
    dist.add_argument("--threads", type=int, default=1, help="--engine vllm: vLLM's CPU threads")
    dist.add_argument("--max-num-seqs", type=int, default=32, help="--engine vllm: requests vLLM decodes at once")
    dist.add_argument("--decoder", default=None,
                      help="a streamed checkpoint (lossless streams on --model) to decode faster with")
    dist.add_argument("--server", default=None,
                      help="decode on an OpenAI-compatible server instead: its URL (vLLM, SGLang, streamspec serve...) "
                           "or llama.cpp:GGUF (a local llama.cpp server on a .gguf path or "
                           "streamspec:SmolLM2-135M-Instruct)")
    dist.add_argument("--server-threads", type=int, default=1, help="llama.cpp:GGUF only: its CPU threads")
    dist.add_argument("--server-parallel", type=int, default=4, help="requests in flight on the server")
    dist.add_argument("--check-agreement", type=int, default=0, metavar="N",
                      help="with --server: first report how often its greedy completions of N prompts equal the model's own")
    dist.add_argument("--out", default=None,
                      help="the JSONL to write (default: the cache, as a recipe's data.distill finds it); --engine "
                           "vllm: the shard folder (required; a folder of other settings is refused, one of the same "
                           "settings resumed at its first missing shard)")
    add_device_args(dist)
    gen = sub.add_parser("generate", help="decode a prompt with speculative streaming")
    gen.add_argument("--checkpoint", required=True, help="a streamed checkpoint folder")
    gen.add_argument("--prompt", required=True, help="the user message (the chat template is applied when there is one)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--no-speculative", action="store_true", help="one token per pass (the reference)")
    add_decode_arguments(gen, defaults=CLI_DECODE_DEFAULTS)
    gen.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    gen.add_argument("--default-kernels", action="store_true",
                     help="keep torch's default CPU linear kernels (default: packed oneDNN ones, see streamspec.kernels)")
    add_device_args(gen)
    from .evaluation.benchmark import SKIPPABLE_ROWS

    ev = sub.add_parser("eval", help="benchmark decoding methods side by side (speed and quality)")
    ev.add_argument("--checkpoint", required=True, help="a streamed checkpoint folder")
    ev.add_argument("--task", choices=["sql", "summarize", "chat"], default="sql",
                    help="sql: Spider's held-out databases; summarize: ACLSum; chat: MT-bench's 80 first turns "
                         "(test only; tree shapes are chosen on the chat sources' validation slice)")
    ev.add_argument("--data", help="a JSONL file with prompt and completion fields, instead of --task's test set")
    ev.add_argument("--baseline", help="peft adapter folder of the next-token fine-tune (default: the base model)")
    ev.add_argument("--limit", type=int, default=50, help="test prompts (fixed order)")
    ev.add_argument("--tree-top-k", type=tree_or_auto_arg, default=3,
                    help="the tree: candidates per stream, or per depth (3,1,1), or auto (the fastest on validation)")
    ev.add_argument("--sweep", type=int, nargs="*", default=[], help="tree_top_k values for the speedup/CRR plot")
    ev.add_argument("--validation-limit", type=int, default=10,
                    help="validation prompts the auto settings (tree, lookup, budget, threshold) are chosen on")
    ev.add_argument("--thresholds", type=float, nargs="*", default=[0.01, 0.05, 0.1, 0.2], metavar="T",
                    help="pruning thresholds tried on validation for the tree_pruned row (none given: no such row)")
    ev.add_argument("--tree-budget", type=budget_or_auto_arg, default="auto", metavar="auto|none|N",
                    help="the tree_confidence row: trees grown by confidence up to N nodes; auto: the fastest budget "
                         "on validation prompts; none: no such row")
    ev.add_argument("--lookup", type=lookup_or_auto_arg, default="auto", metavar="auto|none|L,M[,N]",
                    help="the tree_lookup row: the tree with prompt-lookup branches; auto: the fastest setting on "
                         "validation prompts (give L,M with --data); none: no such row")
    ev.add_argument("--schema-style", default="spider", choices=["spider", "untyped", "compact", "renamed", "long"],
                    help="SQL: the held-out questions with their schema written in another style (a check that the "
                         "speedup is not tied to Spider's prompts; see streamspec.data.schema_styles)")
    ev.add_argument("--medusa", default=None, metavar="FOLDER",
                    help="a Medusa checkpoint on the same model (streamspec train with a medusa recipe): adds its row, "
                         "decoded through the same tree verifier")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--peers", type=peers_or_none_arg, default="auto", metavar="auto|all|none|NAME[,NAME]",
                    help="rows beside ours: transformers_compiled (static cache + torch.compile), llama_cpp and "
                         "llama_cpp_lookup (the model's GGUF through llama.cpp, plain and with its n-gram speculation), "
                         "memory_floor (what a pass must read over the measured bandwidth); vllm, vllm_ngram, "
                         "vllm_suffix and vllm_streams (vLLM plain, with its n-gram drafter, with its suffix decoding, "
                         "with these streams as its drafter; one request at a time and 8 at once, in `make vllm`'s "
                         "environment); vllm_eagle3 and vllm_peagle (vLLM with an EAGLE-3 / P-EAGLE drafter trained "
                         "by speculators: give its folder with --eagle3 / --peagle); auto: the first four "
                         "(llama.cpp ones when a GGUF is known); all: every one but vllm_eagle3 and vllm_peagle")
    ev.add_argument("--eagle3", default=None, metavar="FOLDER",
                    help="the vllm_eagle3 row's drafter: an EAGLE-3 drafter for the checkpoint's base trained by "
                         "speculators (python eval/train_peer_drafters.py --method eagle3)")
    ev.add_argument("--peagle", default=None, metavar="FOLDER",
                    help="the vllm_peagle row's drafter: a P-EAGLE drafter trained the same way (--method peagle)")
    from .evaluation.vllm_peers import add_vllm_arguments

    add_vllm_arguments(ev)
    ev.add_argument("--gguf", default=None, metavar="PATH",
                    help="the GGUF the llama.cpp rows run (default: the default model's own GGUF)")
    ev.add_argument("--skip", nargs="+", default=[], choices=list(SKIPPABLE_ROWS), metavar="ROW",
                    help="rows not to run: baseline_default_kernels (generate on torch's default kernels), "
                         "streamed_ar (one token a pass; exactness is then checked against generate on the base), "
                         "tree (the --tree-top-k tree alone; the lookup and pruned rows still grow it)")
    # every row of ours verifies and compiles alike; the tree, lookup, budget and pruning above are
    # the rows' own (with auto: chosen on validation prompts)
    add_decode_arguments(ev, defaults=CLI_DECODE_DEFAULTS, only=EVAL_DECODE_FLAGS)
    ev.add_argument("--out", default="runs/benchmark", help="folder for JSON, Markdown and PNG plots")
    ev.add_argument("--default-kernels", action="store_true",
                    help="run every method with torch's default CPU linear kernels (default: packed oneDNN kernels "
                         "for all, plus a baseline row with the default ones)")
    add_device_args(ev)
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (speculative streaming for streamed checkpoints)")
    srv.add_argument("--checkpoint", required=True,
                     help="a streamed checkpoint folder, or any causal LM: a folder, a hub id, "
                          "streamspec:SmolLM2-135M-Instruct, a .gguf file")
    srv.add_argument("--gguf-file", default=None, help="the GGUF file's name inside the --checkpoint folder")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface; then give an --api-key)")
    srv.add_argument("--api-key", default=None,
                     help="requests to /v1/ must send 'Authorization: Bearer KEY' (401 otherwise); default: "
                          "$STREAMSPEC_API_KEY, else none")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --checkpoint)")
    add_decode_arguments(srv, defaults=CLI_DECODE_DEFAULTS)
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="the most tokens (prompt + completion) a request may use (default: the model's context)")
    srv.add_argument("--default-kernels", action="store_true", help="torch's default CPU linear kernels")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_device_args(srv)
    data = sub.add_parser("data", help="offline prompt sources for self-distillation at scale (docs/data.md)")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    data_sub.add_parser("list", help="every registered source: installed or not, rows, licence, opt-in / test-only")
    card = data_sub.add_parser("card", help="load sources as load_prompts does and write a data card (Markdown + JSON)")
    card.add_argument("--out", required=True, help="the Markdown file; the JSON goes beside it (same name, .json)")
    card.add_argument("--sources", nargs="+", default=None,
                      help="sources in order of preference (default: the installed ones that are neither opt-in "
                           "nor test-only)")
    card.add_argument("--distilled", nargs="+", default=None, metavar="FOLDER",
                      help="instead: the card of distilled sets (streamspec distill --engine vllm --out FOLDER): "
                           "counts per set and source, where the prompts come from, licences")
    card.add_argument("--validation-fraction", type=float, default=0.02)
    card.add_argument("--seed", type=int, default=0)
    from .reason.cli import add_reason_commands
    from .vllm.calibrate import add_command as add_calibrate_command

    add_reason_commands(sub)
    add_calibrate_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_device_args(parser, args)
    if args.command == "distill":
        check_distill_args(parser, args)
    if args.command == "export" and args.format == "vllm" and args.merge:
        parser.error("--merge writes a self-contained streamed checkpoint; a vLLM drafter never holds the base")
    if args.command == "export" and args.format != "vllm" and args.layout:
        parser.error("--layout is the vLLM drafter's draft layout: it goes with --format vllm")
    if args.command == "export" and args.format != "vllm" and (args.draft_vocab or args.draft_vocab_from):
        parser.error("--draft-vocab is the vLLM drafter's draft vocabulary: it goes with --format vllm")
    if args.command == "export" and args.format != "vllm" and args.drafts is not None:
        parser.error("--drafts is the vLLM drafter's drafts a step: it goes with --format vllm")
    if args.command == "export" and args.format != "vllm" and args.lookup:
        parser.error("--lookup merges lookup drafts into the vLLM drafter's: it goes with --format vllm")
    if args.command == "export" and (args.draft_vocab is None) != (args.draft_vocab_from is None):
        parser.error("--draft-vocab N and --draft-vocab-from DISTILLED go together (the size, and the model's own "
                     "text the ids are counted in)")
    try:
        return _run(args)
    except Exception as err:  # one line for the user; --debug (or STREAMSPEC_DEBUG=1) for the traceback
        if args.debug or os.environ.get("STREAMSPEC_DEBUG"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"streamspec: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _run(args) -> int:
    """Run the parsed subcommand."""
    if args.command == "demo":
        from .demo import introduce, run_demo

        if args.intro_only:
            introduce(args.example, device=args.device, dtype=args.dtype)
        else:
            run_demo(steps=args.steps, limit=args.limit, fine_tune_limit=args.fine_tune_limit, out_dir=args.out,
                     example_index=args.example, device=args.device, dtype=args.dtype, compile=args.compile,
                     minutes=args.minutes or None)
    elif args.command == "train":
        from .training.recipe import load_recipe
        from .training.trainer import run_training

        summary = run_training(load_recipe(args.recipe, args.overrides), resume=args.resume)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"trained {summary['steps']} steps in {summary['wall_seconds']} s; exported to {summary.get('export')}")
    elif args.command == "export":
        if args.format == "vllm":
            from .vllm.export import export_for_vllm, serve_command

            from .vllm.format import DEFAULT_LAYOUT

            target = export_for_vllm(args.checkpoint, args.out, dtype=args.dtype, layout=args.layout or DEFAULT_LAYOUT,
                                     draft_vocab=args.draft_vocab, draft_vocab_from=args.draft_vocab_from,
                                     lookup=args.lookup, drafts=args.drafts)
            print(target)
            print("serve it with:", serve_command(target), file=sys.stderr)
        else:
            from .patch.checkpoint import export_checkpoint

            print(export_checkpoint(args.checkpoint, args.out, merge=args.merge, dtype=args.dtype))
    elif args.command == "merge":
        from .patch.checkpoint import merge_adapter

        print(merge_adapter(args.adapter, args.out, base=args.base, dtype=args.dtype))
    elif args.command == "distill" and args.engine == "vllm":
        from .training.distill_engine import distill_with_vllm, sharded_args, summary_line

        summary = distill_with_vllm(args.model, sharded_args(args), args.out)
        print(summary_line(summary), file=sys.stderr)
        print(args.out)
    elif args.command == "distill":
        from .data.distill import DistillArgs
        from .training.distill import build_distilled_set
        from .training.distill_engine import resolve_sources

        args.task, args.sources = resolve_sources(args.task, args.sources, args.engine)
        settings = DistillArgs(enabled=True, sources=args.sources, questions_per_database=args.questions_per_database,
                               samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                               with_greedy=args.with_greedy, max_new_tokens=args.max_new_tokens,
                               max_prompt_tokens=args.max_prompt_tokens,
                               batch_size=args.batch_size, seed=args.seed, decoder=args.decoder, server=args.server,
                               server_threads=args.server_threads, server_parallel=args.server_parallel)
        if args.check_agreement:
            from .training.distill import server_agreement

            print(json.dumps(server_agreement(args.model, args.task, settings, args.check_agreement, device=args.device,
                                              dtype=args.dtype)))
        print(build_distilled_set(args.model, args.task, settings, out=args.out, limit=args.limit,
                                  device=args.device, dtype=args.dtype))
    elif args.command == "generate":
        from .decoding.text import generate_text

        generate_text(
            args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, speculative=not args.no_speculative,
            stream=args.stream, config=decode_config_from_args(args),
            cpu_kernels=not args.default_kernels, device=args.device, dtype=args.dtype,
        )
    elif args.command == "eval":
        from .evaluation.benchmark import run_benchmark
        from .evaluation.vllm_peers import vllm_options

        run_benchmark(
            args.checkpoint, task=args.task, data=args.data, baseline=args.baseline, limit=args.limit,
            validation_limit=args.validation_limit, thresholds=tuple(args.thresholds),
            tree_top_k=args.tree_top_k, sweep_top_k=tuple(args.sweep), lookup=args.lookup, tree_budget=args.tree_budget,
            max_new_tokens=args.max_new_tokens, medusa=args.medusa, schema_style=args.schema_style,
            out_dir=args.out, cpu_kernels=not args.default_kernels, device=args.device, dtype=args.dtype,
            decode=decode_config_from_args(args, only=EVAL_DECODE_FLAGS), peers=args.peers, gguf=args.gguf,
            skip=tuple(args.skip), drafters={"eagle3": args.eagle3, "peagle": args.peagle},
            vllm_options=vllm_options(args),
        )
    elif args.command == "serve":
        from .serving import serve

        serve(args.checkpoint, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              max_model_len=args.max_model_len, served_model_name=args.served_model_name, gguf_file=args.gguf_file,
              cpu_kernels=not args.default_kernels, log_level=args.log_level, config=decode_config_from_args(args),
              api_key=args.api_key)
    elif args.command == "data":
        from .data.sources import format_source_table, write_data_card

        if args.data_command == "list":
            print(format_source_table())
        elif args.distilled:
            from .data.distill_card import write_distilled_card

            if args.sources:
                raise ValueError("data card: give --sources (a prompt set) or --distilled (distilled sets), not both")
            for path in write_distilled_card(args.out, args.distilled):
                print(path)
        else:
            for path in write_data_card(args.out, names=args.sources, validation_fraction=args.validation_fraction,
                                        seed=args.seed):
                print(path)
    elif args.command in ("reason", "reason-eval"):
        from .reason.cli import dispatch

        return dispatch(args)
    elif args.command == "vllm-calibrate":
        from .vllm.calibrate import run_command

        return run_command(args)
    elif args.command == "prepare":
        from .assets import default_model_path

        print(default_model_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
