"""The trained peers of the vLLM rows: EAGLE-3 and P-EAGLE drafters for a model, trained by vLLM's
own training library (speculators) on the same self-distilled set the streams train on.

`distilled_examples` makes token rows of a distilled set (`streamspec.data.distill.read_distilled`)
exactly as the streams' training does (`streamspec.data.build.tokenize_rows`: the model's
chat template around the prompt, then the model's own completion ids; the loss on the completion);
`train_peer_drafter` hands them to `streamspec.vllm.peer_training` in vLLM's environment (where
speculators lives) and returns its report. The drafter folder it writes is what
``streamspec eval --peers vllm_eagle3 --eagle3 FOLDER`` (or vLLM itself, as
``{"method": "eagle3", "model": FOLDER, "num_speculative_tokens": K}``) decodes with.

    python eval/train_peer_drafters.py --distilled DIR --method eagle3 --max-seconds 600
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

METHODS = ("eagle3", "peagle")
PEER_OF = {"eagle3": "vllm_eagle3", "peagle": "vllm_peagle"}
MAX_LENGTH = 768  # the SQL recipes' data.max_length: longer rows are dropped, as the streams' training drops them


def distilled_examples(model: str, distilled: str | Path | list, max_length: int = MAX_LENGTH,
                       max_rows: int | None = None, seed: int = 0, shuffle: bool = True) -> tuple[list[dict], dict]:
    """The distilled set's rows (or several sets', in order) as ``{"input_ids", "loss_mask"}``
    (loss on the completion), with the counts: rows read, kept, dropped for length. `max_rows`:
    the first N after a seeded shuffle (a set is ordered by source), or with ``shuffle=False`` the
    first N in the sets' own order (the rows a streams recipe's ``data.max_train_examples: N``
    trains on)."""
    from transformers import AutoTokenizer

    from ..assets import builtin_model_path
    from ..data.build import tokenize_rows
    from ..data.distill import read_distilled

    sets = distilled if isinstance(distilled, (list, tuple)) else [distilled]
    if not sets:
        raise ValueError("name at least one distilled set")
    rows = [row for one in sets for row in read_distilled(one)]
    if shuffle:
        random.Random(seed).shuffle(rows)
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path(model))
    examples, stats = tokenize_rows(rows, tokenizer, max_length=max_length, overflow="drop")
    if max_rows is not None:
        examples = examples[:max_rows]
    out = [{"input_ids": [int(t) for t in e["input_ids"]], "loss_mask": [int(label != -100) for label in e["labels"]]}
           for e in examples]
    return out, {"distilled_rows": len(rows), "kept": stats.kept, "dropped_too_long": stats.dropped_too_long,
                 "dropped_no_completion": stats.dropped_no_completion, "used": len(out), "max_length": max_length}


def train_peer_drafter(model: str, examples: list[dict], out: str | Path, method: str = "eagle3",
                       work: str | Path | None = None, python: str | None = None, env: dict[str, str] | None = None,
                       timeout: float | None = None, data: dict | None = None, **settings) -> dict:
    """Train a `method` drafter (eagle3 or peagle) for `model` on `examples` in vLLM's environment;
    the drafter folder (speculators' config.json and model.safetensors, with ``training.json``)
    goes to `out`, speculators' data, checkpoints and log to `work` (default ``OUT-work``; a
    `work` that keeps the hidden states of the same rows, ``keep_hidden_states=True``, lends them
    to the next method). `settings`: `streamspec.vllm.peer_training.DEFAULTS` (max_steps,
    max_seconds, epochs, ...); `data`: what the rows are (`distilled_examples`' counts), kept in
    the report. Returns the report (also in ``OUT/training.json``); a failure raises with the
    log's end."""
    from ..assets import builtin_model_path
    from ..vllm.client import VLLMRunError, vllm_python

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not examples:
        raise ValueError("no rows to train on")
    out = Path(out)
    work = Path(work) if work is not None else out.with_name(out.name + "-work")
    if out.exists():
        if any(out.iterdir()) and not (out / "training.json").is_file():
            raise FileExistsError(f"{out} exists and holds no trained drafter: choose another folder")
        shutil.rmtree(out)
    work.mkdir(parents=True, exist_ok=True)
    rows = work / "rows.jsonl"
    with rows.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example) + "\n")
    spec = {"model": builtin_model_path(model), "rows": str(rows), "out": str(out), "work": str(work),
            "method": method, "data": data or {}, **settings}
    spec_path = work / f"spec-{method}.json"
    spec_path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
    log = work / f"train-{method}.log"
    with log.open("w", encoding="utf-8") as handle:
        proc = subprocess.run([str(vllm_python(python)), "-m", "streamspec.vllm.peer_training", str(spec_path)],
                              stdout=handle, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if proc.returncode != 0:
        raise VLLMRunError(proc.returncode, log.read_text(encoding="utf-8", errors="replace"))
    return json.loads((out / "training.json").read_text(encoding="utf-8"))


def summary_line(report: dict) -> str:
    """One line of a report's figures."""
    seconds = report["seconds"]
    return (f"{report['method']}: {report['trained_parameters']:,} parameters trained, {report['steps']} steps, "
            f"{report['tokens_seen']:,} tokens seen ({report['loss_tokens_seen']:,} in the loss), "
            f"{seconds['training']:.0f} s training, {seconds['total']:.0f} s in all (hidden states "
            f"{seconds['hidden_states']:.0f} s); stopped: {report['stopped']}")
