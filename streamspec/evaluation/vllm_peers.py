"""vLLM as the benchmark's peer: plain, with its n-gram drafter, with its suffix decoding (suffix
trees of the prompt and the output so far; arctic-inference's, which `make vllm` builds), with
the streams as its drafter (`streamspec.vllm`), and with the EAGLE-3 / P-EAGLE drafters vLLM's own
training library trained for the model (``vllm_eagle3`` / ``vllm_peagle``: their folders come
from `streamspec.evaluation.peer_drafters`, ``eval/train_peer_drafters.py``), one request at a
time and `CONCURRENT` at once.

The rows run in vLLM's own environment through a subprocess (`streamspec.vllm.client`), each on
a fresh engine, on the same prompts (token ids) and with the same number of new tokens as the
benchmark's other rows. Each row reports tokens/s, its speedup over the benchmark's baseline
(transformers `generate`), vLLM's mean acceptance length (1 + accepted ÷ drafts, from vLLM's own
counters), whether its outputs equal vLLM's without speculation at the same concurrency
(``identical_to_vllm``) and whether they equal the baseline's (``identical_to_baseline``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

VLLM_PEERS = ("vllm", "vllm_ngram", "vllm_suffix", "vllm_streams", "vllm_eagle3", "vllm_peagle")
CONCURRENT = 8
DRAFTERS = {"vllm": "none", "vllm_ngram": "ngram", "vllm_suffix": "suffix", "vllm_streams": "streams",
            "vllm_streams_schedule": "streams", "vllm_eagle3": "eagle3", "vllm_peagle": "peagle"}
# vllm_streams_schedule: the streams with drafts by batch size (`streamspec.vllm.schedule`; `streamspec
# vllm-calibrate` writes one), a row beside vllm_streams when the benchmark is given a schedule
# the rows whose drafter is a trained folder the benchmark is given (--eagle3 / --peagle)
TRAINED_PEERS = {"vllm_eagle3": "eagle3", "vllm_peagle": "peagle"}
NGRAM_TOKENS = 4  # vLLM's n-gram drafter: drafts a pass (its prompt_lookup_max as well)
# vLLM's suffix decoding runs with `streamspec.vllm.run.SUFFIX_DEFAULTS` (at most 8 drafts a pass, as
# far as its match supports; no global tree of earlier responses)


def vllm_base(name_or_path: str) -> str:
    """The folder (or hub id) vLLM loads for a checkpoint's base: streamspec's built-in ids
    (``streamspec:SmolLM2-135M-Instruct``) are the converted folders in the model cache."""
    from ..assets import builtin_model_path

    return builtin_model_path(name_or_path)


def check_trained_drafters(peers, drafters: dict[str, str] | None) -> dict[str, str]:
    """The drafter folder of each trained peer asked for (``vllm_eagle3`` → ``drafters["eagle3"]``):
    raises, naming how to train one, when a folder is not given or holds no such drafter."""
    from ..vllm.run import check_drafter_folder

    drafters = drafters or {}
    folders = {}
    for peer, drafter in TRAINED_PEERS.items():
        if peer in (peers or ()):
            if not drafters.get(drafter):
                raise ValueError(f"{peer} decodes with a trained {drafter} drafter: give its folder (streamspec eval "
                                 f"--{drafter} FOLDER; train one with `python eval/train_peer_drafters.py --method "
                                 f"{drafter} --distilled DIR`)")
            folders[peer] = check_drafter_folder(drafter, str(drafters[drafter]))
    return folders


def vllm_rows(peers, checkpoint: str, base: str, prompts: list[list[int]], max_new_tokens: int,
              baseline_outputs: list[list[int]], baseline_tps: float, dtype: str = "float32",
              concurrency: tuple[int, ...] = (1, CONCURRENT),
              drafters: dict[str, str] | None = None, schedule: list | None = None,
              streams_folder: str | None = None) -> dict[str, dict]:
    """The vLLM rows the benchmark asked for (`peers` ∩ `VLLM_PEERS`), named ``PEER`` (one at a
    time) and ``PEER@N`` (N at once). Plain vLLM always runs when another vLLM row does (the
    others are compared with it). `drafters`: the trained drafters' folders (``{"eagle3": FOLDER,
    "peagle": FOLDER}``) of the ``vllm_eagle3`` / ``vllm_peagle`` rows. Returns {} with a note when
    vLLM's environment is missing; raises when ``vllm_suffix`` is asked for and that environment
    lacks arctic-inference, or a trained row's folder is missing. `schedule`: vLLM's
    ``num_speculative_tokens_per_batch_size`` for the streams: with ``vllm_streams`` asked for, a
    ``vllm_streams_schedule`` row decodes with it too. `streams_folder`: the streams rows' drafter
    folder (`streamspec export --format vllm`, e.g. another layout or a pruned draft vocabulary)
    instead of the checkpoint exported in the default layout."""
    from ..vllm.client import check_suffix_decoding, run_vllm, vllm_python
    from ..vllm.export import streams_parameters

    wanted = [p for p in VLLM_PEERS if p in peers]
    if not wanted:
        return {}
    folders = check_trained_drafters(wanted, drafters)  # before any engine starts
    try:
        vllm_python()
    except FileNotFoundError as err:
        print(f"peers: {err}; no vLLM rows")
        return {}
    if "vllm_suffix" in wanted:
        check_suffix_decoding()  # before any engine starts: raises with the fix (`make vllm`)
    if "vllm" not in wanted:
        wanted.insert(0, "vllm")
    if schedule and "vllm_streams" in wanted:
        wanted.insert(wanted.index("vllm_streams") + 1, "vllm_streams_schedule")
    with tempfile.TemporaryDirectory(prefix="streamspec-vllm-drafter-") as tmp:
        runs = []
        for peer in wanted:
            run = {"drafter": DRAFTERS[peer]}
            if peer == "vllm_streams":
                from ..vllm.export import export_for_vllm

                run["folder"] = streams_folder or str(export_for_vllm(checkpoint, tmp))
            if peer == "vllm_streams_schedule":
                run.update(folder=runs[-1]["folder"], schedule=schedule)
            if peer in folders:
                run["folder"] = folders[peer]
            if peer == "vllm_ngram":
                run.update(num_speculative_tokens=NGRAM_TOKENS, prompt_lookup_max=NGRAM_TOKENS)
            runs += [{**run, "name": _name(peer, n), "concurrency": n} for n in concurrency]
        spec = {"model": base, "dtype": dtype, "prompts": prompts, "max_tokens": max_new_tokens, "runs": runs}
        # a limit that grows with the work: a run decodes every prompt, one at a time at worst
        timeout = max(1800, RUN_SECONDS_PER_PROMPT * len(prompts) * len(runs))
        results = {r["name"]: r for r in run_vllm(spec, timeout=timeout)["runs"]}
    trained = {peer: drafter_facts(folders[peer]) for peer in folders}
    if "vllm_streams" in wanted:
        # a folder of its own may hold other streams than the checkpoint's (e.g. ones that read the next token)
        facts = {"draft_parameters": streams_parameters(streams_folder)} if streams_folder else streams_facts(checkpoint)
        trained["vllm_streams"] = trained["vllm_streams_schedule"] = facts
    rows = {}
    for name, result in results.items():
        plain = results[_name("vllm", result["concurrency"])]["outputs"]
        rows[name] = {
            "tokens_per_second": round(result["tokens_per_s"], 2),
            "speedup": round(result["tokens_per_s"] / baseline_tps, 3) if baseline_tps else None,
            "mean_acceptance_length": None if result["mean_acceptance_length"] is None
            else round(result["mean_acceptance_length"], 3),
            "acceptance_per_position": None if not result.get("acceptance_per_position")
            else [round(a, 3) for a in result["acceptance_per_position"]],
            "num_speculative_tokens": result.get("num_speculative_tokens"),
            **trained.get(name.split("@")[0], {}),
            "identical_to_vllm": result["outputs"] == plain,
            "identical_to_baseline": result["outputs"] == baseline_outputs,
            "concurrency": result["concurrency"],
            "tokens": result["tokens"],
            "seconds": round(result["seconds"], 3),
        }
    return rows


def drafter_facts(folder: str) -> dict:
    """A trained peer's parameters and training time (its ``training.json``, from
    `streamspec.vllm.peer_training`); {} when the folder has none."""
    import json

    path = Path(folder) / "training.json"
    if not path.is_file():
        return {}
    report = json.loads(path.read_text(encoding="utf-8"))
    return {"draft_parameters": report.get("trained_parameters"),
            "training_seconds": (report.get("seconds") or {}).get("training"),
            "training_tokens": report.get("tokens_seen")}


def streams_facts(checkpoint: str) -> dict:
    """The streams' parameters (their weights file) and, when the checkpoint is a training run's
    ``final`` folder, that run's training time (``training_summary.json`` beside it)."""
    import json

    from ..assets import shipped_or_path
    from .capacity import added_parameters

    folder = Path(shipped_or_path(checkpoint))
    facts = {"draft_parameters": added_parameters(folder)}
    summary = folder.parent / "training_summary.json"
    if summary.is_file():
        run = json.loads(summary.read_text(encoding="utf-8"))
        facts["training_seconds"] = run.get("wall_seconds")
        facts["training_tokens"] = run.get("tokens_seen")
    return facts
def add_vllm_arguments(parser) -> None:
    """`streamspec eval`'s options of the vLLM rows."""
    parser.add_argument("--vllm-schedule", default=None, metavar="FILE",
                        help="with vllm_streams: also the vllm_streams_schedule row, the streams drafting by batch "
                             "size (the speculative_config.json `streamspec vllm-calibrate` writes, or a JSON list)")
    parser.add_argument("--vllm-streams", default=None, metavar="FOLDER",
                        help="the vllm_streams rows' drafter folder (`streamspec export --format vllm`, e.g. with "
                             "--draft-vocab or another --layout; default: the checkpoint exported in the default layout)")
    parser.add_argument("--vllm-concurrency", type=int, nargs="+", default=[1, CONCURRENT], metavar="N",
                        help="the vLLM rows' requests at once, one run of each row at each (default: 1 8; e.g. 1 8 32)")


def check_concurrency(concurrency) -> tuple[int, ...]:
    """Requests at once for the vLLM rows, each >= 1 (raises naming what is allowed)."""
    if not concurrency or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in concurrency):
        raise ValueError(f"the vLLM rows' concurrency must be requests at once, each >= 1 (e.g. 1 8 32), "
                         f"got {concurrency!r}")
    return tuple(concurrency)


def vllm_options(args) -> dict:
    """`vllm_rows`' options from `streamspec eval`'s arguments, read and checked."""
    from ..vllm.schedule import load_schedule

    options = {"concurrency": check_concurrency(args.vllm_concurrency)}
    if args.vllm_schedule:
        options["schedule"] = load_schedule(args.vllm_schedule)
    if args.vllm_streams:
        from ..vllm.export import check_drafter_folder

        if not (Path(args.vllm_streams) / "config.json").is_file():
            raise ValueError(f"--vllm-streams {args.vllm_streams}: no drafter folder there (write one with "
                             "`streamspec export --format vllm --checkpoint CKPT --out FOLDER`)")
        check_drafter_folder(args.vllm_streams)
        options["streams_folder"] = str(args.vllm_streams)
    return options


# the vLLM process's time limit, per prompt of each run (a one-at-a-time run of 96 new tokens at 5
# tokens/s takes ~20 s a prompt on a slow 2-core machine); a table of 21 runs of 32 prompts ran
# past a fixed 30 minutes
RUN_SECONDS_PER_PROMPT = 60


def _name(peer: str, concurrency: int) -> str:
    return peer if concurrency == 1 else f"{peer}@{concurrency}"


COLUMNS = [
    {"key": "method", "label": "row"},
    {"key": "concurrency", "label": "requests at once"},
    {"key": "tokens_per_second", "label": "tokens/s", "format": "{:.1f}"},
    {"key": "x_vllm", "label": "× vLLM plain", "format": "{:.2f}×"},
    {"key": "mean_acceptance_length", "label": "mean acceptance length", "format": "{:.2f}"},
    {"key": "acceptance_per_position", "label": "accepted per draft position", "format": "{:.2f}"},
    {"key": "draft_parameters", "label": "drafter parameters", "format": "{:,}"},
    {"key": "training_seconds", "label": "training (s)", "format": "{:.0f}"},
    {"key": "training_tokens", "label": "tokens trained on", "format": "{:,}"},
    {"key": "identical", "label": "identical to vLLM plain"},
]


def result_table(summary: dict, **facts) -> dict:
    """A docs/results file (`streamspec.evaluation.results`) of the vLLM rows of a benchmark
    summary (``streamspec eval --out``'s ``benchmark.json``), each row's tokens/s also as a
    multiple of plain vLLM's at the same concurrency. `facts`: title, command, machine, threads,
    date, note, plot_positions (the name of its acceptance-per-position figure)."""
    summary = summary.get("methods", summary)
    rows = []
    for name, entry in summary.items():
        if "identical_to_vllm" not in entry:
            continue
        plain = summary[_name("vllm", entry["concurrency"])]["tokens_per_second"]
        rows.append({"method": name.split("@")[0], "concurrency": entry["concurrency"],
                     "tokens_per_second": entry["tokens_per_second"],
                     "x_vllm": round(entry["tokens_per_second"] / plain, 3) if plain else None,
                     "mean_acceptance_length": entry["mean_acceptance_length"],
                     "acceptance_per_position": entry.get("acceptance_per_position"),
                     "draft_parameters": entry.get("draft_parameters"),
                     "training_seconds": entry.get("training_seconds"), "training_tokens": entry.get("training_tokens"),
                     "identical": entry["identical_to_vllm"]})
    if not rows:
        raise ValueError("the summary has no vLLM rows: run streamspec eval with "
                         "--peers vllm,vllm_ngram,vllm_suffix,vllm_streams[,vllm_eagle3 --eagle3 FOLDER]")
    rows.sort(key=lambda r: (r["concurrency"], list(DRAFTERS).index(r["method"])))
    for column in ("acceptance_per_position", "draft_parameters", "training_seconds", "training_tokens"):
        if all(r[column] is None for r in rows):  # a table of untrained drafters: no such column
            for r in rows:
                del r[column]
    columns = [c for c in COLUMNS if c["key"] in rows[0] or c["key"] == "method"]
    table = {**facts, "columns": columns, "rows": rows}
    if "acceptance_per_position" not in rows[0]:
        table.pop("plot_positions", None)  # nothing to draw
    return table
