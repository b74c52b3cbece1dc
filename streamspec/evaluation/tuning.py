"""Settings chosen on validation prompts (never the test ones): one chooser over candidate
decode configs (`choose_config`), and the candidates of each option the benchmark tunes (tree
shape, lookup branches, confidence budget, pruning threshold).
"""

from __future__ import annotations

from ..decoding.config import DecodeConfig
from ..decoding.lookup import PromptLookup
from .methods import MethodResult

from .methods import row_config, run_methods, streaming_method

TREE_CANDIDATES = (1, (2, 1, 1), (3, 1, 1), (4, 1, 1), (6, 1, 1), (3, 2, 1), 2, 3)


def _pick_fastest(results: dict[str, MethodResult]) -> tuple[str, dict[str, dict]]:
    """The name of the method with the best tokens/s, and every method's tokens/s and CRR."""
    table = {name: {"tokens_per_second": round(r.tokens / max(r.seconds, 1e-9), 2),
                    "crr": round(r.tokens / max(r.passes, 1), 3)} for name, r in results.items()}
    return max(table, key=lambda name: table[name]["tokens_per_second"]), table


def choose_config(model, tokenizer, rows: list[dict], candidates: dict[str, DecodeConfig],
                  max_new_tokens: int) -> tuple[str, dict]:
    """The candidate decode config with the best tokens/s on validation prompts (never the test
    ones): its name, and each candidate's tokens/s and CRR. The `choose_*` functions below are
    this chooser over one option's candidates."""
    methods = {name: streaming_method(model, tokenizer.eos_token_id, config=c) for name, c in candidates.items()}
    return _pick_fastest(run_methods(methods, tokenizer, rows, max_new_tokens))


def choose_tree(model, tokenizer, rows: list[dict], candidates, max_new_tokens: int,
                base: DecodeConfig | None = None) -> tuple[int | tuple[int, ...], dict]:
    """The tree shape with the best tokens/s on validation prompts (never the test ones), among
    the candidates that fit the model's number of streams; and each candidate's tokens/s and CRR."""
    g = model.num_drafts
    shapes = {str(c): c for c in candidates if isinstance(c, int) or len(c) <= g}
    if not shapes:
        raise ValueError(f"none of the tree shapes {candidates} fits a model with {g} streams")
    best, table = choose_config(model, tokenizer, rows, {n: row_config(base, tree_top_k=c) for n, c in shapes.items()},
                                max_new_tokens)
    return shapes[best], table


# Lookup settings tried on validation prompts: branch length L, matches M, and a node budget.
LOOKUP_CANDIDATES = (PromptLookup(4, 1), PromptLookup(8, 1), PromptLookup(8, 2), PromptLookup(12, 2),
                     PromptLookup(16, 3, budget=32))
DEFAULT_LOOKUP = PromptLookup(8, 2)

# Node budgets tried on validation for the confidence-shaped tree (3 candidates per stream).
BUDGET_CANDIDATES = (3, 4, 6, 7, 8, 12, 16)
# 7: a float32 pass of up to seven rows reads each weight once (streamspec's kernel), and lookup
# trees on the (2, 1, 1) stream tree pad to 7 nodes too, so both rows share that compiled graph
# (`streamspec.decoding.compiled.HOST_GRAPH_WIDTH`). Spider, 30 held-out questions, fp32, the
# shipped streams (AMD EPYC, bf16 drafts): CRR 2.20 at 1.48x `generate`, where 10 nodes gave
# CRR 2.30 at 1.24x before the seven-row kernel (docs/benchmarks.md, "Decoding speed on a CPU").
DEFAULT_BUDGET = 7
CONFIDENCE_TOP_K = 3


def choose_budget(model, tokenizer, rows: list[dict], candidates, max_new_tokens: int,
                  base: DecodeConfig | None = None) -> tuple[int, dict]:
    """The confidence tree's node budget with the best tokens/s on validation prompts; and each
    budget's tokens/s and CRR."""
    configs = {str(b): row_config(base, tree_top_k=CONFIDENCE_TOP_K, tree_budget=b) for b in candidates}
    best, table = choose_config(model, tokenizer, rows, configs, max_new_tokens)
    return int(best), table


def lookup_name(lookup: PromptLookup) -> str:
    """``L,M,N`` (and ``/budget``) as the command line writes it."""
    return f"{lookup.tokens},{lookup.matches},{lookup.ngram}" + (f"/{lookup.budget}" if lookup.budget else "")


def choose_lookup(model, tokenizer, rows: list[dict], tree_top_k, candidates, max_new_tokens: int,
                  base: DecodeConfig | None = None) -> tuple[PromptLookup, dict]:
    """The lookup setting with the best tokens/s on validation prompts (never the test ones), with
    the stream tree `tree_top_k`; and each setting's tokens/s and CRR."""
    settings = {lookup_name(c): c for c in candidates}
    configs = {name: row_config(base, tree_top_k=tree_top_k, lookup=c) for name, c in settings.items()}
    best, table = choose_config(model, tokenizer, rows, configs, max_new_tokens)
    return settings[best], table


def choose_threshold(model, tokenizer, rows: list[dict], tree_top_k, thresholds: list[float],
                     max_new_tokens: int, base: DecodeConfig | None = None) -> tuple[float, dict]:
    """The pruning threshold with the best tokens/s on validation prompts (never the test ones);
    and each threshold's tokens/s and CRR."""
    configs = {f"{t}": row_config(base, tree_top_k=tree_top_k, prune_threshold=t) for t in thresholds}
    best, table = choose_config(model, tokenizer, rows, configs, max_new_tokens)
    return float(best), table
