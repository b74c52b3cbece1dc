"""Self-distilled training sets: the model's own completions of many prompts.

Lossless streams are accepted against the model's *own* tokens, so what they should learn is the
model's continuation of its own text, not the labelled answer. A distilled set pairs prompts with
the model's completions (greedy, or sampled):

- ``train``: the task's training prompts (the labelled completions are thrown away);
- ``validation``: the task's validation prompts (for validating on the model's own text);
- ``unused_databases`` (SQL only): the Spider schemas that no split uses (146 of the 166 in
  ``tables.json``), with questions written from templates over each schema's tables and columns
  (`template_questions`).
- ``schema_questions`` and ``self_instruct`` (SQL only): the model's own questions about those
  schemas, and its SQL for them (`streamspec.data.self_instruct`; ``self_instruct`` reads the
  questions from a ``schema_questions`` set, `questions_from`).

SQL sources also come with the schema in another style of `streamspec.data.schema_styles`:
``SOURCE@STYLE`` (``train@untyped``, ``unused_databases@compact``, ...; ``@spider`` is the source
itself), the same questions over the same databases, so that the set holds the model's SQL for
schemas written the ways users write them.

`streamspec.training.distill.build_distilled_set` decodes them with streamspec's own batch
decoder and appends each finished batch to a JSONL file; `distilled_set_path` names the cached
file a recipe's ``data.distill`` section uses.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

SOURCES = {"sql": ("train", "validation", "unused_databases", "schema_questions", "self_instruct"),
           "summarize": ("train", "validation"), "gsm8k_solutions": ("train", "validation")}
#: the SQL sources that also come as SOURCE@STYLE (the others are not SQL prompts over a schema)
STYLED_SOURCES = ("train", "validation", "unused_databases", "self_instruct")
META_SUFFIX = ".meta.json"


@dataclass
class DistillArgs:
    """A recipe's ``data.distill`` section: train on the model's own completions of the task's
    prompts instead of the labelled ones (lossless streams; see `streamspec.data.distill`)."""

    enabled: bool = False
    sources: list[str] = field(default_factory=lambda: ["train"])
    questions_per_database: int = 4  # unused_databases: template questions per schema
    samples: int = 1  # completions per prompt (>1 needs temperature > 0)
    # with temperature > 0: each prompt's greedy completion too (sample 0), the `samples`
    # sampled ones after it (samples 1..samples): the model's own text and varied text beside it
    with_greedy: bool = False
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling of the sampled completions
    max_new_tokens: int = 160
    # prompts longer than this many tokens are skipped (and counted): keep it within the
    # recipe's data.max_length, or their examples are dropped after costing a decode
    max_prompt_tokens: int | None = None
    batch_size: int = 8
    seed: int = 0
    path: str | None = None  # where the set is kept; default: the cache (`distilled_set_path`)
    # a streamed checkpoint of the same model to decode faster with; outputs are the model's own
    decoder: str | None = None
    # decode on an OpenAI-compatible server instead (URL of vLLM, SGLang, `streamspec serve`...,
    # or llama.cpp:GGUF for a local llama.cpp server): the text may differ from the
    # model's own greedy text where the server's weights are quantised; with stream_targets:
    # main the targets are still the model's own predictions on that text
    server: str | None = None
    server_threads: int = 1  # llama.cpp:GGUF only
    server_parallel: int = 4  # requests in flight (llama.cpp: its slots)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("data.distill.sources must name at least one source")
        if self.samples < 1:
            raise ValueError(f"data.distill.samples must be >= 1, got {self.samples!r}")
        if self.samples > 1 and self.temperature <= 0:
            raise ValueError("data.distill.samples > 1 needs data.distill.temperature > 0 (greedy completions repeat)")
        if self.temperature < 0:
            raise ValueError(f"data.distill.temperature must be >= 0, got {self.temperature!r}")
        if self.with_greedy and self.temperature <= 0:
            raise ValueError("data.distill.with_greedy adds the greedy completion to sampled ones: it needs "
                             "data.distill.temperature > 0 (greedy completions alone are the default)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"data.distill.top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"data.distill.max_prompt_tokens must be >= 1 or null, got {self.max_prompt_tokens!r}")
        if self.server is not None and self.decoder is not None:
            raise ValueError("data.distill.server and data.distill.decoder are exclusive: the text comes from one engine")
        for name in ("questions_per_database", "max_new_tokens", "batch_size", "server_threads", "server_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.distill.{name} must be >= 1, got {getattr(self, name)!r}")

    def plan(self) -> list[tuple[int, float, float]]:
        """Each prompt's completions: (sample index, temperature, top_p); the greedy one first
        with `with_greedy`."""
        sampled = [(s, self.temperature, self.top_p) for s in range(self.samples)]
        if not self.with_greedy:
            return sampled
        return [(0, 0.0, 1.0)] + [(s + 1, t, p) for s, t, p in sampled]

    def check_task(self, task: str) -> None:
        allowed = SOURCES.get(task)
        if allowed is None:
            raise ValueError(f"data.distill works with data.task in {sorted(SOURCES)}, not {task!r}")
        unknown = [s for s in self.sources if not _known_source(task, s)]
        if unknown:
            styles = (f"; {list(STYLED_SOURCES)} also as SOURCE@STYLE, STYLE one of "
                      f"{list(_schema_styles())}" if task == "sql" else "")
            raise ValueError(f"data.distill.sources {unknown} are not sources of task {task!r}; allowed: "
                             f"{list(allowed)}{styles}")

    def settings(self) -> dict:
        """What decides the set's content (the cache key, with the model and the task)."""
        keep = ("sources", "questions_per_database", "samples", "temperature", "max_new_tokens", "max_prompt_tokens", "seed")
        settings = {k: v for k, v in asdict(self).items() if k in keep}
        if self.top_p != 1.0:
            settings["top_p"] = self.top_p
        if self.with_greedy:
            settings["with_greedy"] = True
        if self.server is not None:  # another engine's text is another set
            settings["server"] = self.server
        return settings


def _schema_styles() -> tuple[str, ...]:
    from .schema_styles import SCHEMA_STYLES

    return SCHEMA_STYLES


def split_source(source: str) -> tuple[str, str | None]:
    """``SOURCE@STYLE`` -> (SOURCE, STYLE); a plain source -> (source, None)."""
    base, at, style = source.partition("@")
    return (base, style) if at else (source, None)


def _known_source(task: str, source: str) -> bool:
    base, style = split_source(source)
    if base not in SOURCES.get(task, ()):
        return False
    return style is None or (task == "sql" and base in STYLED_SOURCES and style in _schema_styles())


# ----------------------------------------------------------------------------- prompts

def _words(name: str) -> str:
    """An original (SQL) name as words: snake_case and camelCase split, lower case."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).replace("_", " ").lower()


def _natural(schema: dict) -> tuple[list[str], dict[int, list[tuple[str, str]]], list[list]]:
    """Natural-language table names, each table's (column name, type) without '*', and the
    column list their indices refer to. A few tables.json entries list the natural-language
    table names in another order than the original ones (scholar, store_1, formula_1): those
    take names made from the original names instead, so a question names the table it means."""
    natural, original = schema["table_names"], schema["table_names_original"]
    position = {name.lower(): i for i, name in enumerate(original)}
    aligned = all(position.get(name.lower().replace(" ", "_"), i) == i for i, name in enumerate(natural))
    if aligned:
        tables, columns = list(natural), schema["column_names"]
    else:
        tables = [_words(name) for name in original]
        columns = [[owner, _words(name) if owner >= 0 else name] for owner, name in schema["column_names_original"]]
    by_table: dict[int, list[tuple[str, str]]] = {}
    for (owner, name), kind in zip(columns, schema["column_types"]):
        if owner >= 0:
            by_table.setdefault(owner, []).append((name, kind))
    return tables, by_table, columns


def template_questions(schema: dict, count: int, seed: int = 0) -> list[str]:
    """`count` distinct questions about one Spider schema, written from templates over its tables
    and columns (natural-language names from ``tables.json``): counts, listings, aggregates,
    filters, grouping, ordering and joins along foreign keys. Deterministic for a seed."""
    rng = random.Random(f"{schema['db_id']}:{seed}")
    tables, columns, names = _natural(schema)
    candidates: list[str] = []
    hidden = {t for t, name in enumerate(schema["table_names_original"]) if name.lower().startswith("sqlite_")}
    for t, table in enumerate(tables):
        cols = columns.get(t, [])
        if not cols or t in hidden:  # SQLite's bookkeeping table is not in the prompt's schema
            continue
        text = [c for c, k in cols if k == "text"] or [c for c, _ in cols]
        numbers = [c for c, k in cols if k == "number"]
        a, b = rng.choice(text), rng.choice([c for c, _ in cols])
        candidates += [
            f"How many {table} are there?",
            f"List the {a} of all {table}.",
            f"What are the {a} and {b} of each {table}?",
            f"Show the distinct {a} values of {table}.",
            f"How many {table} are there for each {a}?",
            f"Which {a} appears most often among the {table}?",
        ]
        if numbers:
            n = rng.choice(numbers)
            agg = rng.choice(["average", "maximum", "minimum", "total"])
            candidates += [
                f"What is the {agg} {n} of all {table}?",
                f"Show the {a} of {table} whose {n} is greater than {rng.choice([10, 20, 50, 100])}.",
                f"List the {a} of {table} ordered by {n} in descending order.",
                f"What is the {a} of the {table} with the highest {n}?",
                f"For each {a}, what is the {agg} {n} of the {table}?",
            ]
    for src, dst in schema["foreign_keys"]:
        t_src, t_dst = names[src][0], names[dst][0]
        if t_src == t_dst or t_src in hidden or t_dst in hidden:
            continue
        a = rng.choice([c for c, _ in columns.get(t_src, [(names[src][1], "")])])
        b = rng.choice([c for c, _ in columns.get(t_dst, [(names[dst][1], "")])])
        candidates += [
            f"Show the {a} of each {tables[t_src]} together with the {b} of its {tables[t_dst]}.",
            f"How many {tables[t_src]} does each {tables[t_dst]} have? Show the {b} and the count.",
        ]
    unique = list(dict.fromkeys(candidates))
    rng.shuffle(unique)
    return unique[:count]


def unused_spider_rows(questions_per_database: int = 4, seed: int = 0, style: str = "spider") -> list[dict]:
    """Prompts over the Spider databases that no split uses: `template_questions` for each, the
    schema in `style` (`streamspec.data.schema_styles`)."""
    from .schema_styles import render_schema
    from .spider import _schemas, spider_dir, sql_prompt

    used = {r["db_id"] for r in json.loads((spider_dir() / "dev.json").read_text())}
    rows = []
    for db_id, schema in sorted(_schemas().items()):
        if db_id in used:
            continue
        statements = render_schema(schema, style, seed)
        for question in template_questions(schema, questions_per_database, seed):
            rows.append({"db_id": db_id, "question": question, "prompt": sql_prompt(statements, question)})
    return rows


def labelled_rows(task: str, split: str) -> list[dict]:
    """A built-in task's labelled rows of one split (the registry: `streamspec.data.tasks`)."""
    from .tasks import task_rows

    return task_rows(task, split)


def distill_prompt_rows(task: str, sources: list[str], questions_per_database: int = 4, seed: int = 0,
                        questions_from: str | Path | None = None) -> list[dict]:
    """The prompts of a distilled set, source by source (each row keeps its ``source``).
    `questions_from`: the ``schema_questions`` set ``self_instruct`` reads its questions from."""
    DistillArgs(sources=list(sources), questions_per_database=questions_per_database).check_task(task)
    rows: list[dict] = []
    for source in sources:
        base, style = split_source(source)
        if base == "schema_questions":
            from .self_instruct import question_request_rows

            part = question_request_rows()
        elif base == "self_instruct":
            from .self_instruct import self_instruct_rows

            if questions_from is None:
                raise ValueError("the self_instruct source needs the model's questions: --questions-from, a set "
                                 "distilled with --sources schema_questions")
            if not Path(questions_from).exists():
                raise FileNotFoundError(f"--questions-from {questions_from}: no such set; distill the model's questions "
                                        "first (`streamspec distill --engine vllm --task sql --sources schema_questions "
                                        "--out FOLDER`)")
            part = self_instruct_rows(read_distilled(questions_from), style or "spider", seed,
                                      origin=str(questions_from))
        elif base == "unused_databases":
            part = unused_spider_rows(questions_per_database, seed, style or "spider")
        elif style is not None:
            from .schema_styles import styled_spider_rows

            part = [{k: v for k, v in r.items() if k != "completion"} for r in styled_spider_rows(style, base, seed)]
        else:
            part = [{k: v for k, v in r.items() if k != "completion"} for r in labelled_rows(task, source)]
        rows += [{**r, "source": source} for r in part]
    return rows


# ----------------------------------------------------------------------------- building

def distilled_set_path(model: str, task: str, args: DistillArgs) -> Path:
    """The cached JSONL for this model, task and settings (``args.path`` when given)."""
    if args.path:
        return Path(args.path)
    from ..assets import cache_dir

    key = json.dumps({"model": model_key(model), "task": task, **args.settings()}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "distilled" / f"{task}-{digest}.jsonl"


def model_key(model: str) -> str:
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def row_key(row: dict, sample: int) -> str:
    return hashlib.sha256(f"{row['source']}\n{row['prompt']}\n{sample}".encode()).hexdigest()[:16]


def read_distilled(path: str | Path) -> list[dict]:
    """The rows of a distilled set (prompt or messages, completion, source, ...): a JSONL file, or
    a shard folder (`streamspec.data.distill_shards`), shard by shard."""
    path = Path(path)
    if path.is_dir():
        from .distill_shards import read_shards

        return read_shards(path)
    if not path.is_file():
        raise FileNotFoundError(f"distilled set {path} does not exist (build it with `streamspec distill`)")
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
