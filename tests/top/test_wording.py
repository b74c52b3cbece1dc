"""The repository speaks of the product: "session" only in the sense of a decoding session
(`streamspec.decoding.session.DecodingSession`, a sequence whose KV cache is kept across calls,
and pytest's session scope), and "issue" not at all. How the work was organised belongs to no
doc, comment, docstring, test or recipe; what changed over time goes to CHANGELOG.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORDS = re.compile(r"\b(sessions?|issues?)\b", re.I)
# the product's own uses, removed from a line before it is searched
ALLOWED = [
    re.compile(r"\bdecoding sessions?\b", re.I),  # the concept, in prose
    re.compile(r"\bsession(?=\.\w)"),  # a DecodingSession object's attributes: session.extend(...)
    re.compile(r"(?<=\.)session\b"),  # streamspec.decoding.session, backend.session
    re.compile(r"\bsession(?= = DecodingSession\b)"),
    re.compile(r"""scope=["']session["']"""),  # pytest's fixture scope
    re.compile(r"`session`|\(session\)"),  # the module's name; len(session)
]
SUFFIXES = (".md", ".py", ".yaml")


def forbidden_uses(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every use of "session(s)" or "issue(s)" that no allowed pattern covers."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        rest = line
        for pattern in ALLOWED:
            rest = pattern.sub("", rest)
        if WORDS.search(rest):
            found.append((number, line.strip()))
    return found


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    own = Path(__file__).resolve()  # this file names the words it looks for
    return [ROOT / name for name in out.splitlines()
            if name.endswith(SUFFIXES) and (ROOT / name).is_file() and (ROOT / name).resolve() != own]


def test_no_file_speaks_of_how_the_project_was_built():
    wrong = [f"{path.relative_to(ROOT)}:{number}: {line}"
             for path in tracked_files() for number, line in forbidden_uses(path.read_text(errors="replace"))]
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_a_planted_use(tmp_path):
    planted = tmp_path / "planted.md"
    planted.write_text("A figure of the ninth Session.\nAs the streams issue asked.\nFixed issues.\n"
                       "session = DecodingSession(model)\nsession.extend(ids)\na decoding session keeps its cache\n")
    assert [n for n, _ in forbidden_uses(planted.read_text())] == [1, 2, 3]


def test_the_product_uses_pass():
    for line in ("from streamspec.decoding.session import DecodingSession", "self.session.reset(ids)",
                 '@pytest.fixture(scope="session")', "decoding sessions that keep their cache"):
        assert forbidden_uses(line) == [], line
