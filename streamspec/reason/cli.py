"""The `streamspec reason` and `streamspec reason-eval` commands (thin: the work is in the library)."""

from __future__ import annotations

import argparse
import sys

from ..decoding.config import add_decode_arguments, decode_fields
from .config import BackendConfig, ReasonSetup, load_reason_config

_REASON_FLAGS = {  # flag -> (ReasonConfig field, type)
    "--threshold": ("threshold", float),
    "--score": ("score", str),
    "--judge-request": ("judge_request", str),
    "--token-budget": ("token_budget", int),
    "--step-max-tokens": ("step_max_tokens", int),
    "--first-base-steps": ("first_base_steps", int),
    "--temperature": ("temperature", float),
    "--top-p": ("top_p", float),
    "--seed": ("seed", int),
    "--answer-max-tokens": ("answer_max_tokens", int),
}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", help="the base: a model folder, hub id, streamed checkpoint, or a server URL "
                                       "(http://host:port/v1, with --base-model)")
    parser.add_argument("--drafter", help="the drafter: a streamed checkpoint (speculative streaming), any causal LM, "
                                          "or a server URL (with --drafter-model)")
    parser.add_argument("--judge", help="a separate judge (default: the base)")
    for role in ("base", "drafter", "judge"):
        parser.add_argument(f"--{role}-model", help=f"the served model name when --{role} is a URL")
    parser.add_argument("--config", help="a YAML file with sections reason, base, drafter, judge")
    parser.add_argument("--set", nargs="*", default=[], metavar="section.key=value",
                        help="overrides of the YAML file, e.g. reason.threshold=9 drafter.tree_top_k=2")
    parser.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:1 ... for in-process models")
    parser.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    parser.add_argument("--no-streams", action="store_true", help="decode a streamed drafter without its streams")
    for flag, (_, kind) in _REASON_FLAGS.items():
        parser.add_argument(flag, type=kind, default=None)
    # the drafter's decode options, from DecodeConfig's fields (unset: the config file's, else its defaults)
    add_decode_arguments(parser, defaults={f.name: None for f in decode_fields()}, prefix="drafter-")


def add_reason_commands(sub) -> None:
    """Register `reason` and `reason-eval` on the main parser's subcommands."""
    reason = sub.add_parser("reason", help="SpecReason on one problem: the drafter drafts steps, the base judges them")
    _common(reason)
    reason.add_argument("--problem", required=True, help="the problem text")
    ev = sub.add_parser("reason-eval", help="SpecReason against base-only and drafter-only on a task, side by side")
    _common(ev)
    ev.add_argument("--task", choices=["gsm8k", "aime2025", "champ"], help="a built-in task")
    ev.add_argument("--data", help="a JSONL file with question and answer fields, instead of --task")
    ev.add_argument("--limit", type=int, default=None, help="the first N problems (fixed order)")
    ev.add_argument("--offset", type=int, default=0, help="skip the first problems")
    ev.add_argument("--thresholds", type=float, nargs="+", default=None, help="SpecReason thresholds (default: the config's)")
    ev.add_argument("--methods", nargs="+", default=None,
                    help="a subset: base_only drafter_only specreason@T specreason_plain@T (default: all)")
    ev.add_argument("--no-plain", action="store_true", help="skip SpecReason with the drafter without streams")
    ev.add_argument("--plain-drafter", default=None, metavar="SOURCE",
                    help="the plain-drafter peer on its own engine (e.g. llama.cpp:streamspec:SmolLM2-135M-Instruct, the "
                         "same model as the streamed drafter without streams); default: the streamed drafter in "
                         "process with its streams off")
    ev.add_argument("--calibrate", action="store_true",
                    help="also score CHAMP's annotated solutions with the judge (AUROC of good vs wrong steps)")
    ev.add_argument("--calibrate-only", action="store_true",
                    help="only the judge's calibration (--calibrate without solving any problem)")
    ev.add_argument("--calibration-limit", type=int, default=50, help="annotated solutions to score")
    ev.add_argument("--judge-requests", nargs="+", default=None, metavar="REQUEST",
                    help="with --calibrate: the judge requests to compare (default: every one of "
                         "streamspec.reason.judging.JUDGE_REQUESTS)")
    ev.add_argument("--calibration-steps", type=int, default=8, help="with --calibrate: steps scored per solution")
    ev.add_argument("--out", default="runs/reason-eval", help="folder for traces.jsonl, summary.json/md and plots")


def setup_from_args(args) -> ReasonSetup:
    """The YAML file (if any), its overrides, then the flags (flags win)."""
    overrides = list(args.set or [])
    for flag, (field, _) in _REASON_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.append(f"reason.{field}={value}")
    setup = load_reason_config(args.config, overrides)
    for role in ("base", "drafter", "judge"):
        source = getattr(args, role)
        current: BackendConfig | None = getattr(setup, role)
        values = dict(vars(current)) if current is not None else {}
        if source:
            values["source"] = source
        if getattr(args, f"{role}_model"):
            values["model"] = getattr(args, f"{role}_model")
        if args.device:
            values["device"] = args.device
        if args.dtype:
            values["dtype"] = args.dtype
        if role == "drafter" and args.no_streams:
            values["streams"] = False
        if role == "drafter":
            for f in decode_fields():
                value = getattr(args, f"drafter_{f.name}", None)
                if value is not None:  # a PromptLookup from --drafter-lookup is kept as its L,M,N text
                    values[f.name] = f"{value.tokens},{value.matches},{value.ngram}" if f.name == "lookup" else value
        if values.get("source"):
            setattr(setup, role, BackendConfig(**values))
    return setup


def _backends(setup: ReasonSetup, need_plain: bool = False, plain_source: str | None = None):
    from .backends import LocalBackend, backend_from_config

    base = backend_from_config(setup.base, "base") if setup.base else None
    drafter = backend_from_config(setup.drafter, "drafter") if setup.drafter else None
    judge = backend_from_config(setup.judge, "judge") if setup.judge else None
    plain = None
    if need_plain and plain_source:  # the plain-drafter peer on its own engine (e.g. llama.cpp:GGUF)
        plain = backend_from_config(BackendConfig(source=plain_source, streams=False), "drafter (no streams)")
    elif need_plain and isinstance(drafter, LocalBackend) and drafter.streamed:
        plain = LocalBackend(drafter.session.model, drafter.tokenizer, streams=False, name="drafter (no streams)")
    return base, drafter, judge, plain


def run_reason(args, out=None) -> int:
    out = out or sys.stdout
    from .reasoner import SpecReasoner

    setup = setup_from_args(args)
    if setup.base is None or setup.drafter is None:
        raise ValueError("streamspec reason needs --base and --drafter (or both sections in --config)")
    base, drafter, judge, _ = _backends(setup)

    def show(step) -> None:
        if step.score is None:
            label = f"[{step.index + 1}] {step.author} (unjudged)"
        elif step.author == "drafter":
            label = f"[{step.index + 1}] drafted, kept (score {step.score:.1f})"
        else:
            label = f"[{step.index + 1}] drafted, rejected (score {step.score:.1f}); rewritten by the base"
        out.write(f"{label}\n{step.text.rstrip()}\n\n")
        out.flush()

    trace = SpecReasoner(drafter, base, setup.reason, judge=judge, on_step=show).solve(args.problem)
    if trace.answer_text:
        out.write(f"[answer phase]{trace.answer_text}\n\n")
    if trace.error:
        out.write(f"error: {trace.error}\n")
    judged = trace.drafted_steps
    kept = sum(s.author == "drafter" for s in judged)
    tpp = trace.draft_tokens_per_pass
    out.write(
        f"answer: {trace.answer}\n[{trace.stop_reason}: {len(trace.steps)} steps, {kept}/{len(judged)} drafts kept, "
        f"{trace.tokens['total']} tokens ({trace.tokens['draft_kept']} drafted and kept, {trace.tokens['draft_rejected']} "
        f"rejected, {trace.tokens['base']} by the base, {trace.tokens['answer']} answer) in {trace.seconds['total']:.1f} s: "
        f"draft {trace.seconds['draft']:.1f} s, judge {trace.seconds['judge']:.1f} s, base {trace.seconds['base']:.1f} s"
        + (f"; {tpp:.2f} draft tokens per pass" if tpp else "") + "]\n"
    )
    return 0 if trace.stop_reason != "error" else 1


def run_reason_eval(args, out=None) -> int:
    out = out or sys.stdout
    from .evaluate import calibrate, evaluate
    from .report import markdown, save_report, summarize
    from .tasks import champ_annotated_solutions, load_problems

    if getattr(args, "calibrate_only", False) and args.task is None and args.data is None:
        args.task = "champ"  # the calibration's own annotated solutions
    if (args.task is None) == (args.data is None):
        raise ValueError("streamspec reason-eval needs exactly one of --task or --data")
    setup = setup_from_args(args)
    if getattr(args, "calibrate_only", False):
        if setup.base is None and setup.judge is None:
            raise ValueError("streamspec reason-eval --calibrate-only needs --judge (or --base, which judges by default)")
    elif setup.base is None and setup.drafter is None:
        raise ValueError("streamspec reason-eval needs --base and/or --drafter")
    calibrate_only = getattr(args, "calibrate_only", False)
    problems = [] if calibrate_only else load_problems(task=args.task, data=args.data, limit=args.limit,
                                                       offset=args.offset)
    base, drafter, judge, plain = _backends(setup, need_plain=not args.no_plain and not calibrate_only,
                                            plain_source=args.plain_drafter)
    traces = [] if calibrate_only else evaluate(problems, setup.reason, args.out, base=base, drafter=drafter,
                                                plain_drafter=plain, thresholds=args.thresholds, methods=args.methods)
    wanted = {(p.id) for p in problems}
    traces = [t for t in traces if t.problem_id in wanted]
    summary = summarize(traces)
    if args.calibrate or calibrate_only:
        judge_backend = judge or base
        if judge_backend is None:
            raise ValueError("streamspec reason-eval --calibrate needs a base or a judge")
        from .judging import JUDGE_REQUESTS

        summary["calibration"] = calibrate(judge_backend, champ_annotated_solutions(limit=args.calibration_limit),
                                           args.out, max_steps=args.calibration_steps,
                                           requests=args.judge_requests or list(JUDGE_REQUESTS))
    files = save_report(summary, traces, args.out)
    out.write(markdown(summary) + "\n")
    out.write("wrote " + ", ".join(str(p) for p in files.values()) + "\n")
    return 0


def dispatch(args) -> int:
    return run_reason(args) if args.command == "reason" else run_reason_eval(args)
