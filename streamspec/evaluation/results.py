"""Measured results as data: the JSON files under ``docs/results/`` that every table of
docs/benchmarks.md is written from, and the plots drawn from them.

A result file holds one table:

- ``title``, ``command`` (what reproduces it), ``machine`` (`lscpu`'s model name and what else
  matters: cores, GPU), ``threads``, ``date`` (YYYY-MM-DD), optionally ``note``;
- ``columns``: ``[{"key", "label", "format"}]``; ``format`` is a Python format string for the
  cell (``"{:.2f}×"``), a missing value prints as "–";
- ``rows``: one object per row, keyed by the columns' keys. Rows that compare decoding methods
  carry ``method`` and, for the plots, ``tokens_per_second``, ``crr`` and (when measured)
  ``ms_per_pass``;
- ``plot`` (optional): a task name; its rows are drawn as tokens/s by method and CRR against a
  pass's cost (`write_figures`);
- ``plot_positions`` (optional): a name; the rows' ``acceptance_per_position`` (a list, draft
  position 1 first) are drawn as one line per row (`write_figures`). A list cell prints as its
  values joined by " / ", each in the column's format.

In docs/benchmarks.md a table sits between ``<!-- table: NAME -->`` and ``<!-- /table -->``,
NAME being the result file's name without ``.json``; `rewrite_tables` puts the table rendered
from the file there, and `check_tables` says which tables differ from their files.
`from_eval_summary` turns what ``streamspec eval --out`` writes (``benchmark.json``) into such a
file's rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REQUIRED = ("title", "command", "machine", "threads", "date", "columns", "rows")
MARKER = re.compile(r"(<!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


class ResultError(ValueError):
    """A result file that cannot be read as a table (the message names the file and the field)."""


def load_result(path: str | Path) -> dict:
    """One result file, checked: every field of `REQUIRED`, each column with a key and a label,
    each row an object whose keys are columns."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ResultError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ResultError(f"{path}: a result file is a JSON object, got {type(data).__name__}")
    for field in REQUIRED:
        if field not in data:
            raise ResultError(f"{path}: missing field {field!r}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(data["date"])):
        raise ResultError(f"{path}: field 'date' must be YYYY-MM-DD, got {data['date']!r}")
    if not isinstance(data["columns"], list) or not data["columns"]:
        raise ResultError(f"{path}: field 'columns' must be a non-empty list")
    keys = []
    for i, column in enumerate(data["columns"]):
        for field in ("key", "label"):
            if not isinstance(column, dict) or field not in column:
                raise ResultError(f"{path}: columns[{i}] is missing field {field!r}")
        keys.append(column["key"])
    if not isinstance(data["rows"], list) or not data["rows"]:
        raise ResultError(f"{path}: field 'rows' must be a non-empty list")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            raise ResultError(f"{path}: rows[{i}] must be an object")
        unknown = set(row) - set(keys) - {"tokens_per_second", "crr", "ms_per_pass", "method"}
        if unknown:
            raise ResultError(f"{path}: rows[{i}] has fields no column names: {sorted(unknown)}")
    data["name"] = path.stem
    return data


def load_results(folder: str | Path) -> dict[str, dict]:
    """Every result file of `folder` (``*.json``), by name."""
    return {p.stem: load_result(p) for p in sorted(Path(folder).glob("*.json"))}


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return " / ".join(_cell(v, fmt) for v in value)
    if fmt:
        try:
            return fmt.format(value)
        except (ValueError, TypeError):
            return str(value)
    return str(value)


def render_table(result: dict) -> str:
    """The table's Markdown: a line with the command, machine, threads and date, the table, and
    the note when there is one."""
    lines = ["```bash", result["command"], "```", "",
             f"{result['machine']}, {result['threads']} thread{'s' if result['threads'] != 1 else ''}, "
             f"{result['date']}.", ""]
    columns = result["columns"]
    lines.append("| " + " | ".join(c["label"] for c in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in result["rows"]:
        lines.append("| " + " | ".join(_cell(row.get(c["key"]), c.get("format")) for c in columns) + " |")
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


def rewrite_tables(text: str, results: dict[str, dict], source: str = "the page") -> str:
    """`text` with every marked table replaced by its rendering; a marker naming no result file
    is an error."""
    def replace(match):
        name = match.group("name")
        if name not in results:
            raise ResultError(f"{source}: table {name!r} has no result file {name}.json")
        return match.group(1) + render_table(results[name]) + match.group(4)

    return MARKER.sub(replace, text)


def check_tables(text: str, results: dict[str, dict], source: str = "the page") -> list[str]:
    """Names of the marked tables of `text` that differ from their result files' rendering."""
    stale = []
    for match in MARKER.finditer(text):
        name = match.group("name")
        if name not in results:
            raise ResultError(f"{source}: table {name!r} has no result file {name}.json")
        if match.group("body") != render_table(results[name]):
            stale.append(name)
    return stale


def pass_cost_ms(row: dict) -> float | None:
    """A row's milliseconds a pass: as measured (``ms_per_pass``), else from its CRR and tokens/s
    (tokens a pass over tokens a second: the prefill shared out over the passes)."""
    if row.get("ms_per_pass") is not None:
        return float(row["ms_per_pass"])
    if row.get("crr") and row.get("tokens_per_second"):
        return 1000.0 * row["crr"] / row["tokens_per_second"]
    return None


def write_figures(results: dict[str, dict], folder: str | Path) -> list[Path]:
    """For each result with a ``plot`` task: ``<task>_tokens_per_second.png`` (tokens/s by
    method) and ``<task>_crr_vs_pass_cost.png`` (CRR against ms a pass) in `folder`; for each
    with ``plot_positions``: ``<name>_acceptance_per_position.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, result in sorted(results.items()):
        if result.get("plot_positions"):
            written.append(_positions_figure(result, folder / f"{result['plot_positions']}_acceptance_per_position.png"))
        task = result.get("plot")
        if not task:
            continue
        rows = [r for r in result["rows"] if r.get("method") and r.get("tokens_per_second")]
        if not rows:
            raise ResultError(f"{name}.json: 'plot' is set but no row has 'method' and 'tokens_per_second'")
        subtitle = f"{result['machine']}, {result['threads']} thread(s), {result['date']}"
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.4))
        ax.barh([r["method"] for r in rows][::-1], [r["tokens_per_second"] for r in rows][::-1], color="#4a7ab5")
        ax.set_xlabel("tokens/s")
        ax.set_title(f"{result['title']}\n{subtitle}", fontsize=9)
        written.append(_save(fig, folder / f"{task}_tokens_per_second.png"))
        points = [(pass_cost_ms(r), r["crr"], r["method"]) for r in rows if r.get("crr") and pass_cost_ms(r)]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for cost, crr, method in points:
            ax.scatter(cost, crr, color="#c0504d")
            ax.annotate(method, (cost, crr), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel("ms a pass" + ("" if all(r.get("ms_per_pass") for r in rows) else " (measured, or CRR / tokens/s)"))
        ax.set_ylabel("CRR (tokens a pass)")
        ax.set_title(f"{result['title']}: CRR against a pass's cost\n{subtitle}", fontsize=9)
        written.append(_save(fig, folder / f"{task}_crr_vs_pass_cost.png"))
    return written


def _positions_figure(result: dict, path: Path) -> Path:
    """One line per row with ``acceptance_per_position`` at the table's lowest concurrency (the
    rates hardly move with it): the share of steps whose draft at each position was accepted."""
    import textwrap

    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("acceptance_per_position")]
    if not rows:
        raise ResultError(f"{result.get('name', 'a result')}.json: 'plot_positions' is set but no row has "
                          "'acceptance_per_position'")
    lowest = min(r.get("concurrency", 1) for r in rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    longest = 1
    for row in (r for r in rows if r.get("concurrency", 1) == lowest):
        shares = row["acceptance_per_position"]
        longest = max(longest, len(shares))
        ax.plot(range(1, len(shares) + 1), shares, marker="o", label=str(row.get("method") or row.get("row") or "?"))
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of steps accepting it")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    heading = f"{result['title']} ({lowest} request{'s' if lowest != 1 else ''} at once); {result['machine']}, {result['date']}"
    ax.set_title("\n".join(textwrap.wrap(heading, 95)), fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """Write a figure as a PNG that is the same bytes for the same data (no software stamp)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def regenerate(root: str | Path, check: bool = False, figures: bool = True) -> list[str]:
    """Rewrite docs/benchmarks.md's tables from docs/results/*.json under `root` (and draw the
    figures into docs/figures). With `check`, write nothing and return the stale tables' names."""
    root = Path(root)
    page = root / "docs" / "benchmarks.md"
    results = load_results(root / "docs" / "results")
    text = page.read_text()
    if check:
        return check_tables(text, results, str(page))
    stale = check_tables(text, results, str(page))
    page.write_text(rewrite_tables(text, results, str(page)))
    if figures:
        write_figures(results, root / "docs" / "figures")
    return stale


def from_eval_summary(summary: dict, labels: dict[str, str] | None = None) -> list[dict]:
    """Rows (``method``, ``tokens_per_second``, ``speedup``, ``crr``, ``ms_per_pass``,
    ``identical``) from what `streamspec eval --out` writes (``benchmark.json``, or its
    ``methods``: method -> ``tokens_per_second``, ``speedup``, ``crr``, ``ms_per_pass``,
    ``identical_to_autoregressive``); `labels` renames methods."""
    summary = summary.get("methods", summary)
    rows = []
    for method, entry in summary.items():
        if "tokens_per_second" not in entry:
            raise ResultError(f"summary entry {method!r} is missing field 'tokens_per_second'")
        rows.append({
            "method": (labels or {}).get(method, method),
            "tokens_per_second": entry["tokens_per_second"],
            "speedup": entry.get("speedup"),
            "crr": entry.get("crr"),
            "ms_per_pass": entry.get("ms_per_pass"),
            "identical": entry.get("identical_to_baseline", entry.get("identical_to_autoregressive")),
        })
    return rows
