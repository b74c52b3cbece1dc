"""Streams checkpoints side by side as vLLM's drafter (``eval/vllm_acceptance.py``): the runs of one
vLLM process (plain, then each drafter folder, at each concurrency), their rows against plain vLLM
at the same concurrency, and the table. Acceptance does not depend on what else the machine runs;
tokens/s does (compare within one run)."""

from __future__ import annotations

from .vllm_peers import NGRAM_TOKENS


def named_checkpoints(items: list[str]) -> dict[str, str]:
    """``NAME=CHECKPOINT`` items -> {name: checkpoint}; a bare checkpoint is named by itself."""
    out: dict[str, str] = {}
    for item in items:
        name, _, checkpoint = item.partition("=") if "=" in item else (item, "", item)
        if not checkpoint or not name:
            raise ValueError(f"a checkpoint is NAME=CHECKPOINT or CHECKPOINT, got {item!r}")
        if name in out or name == "vllm" or "+" in name:
            raise ValueError(f"checkpoint name {name!r} is taken (each name once, without '+', which its lookup "
                             "rows add; 'vllm' is plain vLLM's row)")
        out[name] = checkpoint
    return out


LOOKUP_SUFFIX = "+lookup"  # the row of a checkpoint's drafter with lookup drafts merged (``--lookup``)
SUFFIX_ROW = "+suffix"  # the same with suffix decoding's drafts merged (``--lookup suffix``)
# lookup drafters run beside the streams (``--peers``): vLLM's n-gram drafter as `streamspec eval` runs it
PEERS = {"ngram": {"drafter": "ngram", "num_speculative_tokens": NGRAM_TOKENS, "prompt_lookup_max": NGRAM_TOKENS},
         "suffix": {"drafter": "suffix"}}


def lookup_row_name(name: str, drafts: int | None, lookup: str | None = None) -> str:
    """The row of checkpoint `name` with lookup drafts merged: ``NAME+lookup`` (``NAME+suffix``
    for suffix decoding's, ``NAME+suffix0`` for ``suffix:0``), or with K drafts a step asked for
    (``--lookup-drafts``) ``NAME+lookup+KK``."""
    from ..vllm.lookup import lookup_name, parse_lookup

    parsed = parse_lookup(lookup)
    kind = SUFFIX_ROW + lookup_name(parsed).partition(":")[2] if isinstance(parsed, dict) else LOOKUP_SUFFIX
    return f"{name}{kind}" + ("" if drafts is None else f"+K{drafts}")


def acceptance_runs(folders: dict[str, str], concurrency: tuple[int, ...], peers: tuple[str, ...] = (),
                    trained: dict[str, str] | None = None) -> list[dict]:
    """`streamspec.vllm.run` runs: plain vLLM, the `peers` (`PEERS`, named ``vllm_NAME``), the
    `trained` peer drafters (``{"eagle3": FOLDER, "peagle": FOLDER}``: speculators' folders, named
    ``vllm_eagle3`` / ``vllm_peagle``), then each drafter folder, each at every concurrency."""
    from ..vllm.run import PEER_DRAFTERS

    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"peers {unknown}: choose among {sorted(PEERS)}")
    unknown = sorted(set(trained or {}) - set(PEER_DRAFTERS))
    if unknown:
        raise ValueError(f"trained drafters {unknown}: choose among {sorted(PEER_DRAFTERS)}")
    runs = [{"drafter": "none", "name": "vllm", "concurrency": n} for n in concurrency]
    runs += [{**PEERS[peer], "name": f"vllm_{peer}", "concurrency": n} for peer in peers for n in concurrency]
    runs += [{"drafter": method, "folder": str(folder), "name": f"vllm_{method}", "concurrency": n}
             for method, folder in (trained or {}).items() for n in concurrency]
    return runs + [{"drafter": "streams", "folder": str(folder), "name": name, "concurrency": n}
                   for name, folder in folders.items() for n in concurrency]


def acceptance_rows(results: list[dict], checkpoints: dict[str, str]) -> list[dict]:
    """One row a run: tokens/s against plain vLLM at its concurrency, vLLM's mean acceptance length
    and acceptance per draft position, and whether its outputs equal plain vLLM's."""
    plain = {r["concurrency"]: r for r in results if r["drafter"] == "none"}
    return [{"name": r["name"], "checkpoint": checkpoints.get(r["name"].partition("+")[0]),
             "concurrency": r["concurrency"],
             "tokens_per_second": round(r["tokens_per_s"], 2),
             "x_vllm": round(r["tokens_per_s"] / plain[r["concurrency"]]["tokens_per_s"], 3),
             "mean_acceptance_length": r.get("mean_acceptance_length"),
             "acceptance_per_position": r.get("acceptance_per_position"),
             "identical": r["outputs"] == plain[r["concurrency"]]["outputs"]} for r in results]


def acceptance_table(rows: list[dict]) -> str:
    lines = ["| drafter | requests at once | tokens/s | × vLLM plain | mean acceptance | per draft position | identical |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        accept = row["mean_acceptance_length"]
        per = " / ".join(f"{100 * a:.1f}%" for a in row["acceptance_per_position"] or [])
        lines.append(f"| {row['name']} | {row['concurrency']} | {row['tokens_per_second']} | {row['x_vllm']:.2f}× | "
                     f"{'–' if accept is None else f'{accept:.3f}'} | {per or '–'} | "
                     f"{'yes' if row['identical'] else 'NO'} |")
    return "\n".join(lines)
