"""ACLSum aspect-based summarisation, from the `aclsum` package (MIT).

Each of the package's papers gives three pairs: its abstract plus an aspect (challenge, approach,
outcome) → that aspect's one-sentence summary.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ASPECTS = ("challenge", "approach", "outcome")
_FILES = {"train": "train.jsonl", "validation": "val.jsonl", "test": "test.jsonl"}
_INSTALL_HINT = "pip install --no-deps aclsum==0.1.2"
_QUESTIONS = {
    "challenge": "What problem or challenge does the paper address?",
    "approach": "What approach does the paper propose?",
    "outcome": "What is the outcome or main result of the paper?",
}


def aclsum_dir() -> Path:
    spec = importlib.util.find_spec("aclsum")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"ACLSum data needs the aclsum package; install it with: {_INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0]) / "dataset"
    if not folder.is_dir():
        raise RuntimeError(f"the aclsum package has no dataset folder; reinstall it: {_INSTALL_HINT}")
    return folder


def detokenize(text: str) -> str:
    """Undo the corpus's tokenisation: "results ( MRR ) ." -> "results (MRR)."."""
    text = re.sub(r" ([.,;:!?%)\]'])", r"\1", text)
    return re.sub(r"([(\[]) ", r"\1", text)


def summarize_prompt(abstract: str, aspect: str) -> str:
    return (
        "Summarise one aspect of the paper whose abstract is below, in one sentence.\n\n"
        f"Abstract: {abstract}\n\nAspect: {aspect}. {_QUESTIONS[aspect]}"
    )


def load_aclsum(split: str) -> list[dict]:
    """Pairs of one split (train 300, validation 150, test 300): id, aspect, abstract, summary,
    prompt, completion."""
    if split not in _FILES:
        raise ValueError(f"ACLSum split must be one of {list(_FILES)}, got {split!r}")
    rows = []
    with open(aclsum_dir() / _FILES[split], encoding="utf-8") as handle:
        for line in handle:
            paper = json.loads(line)
            abstract = detokenize(" ".join(paper["sentences"]["abstract"]))
            for aspect in ASPECTS:
                summary = paper["summary"][aspect]
                rows.append(
                    {
                        "id": paper["id"],
                        "aspect": aspect,
                        "abstract": abstract,
                        "summary": summary,
                        "prompt": summarize_prompt(abstract, aspect),
                        "completion": summary,
                    }
                )
    return rows
