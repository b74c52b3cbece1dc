"""Building self-distilled sets (`streamspec.data.distill`): the model's own completions of the
task's prompts, decoded with streamspec's batch decoder.

`build_distilled_set` appends each finished batch to a JSONL file, so an interrupted build resumes
where it stopped; a ``.meta.json`` beside it records the model, the settings and the command, and
a build with other settings is refused rather than mixed into the same file.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..data.distill import META_SUFFIX, DistillArgs, model_key, row_key, distill_prompt_rows, distilled_set_path, read_distilled

logger = logging.getLogger(__name__)


def build_distilled_set(
    model: str,
    task: str,
    args: DistillArgs,
    out: str | Path | None = None,
    limit: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
) -> Path:
    """Decode the prompts of `args.sources` with `model` and append the completions to a JSONL.

    Args:
        model: the model whose outputs the set holds: any causal LM `load_for_inference` takes
            (the lossless streams will be trained on this model) or a streamed checkpoint.
        args.decoder: optionally a streamed checkpoint on the same base that decodes faster
            (greedy outputs are the base's own either way; with sampling, too, each token is
            drawn from the model's distribution).
        limit: only the first `limit` prompts (a quick look, or a small set).

    A file already there with the same model and settings is resumed (prompts done are
    skipped); one made otherwise is refused. Returns the file's path.
    """
    args.check_task(task)
    path = Path(out) if out is not None else distilled_set_path(model, task, args)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path):  # two runs sharing a cached set (streams and Medusa heads) take turns
        return _build(model, task, args, path, limit, device, dtype, progress)


def _build(model: str, task: str, args: DistillArgs, path: Path, limit: int | None, device: str, dtype: str,
           progress: bool) -> Path:
    from tqdm.auto import tqdm

    from ..data.build import prompt_ids

    meta = {"model": model_key(model), "task": task, "settings": args.settings()}
    meta_path = path.with_name(path.name + META_SUFFIX)
    if meta_path.is_file():
        recorded = json.loads(meta_path.read_text())
        if {k: recorded.get(k) for k in meta} != meta:
            raise ValueError(f"{path} was built with other settings ({meta_path}: {recorded}); "
                             f"give another output path or remove it")
    rows = distill_prompt_rows(task, args.sources, args.questions_per_database, args.seed)[:limit]
    if path.is_file():
        _drop_partial_line(path)
    done = {r["key"] for r in read_distilled(path)} if path.is_file() else set()
    tokenizer = _tokenizer(model)
    encoded = [(prompt_ids(tokenizer, r)[0], r, s) for r in rows for s, _, _ in args.plan()]
    if args.max_prompt_tokens is not None:
        kept = [e for e in encoded if len(e[0]) <= args.max_prompt_tokens]
        if len(kept) < len(encoded):
            logger.warning("distilled set: %d of %d prompts skipped, longer than max_prompt_tokens=%d",
                           len(encoded) - len(kept), len(encoded), args.max_prompt_tokens)
        encoded = kept
    # longest prompts first (padding stays small within a batch, and memory peaks at once)
    todo = sorted((e for e in encoded if row_key(e[1], e[2]) not in done), key=lambda e: -len(e[0]))
    path.parent.mkdir(parents=True, exist_ok=True)
    if not meta_path.is_file():  # the command that started the set (a resume keeps it)
        meta_path.write_text(json.dumps({**meta, "command": " ".join(sys.argv), "decoder": args.decoder,
                                         "server": args.server}, indent=2))
    if not todo:
        logger.warning("distilled set %s: complete, %d rows", path, len(done))
        return path

    start = time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"distilling {task}" + (f" on {args.server}" if args.server else ""),
               unit="prompt", disable=not progress)
    with path.open("a", encoding="utf-8") as handle:
        def write(row: dict, sample: int, text: str, ended: bool) -> None:
            record = {**{k: v for k, v in row.items() if k not in ("schema",)}, "completion": text,
                      "sample": sample, "ended": ended, "key": row_key(row, sample)}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")

        if args.server:
            written = _decode_on_server(args, tokenizer, todo, write, handle, bar)
        else:
            written = _decode_with_model(model, args, tokenizer, todo, write, handle, bar, device, dtype)
    bar.close()
    total = len(done) + written
    logger.warning("distilled set %s: %d rows (%d new in %.0f s); command: %s", path, total, written,
                   time.perf_counter() - start, " ".join(sys.argv))
    return path


def _decode_with_model(model: str, args: DistillArgs, tokenizer, todo, write, handle, bar, device, dtype) -> int:
    """Greedy (or sampled) completions of `todo` with streamspec's own batch decoder."""
    from ..config import StreamConfig
    from ..loading import load_for_inference
    from ..patch.model import add_streams

    loaded = load_for_inference(args.decoder or model, device=device, dtype=dtype)
    streamed = loaded.model if loaded.streamed else add_streams(loaded.model, StreamConfig(num_streams=1, mode="lossless"))
    if args.decoder:
        from ..patch.checkpoint import recorded_base

        base = recorded_base(args.decoder)
        if model_key(base) != model_key(model) or streamed.stream_config.mode != "lossless":
            raise ValueError(f"decoder {args.decoder} must hold lossless streams on {model} (it names base {base})")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    written = 0
    how = {s: (t, p) for s, t, p in args.plan()}
    # a batch decodes with one sampler: the greedy completions (with_greedy) apart from the sampled
    groups = [[e for e in todo if how[e[2]][0] == 0], [e for e in todo if how[e[2]][0] != 0]]
    for group in groups:
        written += _decode_group(streamed, loaded.device, args, tokenizer, pad, group, how, write, handle, bar)
    return written


def _decode_group(streamed, device, args: DistillArgs, tokenizer, pad: int, todo, how, write, handle, bar) -> int:
    """`_decode_with_model` for completions of one sampler's settings."""
    import torch

    from ..decoding.generate import generate

    written = 0
    for i in range(0, len(todo), args.batch_size):
        chunk = todo[i:i + args.batch_size]
        temperature, top_p = how[chunk[0][2]]
        width = max(len(ids) for ids, _, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (prompt, _, _) in enumerate(chunk):
            ids[j, width - len(prompt):] = prompt
            mask[j, width - len(prompt):] = 1
        seed = args.seed * 1_000_003 + i
        if len(chunk) == 1:
            ids, mask = ids[:, mask[0].bool()], None
        result = generate(streamed, ids.to(device), args.max_new_tokens, attention_mask=None if mask is None
                          else mask.to(device), temperature=temperature, top_p=top_p,
                          seed=seed, eos_token_id=tokenizer.eos_token_id, tree_top_k=1)
        lengths = result.lengths if getattr(result, "lengths", None) is not None else [result.tokens.shape[1]]
        for j, (_, row, sample) in enumerate(chunk):
            tokens = result.tokens[j, :lengths[j]].tolist()
            ended = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
            write(row, sample, tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True).strip(), ended)
            written += 1
        handle.flush()
        bar.update(len(chunk))
    return written


def server_completion(url: str, prompt: list[int], max_new_tokens: int, temperature: float, seed: int,
                      top_p: float = 1.0) -> tuple[str, bool]:
    """One completion of the token ids `prompt` from an OpenAI-compatible server: (text, ended),
    ended when the model stopped by itself (finish_reason 'stop') rather than at the limit."""
    from ..llamacpp import post_json

    answer = post_json(url.rstrip("/") + "/v1/completions", {
        "prompt": prompt, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
        "cache_prompt": True,
    })
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError) as err:
        raise RuntimeError(f"{url}/v1/completions answered without choices: {str(answer)[:300]}") from err
    return choice.get("text", "").strip(), choice.get("finish_reason") == "stop"


def _decode_on_server(args: DistillArgs, tokenizer, todo, write, handle, bar) -> int:
    """Completions of `todo` from `args.server` (a URL, or llama.cpp:GGUF started here), with
    `args.server_parallel` requests in flight; rows are written as they finish (a resume skips them)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed
    from contextlib import nullcontext

    from ..llamacpp import LlamaCppServer, parse_llama_cpp

    gguf = parse_llama_cpp(args.server)
    engine = (LlamaCppServer(gguf, threads=args.server_threads, parallel=args.server_parallel) if gguf
              else nullcontext(None))
    written = 0
    with engine as server, ThreadPoolExecutor(args.server_parallel) as pool:
        url = server.url if server is not None else args.server
        how = {s: (t, p) for s, t, p in args.plan()}
        futures = {pool.submit(server_completion, url, [int(t) for t in prompt], args.max_new_tokens, how[sample][0],
                               args.seed * 1_000_003 + i, how[sample][1]): (row, sample)
                   for i, (prompt, row, sample) in enumerate(todo)}
        for future in as_completed(futures):
            row, sample = futures[future]
            text, ended = future.result()
            write(row, sample, text, ended)
            handle.flush()
            written += 1
            bar.update(1)
    return written


@contextmanager
def _exclusive(path: Path):
    """Hold an exclusive lock on ``path.lock`` (POSIX; elsewhere no lock) while building."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with path.with_name(path.name + ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tokenizer(model: str):
    """The tokenizer of `model` (a streamed checkpoint's own, or the model's)."""
    from ..loading import is_streamed_checkpoint

    if Path(model).expanduser().is_dir() and is_streamed_checkpoint(Path(model).expanduser()):
        from ..patch.checkpoint import checkpoint_tokenizer

        return checkpoint_tokenizer(Path(model).expanduser())
    from ..assets import load_tokenizer

    return load_tokenizer(model)


def _drop_partial_line(path: Path) -> None:
    """Cut a half-written last line (a build killed while writing a batch): the rows before it stay."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        logger.warning("distilled set %s: dropping a half-written last row (%d bytes) before resuming", path, len(data) - end)
        with path.open("r+b") as handle:
            handle.truncate(end)


def distilled_rows(model: str, task: str, args: DistillArgs, split: str) -> list[dict]:
    """A recipe's distilled rows of one split: the ``train`` rows are every source but
    ``validation``; the ``validation`` rows are that source when distilled, else the task's
    labelled validation rows. Builds the set first when it is not cached."""
    if split == "validation" and "validation" not in args.sources:
        from ..data.distill import labelled_rows

        return labelled_rows(task, "validation")
    if args.path and Path(args.path).is_dir():  # a shard folder (`streamspec distill --engine vllm`): read as it is
        rows = _shard_folder_rows(Path(args.path), task)
    else:
        rows = read_distilled(build_distilled_set(model, task, args))
    wanted = {row_key(r, s) for r in distill_prompt_rows(task, args.sources, args.questions_per_database, args.seed)
              for s, _, _ in args.plan()}
    stale = [r for r in rows if r["key"] not in wanted]
    if stale:  # prompts the settings no longer make (templates changed since the set was started)
        logger.warning("distilled set: %d rows left out, their prompts are no longer in the set's sources", len(stale))
        rows = [r for r in rows if r["key"] in wanted]
    if split == "validation":
        return [r for r in rows if r["source"] == "validation"]
    return [r for r in rows if r["source"] != "validation"]


def _shard_folder_rows(folder: Path, task: str) -> list[dict]:
    """The rows of a shard folder distilled from `task`'s prompts (another task's folder is refused)."""
    from ..data.distill_shards import read_manifest

    made = (read_manifest(folder) or {}).get("settings", {}).get("task")
    if made != task:
        raise ValueError(f"data.distill.path {folder} holds prompts of {made or 'registry sources'!r}, not of task "
                         f"{task!r} (a chat set trains with data.task: custom, data.path: {folder})")
    return read_distilled(folder)


def server_agreement(model: str, task: str, args: DistillArgs, count: int = 20, device: str = "auto",
                     dtype: str = "auto") -> dict:
    """How often a server's greedy completions equal the model's own (streamspec's decoder) on the
    first `count` prompts of the set's sources: the share of identical completions and the mean
    share of each completion's tokens before the first difference."""
    import dataclasses

    from ..data.build import prompt_ids

    if not args.server:
        raise ValueError("server_agreement compares a server with the model: set args.server")
    greedy = dataclasses.replace(args, temperature=0.0, top_p=1.0, samples=1, with_greedy=False)
    rows = distill_prompt_rows(task, args.sources, args.questions_per_database, args.seed)
    tokenizer = _tokenizer(model)
    todo = [(prompt_ids(tokenizer, r)[0], r, 0) for r in rows]
    if args.max_prompt_tokens is not None:
        todo = [e for e in todo if len(e[0]) <= args.max_prompt_tokens]
    todo = todo[:count]
    texts: dict[str, dict[str, str]] = {"server": {}, "model": {}}

    class _Sink:
        def flush(self) -> None:
            pass

    class _Bar:
        def update(self, n: int) -> None:
            pass

    for name in texts:
        def write(row, sample, text, ended, name=name):
            texts[name][row_key(row, sample)] = text

        if name == "server":
            _decode_on_server(greedy, tokenizer, todo, write, _Sink(), _Bar())
        else:
            _decode_with_model(model, dataclasses.replace(greedy, server=None), tokenizer, todo, write, _Sink(), _Bar(),
                               device, dtype)
    identical, prefix = 0, []
    for key, own in texts["model"].items():
        other = texts["server"][key]
        identical += own == other
        a, b = tokenizer(own, add_special_tokens=False).input_ids, tokenizer(other, add_special_tokens=False).input_ids
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(common / max(len(a), 1))
    return {"server": args.server, "compared": len(todo), "identical": identical,
            "identical_share": round(identical / max(len(todo), 1), 3),
            "mean_common_prefix_share": round(sum(prefix) / max(len(prefix), 1), 3)}
