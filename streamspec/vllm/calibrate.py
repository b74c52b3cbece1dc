"""``streamspec vllm-calibrate``: the streams drafter's drafts a step by batch size, from a
measurement on this machine.

Speculation pays when the target's pass is memory-bound (few requests at once): a verification
pass of 1+K rows costs little more than one of 1 row. As more requests share each pass the pass
becomes compute-bound, every drafted row costs nearly as much as a decoded one, and drafting slows
the server. vLLM's ``num_speculative_tokens_per_batch_size`` picks the drafts a step by the number
of requests a step runs (0: no drafting at that size). This module measures tokens/s of vLLM plain
and of the streams drafter at each K and batch size (`streamspec.vllm.measure`, in vLLM's
environment), keeps, per batch size, the fastest K (0 where plain wins), and writes the
``--speculative-config`` JSON with that schedule beside a table of the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from .client import VLLMRunError, vllm_python
from .format import PEAGLE, draft_range, streams_speculative_config

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# steady: b requests decoding past their end, no prefix caching (the pass costs at a fixed batch
# size); serving: prompts in the prefix cache, each request ending at its end of sequence
WORKLOADS = ("steady", "serving")
QUICK = {"batch_sizes": (1, 2), "max_tokens": 8, "repeats": 1, "limit": 2}


def int_list(text: str, what: str, least: int = 0) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32], sorted and unique; raises naming `what` on anything else."""
    try:
        values = sorted({int(part) for part in str(text).split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"{what} must be integers separated by commas (e.g. 1,8,32), got {text!r}") from None
    if not values or values[0] < least:
        raise ValueError(f"{what} must be integers >= {least} separated by commas, got {text!r}")
    return values


def drafter_folder(source: str, out: Path) -> tuple[Path, dict]:
    """The vLLM drafter folder of `source` (an exported drafter folder, or a streamed checkpoint /
    ``streamspec:NAME``, exported into ``out/drafter``) and its config's ``streamspec`` section."""
    from .format import DRAFTER_FORMAT

    path = Path(source)
    config = path / "config.json"
    if config.is_file():
        facts = json.loads(config.read_text(encoding="utf-8")).get("streamspec")
        if isinstance(facts, dict) and facts.get("format") == DRAFTER_FORMAT:
            return path, facts
    from .export import export_for_vllm

    folder = export_for_vllm(source, out / "drafter")
    return folder, json.loads((folder / "config.json").read_text(encoding="utf-8"))["streamspec"]


def calibration_ks(facts: dict, ks=None) -> list[int]:
    """The drafts a step to measure for a drafter folder (`facts`: its config's ``streamspec``
    section): `ks` checked against what the folder can draft (`draft_range`; a folder with lookup
    drafts may draft past γ in the DFlash layout), or by default 0 (off) and every K from the
    fewest up to what the folder asks for."""
    streams, layout = int(facts["num_streams"]), facts.get("layout", PEAGLE)
    least, most = draft_range(streams, layout, bool(facts.get("lookup")))
    if ks is None:
        return [0] + list(range(least, min(most, int(facts.get("num_speculative_tokens") or most)) + 1))
    ks = int_list(",".join(map(str, ks)), "--ks")
    bad = [k for k in ks if 0 < k < least or k > most]
    if bad:
        raise ValueError(f"--ks {bad}: in the {layout} layout the streams drafter drafts 0 (off) or {least}..{most} "
                         f"a step (γ = {streams}{', with lookup drafts' if facts.get('lookup') else ''})")
    return ks


def choose_schedule(rows: list[dict], margin: float = 0.0) -> tuple[dict[int, int], list[list[int]]]:
    """Per measured batch size the fastest K (0 unless drafting beats plain vLLM by more than
    `margin`, a fraction), and vLLM's schedule for it: ``[[first, last, K], ...]``, each measured
    size's K holding up to the next measured size (the first range starts at 1, the last runs on:
    vLLM carries it to its largest batch), equal neighbours merged."""
    picks: dict[int, int] = {}
    for row in sorted(rows, key=lambda r: r["batch_size"]):
        figures = row["tokens_per_s"]
        drafting = {int(c[2:]): tps for c, tps in figures.items() if c.startswith("K=") and int(c[2:]) > 0
                    and row.get("identical", {}).get(c, True)}
        best = max(drafting, key=drafting.get) if drafting else 0
        picks[row["batch_size"]] = best if best and drafting[best] > figures["plain"] * (1 + margin) else 0
    sizes = sorted(picks)
    schedule: list[list[int]] = []
    for i, size in enumerate(sizes):
        first = 1 if i == 0 else size
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else max(size, sizes[-1])
        if schedule and schedule[-1][2] == picks[size]:
            schedule[-1][1] = last
        else:
            schedule.append([first, last, picks[size]])
    return picks, schedule


def speculative_config(drafter: str | Path, schedule: list[list[int]], layout: str = PEAGLE) -> dict:
    """The ``--speculative-config`` JSON of the streams drafter with `schedule`: vLLM's method for
    the folder's layout, K the schedule's largest (at least the fewest the layout drafts, what the
    drafter starts with; unused when every entry is 0)."""
    least = 2 if layout == PEAGLE else 1
    return streams_speculative_config(layout, drafter, max([least] + [int(k) for _, _, k in schedule]), schedule)


def format_table(result: dict, picks: dict[int, int]) -> str:
    """The measured tokens/s as a Markdown table: a row per batch size, a column per configuration,
    the chosen K, and the schedule's own run when there is one."""
    configs = list(result["rows"][0]["tokens_per_s"])
    checked = {c["batch_size"]: c for c in result.get("schedule_check") or []}
    head = ["batch size"] + [c if c == "plain" else f"streams {c}" for c in configs] + ["chosen K"]
    if checked:
        head.append("schedule")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        plain = row["tokens_per_s"]["plain"]
        cells = [str(row["batch_size"])]
        for c in configs:
            tps = row["tokens_per_s"][c]
            cells.append(f"{tps:.1f}" if c == "plain" else f"{tps:.1f} ({tps / plain:.2f}×)"
                         + ("" if row["identical"][c] else " NOT IDENTICAL"))
        cells.append(str(picks[row["batch_size"]]))
        if checked:
            check = checked[row["batch_size"]]
            cells.append(f"{check['tokens_per_s']:.1f} ({check['tokens_per_s'] / plain:.2f}×)"
                         + ("" if check["identical"] else " NOT IDENTICAL"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_prompts(base: str, task: str, prompts_file: str | None, limit: int) -> list[list[int]]:
    """The first `limit` prompts as token ids: `task`'s held-out rows, or a JSONL file's rows
    (``prompt`` / ``messages``, in the base's chat template; or ``prompt_ids``, token ids as they are)."""
    from ..data.build import prompt_ids
    from ..data.tasks import task_rows

    if prompts_file is not None:
        if not Path(prompts_file).is_file():
            raise FileNotFoundError(f"--prompts {prompts_file}: no such file (JSONL: a 'prompt', 'messages' or "
                                    "'prompt_ids' field a line)")
        with open(prompts_file, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()][:limit]
        if rows and all("prompt_ids" in r for r in rows):
            return [[int(t) for t in r["prompt_ids"]] for r in rows]
        if any(not ("prompt" in r or "messages" in r) for r in rows):
            raise ValueError(f"--prompts {prompts_file}: every line needs a 'prompt', 'messages' or 'prompt_ids' field")
    else:
        rows = task_rows(task, "test")[:limit]
    if not rows:
        raise ValueError(f"no prompts: {'--prompts ' + prompts_file if prompts_file else 'task ' + repr(task)} gave none")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    return [prompt_ids(tokenizer, row)[0].tolist() for row in rows]


def run_measure(spec: dict, log: Path, python: str | None = None, show_progress: bool = True) -> dict:
    """`streamspec.vllm.measure` in vLLM's environment, with a progress bar from its PROGRESS lines;
    vLLM's own output goes to `log` (its end is raised with a failure)."""
    from tqdm import tqdm

    exe = vllm_python(python)
    with tempfile.TemporaryDirectory(prefix="streamspec-calibrate-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        with log.open("w", encoding="utf-8") as log_file, \
                tqdm(total=1, desc="vllm-calibrate", unit="run", disable=not show_progress) as bar:
            proc = subprocess.Popen([str(exe), "-m", "streamspec.vllm.measure", str(spec_path), str(out_path)],
                                    stdout=subprocess.PIPE, stderr=log_file, text=True, env=dict(os.environ))
            for line in proc.stdout:
                parts = line.split(maxsplit=3)
                if len(parts) >= 3 and parts[0] == "PROGRESS":
                    bar.total = int(parts[2])
                    bar.n = int(parts[1])
                    bar.set_postfix_str(parts[3].strip() if len(parts) > 3 else "")
                    bar.refresh()
                else:
                    log_file.write(line)
            code = proc.wait()
        if code != 0:
            raise VLLMRunError(code, log.read_text(encoding="utf-8", errors="replace"))
        return json.loads(out_path.read_text(encoding="utf-8"))


def calibrate(checkpoint: str, out: str | Path, model: str | None = None, task: str = "sql",
              prompts_file: str | None = None, limit: int = 8, batch_sizes=DEFAULT_BATCH_SIZES, ks=None,
              max_tokens: int = 48, repeats: int = 2, margin: float = 0.03, max_model_len: int | None = None,
              workload: str = "steady", python: str | None = None, show_progress: bool = True) -> dict:
    """Measure, choose and write (see the module docstring). Returns ``{"speculative_config",
    "picks", "table", "measured", "files"}``; writes ``speculative_config.json`` and
    ``calibration.json`` into `out` (and ``drafter/`` when `checkpoint` is not a drafter folder)."""
    from ..assets import builtin_model_path

    if limit < 1 or max_tokens < 1 or repeats < 1:
        raise ValueError(f"--limit, --max-new-tokens and --repeats must be >= 1, got {limit}, {max_tokens}, {repeats}")
    if margin < 0:
        raise ValueError(f"--margin must be >= 0 (a fraction of plain vLLM's tokens/s), got {margin}")
    if workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    sizes = int_list(",".join(map(str, batch_sizes)), "--batch-sizes", least=1)
    vllm_python(python)  # before any work: raises naming `make vllm`
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    drafter, facts = drafter_folder(checkpoint, out)
    layout = facts.get("layout", PEAGLE)
    ks = calibration_ks(facts, ks)
    base = builtin_model_path(model or facts.get("base_name") or "")
    if not base:
        raise ValueError("the drafter folder names no base model: give it with --model")
    prompts = read_prompts(base, task, prompts_file, limit)
    spec = {"model": str(base), "drafter": str(drafter), "layout": layout, "prompts": prompts,
            "batch_sizes": sizes, "ks": ks, "max_tokens": max_tokens, "repeats": repeats,
            "max_model_len": max_model_len, "serving": workload == "serving"}
    measured = run_measure({**spec, "margin": margin}, out / "calibrate.log", python, show_progress)
    picks = {int(b): k for b, k in measured["picks"].items()}
    config = speculative_config(drafter, measured["schedule"], layout)
    table = format_table(measured, picks)
    (out / "speculative_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    record = {"speculative_config": config, "picks": {str(b): k for b, k in picks.items()}, "measured": measured["rows"],
              "schedule_check": measured["schedule_check"], "settings": {k: spec[k] for k in ("model", "drafter", "batch_sizes", "ks", "max_tokens", "repeats")}
              | {"prompts": len(prompts), "margin": margin, "task": task, "prompts_file": prompts_file, "workload": workload}}
    (out / "calibration.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return {"speculative_config": config, "picks": picks, "table": table, "measured": measured, "model": str(base),
            "files": [str(out / "speculative_config.json"), str(out / "calibration.json")]}


def add_command(sub) -> None:
    """``streamspec vllm-calibrate``'s arguments (`streamspec.cli`)."""
    cal = sub.add_parser("vllm-calibrate", help="measure the streams drafter in vLLM at each drafts-a-step K and batch "
                                                "size; write the --speculative-config with the fastest K per batch size")
    cal.add_argument("--checkpoint", required=True,
                     help="a streamed checkpoint (e.g. streamspec:smollm2-135m-sql-streams; exported into OUT/drafter) "
                          "or a drafter folder `streamspec export --format vllm` wrote")
    cal.add_argument("--model", default=None, help="the base vLLM serves (default: the one the streams were trained on)")
    cal.add_argument("--task", default="sql", choices=["sql", "summarize", "chat"], help="whose held-out prompts to decode")
    cal.add_argument("--prompts", default=None, metavar="FILE",
                     help="a JSONL file of prompts instead ('prompt' or 'messages' a line, or 'prompt_ids')")
    cal.add_argument("--limit", type=int, default=8, help="prompts to use (repeated when a batch needs more)")
    cal.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)), metavar="B,B,...",
                     help="requests at once to measure at (default: %(default)s)")
    cal.add_argument("--ks", default=None, metavar="K,K,...",
                     help="drafts a step to measure (default: 0 and every K the drafter's layout drafts: 1..γ for "
                          "DFlash, 2..γ+1 for P-EAGLE; 0 is the drafter off)")
    cal.add_argument("--max-new-tokens", type=int, default=48, help="tokens each request decodes a measurement")
    cal.add_argument("--repeats", type=int, default=2, help="timed rounds per measurement (the best is kept)")
    cal.add_argument("--margin", type=float, default=0.03,
                     help="draft at a batch size only when that beats plain vLLM by more than this fraction")
    cal.add_argument("--max-model-len", type=int, default=None)
    cal.add_argument("--workload", default="steady", choices=WORKLOADS,
                     help="steady: each batch size held by requests decoding --max-new-tokens past their end, no "
                          "prefix caching (what a pass costs); serving: the prompts in vLLM's prefix cache and each "
                          "request ending at its end of sequence, as a server's bursts of requests with shared "
                          "schemas or system prompts (give --max-new-tokens near your replies' length)")
    cal.add_argument("--quick", action="store_true",
                     help="a smoke run: batch sizes 1,2, 2 prompts, 8 tokens, 1 round (unless given)")
    cal.add_argument("--out", default="runs/vllm-calibrate",
                     help="folder for speculative_config.json, calibration.json and vLLM's log")


def run_command(args) -> int:
    """Run ``streamspec vllm-calibrate`` from its parsed arguments; prints the table and the config."""
    explicit = {a: getattr(args, a) for a in ("batch_sizes", "max_new_tokens", "repeats", "limit")}
    if args.quick:  # the quick settings, where a flag was left at its default
        defaults = {"batch_sizes": ",".join(map(str, DEFAULT_BATCH_SIZES)), "max_new_tokens": 48, "repeats": 2,
                    "limit": 8}
        quick = {"batch_sizes": ",".join(map(str, QUICK["batch_sizes"])), "max_new_tokens": QUICK["max_tokens"],
                 "repeats": QUICK["repeats"], "limit": QUICK["limit"]}
        explicit = {a: (quick[a] if v == defaults[a] else v) for a, v in explicit.items()}
    result = calibrate(args.checkpoint, args.out, model=args.model, task=args.task, prompts_file=args.prompts,
                       limit=explicit["limit"], batch_sizes=int_list(explicit["batch_sizes"], "--batch-sizes", least=1),
                       ks=None if args.ks is None else int_list(args.ks, "--ks"), max_tokens=explicit["max_new_tokens"],
                       repeats=explicit["repeats"], margin=args.margin, max_model_len=args.max_model_len,
                       workload=args.workload)
    print(result["table"])
    print(f"\nspeculative config ({result['files'][0]}):\n{json.dumps(result['speculative_config'])}")
    print(f"serve with: vllm serve {result['model']} --speculative-config \"$(cat {result['files'][0]})\"")
    return 0
