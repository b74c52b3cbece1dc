"""The package's structure, as the README's layout table states it: no import cycles (imports
inside functions and under ``if TYPE_CHECKING`` included, and importing ``a.b.c`` counts as
importing ``a`` and ``a.b``), and each room depends only on rooms below it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "streamspec"

# Rooms from the bottom up; a module may import its own room (within one package) and those below.
ROOMS = [
    ("foundation", ["streamspec.config", "streamspec.arch", "streamspec.assets", "streamspec.devices",
                    "streamspec.kernels", "streamspec.attention", "streamspec.fingerprint", "streamspec.scales", "streamspec.native", "streamspec.llamacpp",
                    "streamspec._llamacpp_child"]),
    ("data", ["streamspec.data"]),
    ("patch", ["streamspec.patch"]),
    ("loading", ["streamspec.loading"]),
    ("decoding", ["streamspec.decoding"]),
    ("vllm", ["streamspec.vllm"]),
    ("uses", ["streamspec.training", "streamspec.evaluation", "streamspec.serving", "streamspec.reason"]),
    ("top", ["streamspec.demo", "streamspec.cli", "streamspec.custom_generate", "streamspec"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str) -> set[str]:
    """Every streamspec module `name` imports (at the top, inside functions, or under
    ``if TYPE_CHECKING``: a module named only in signatures is still a dependency), with the
    packages each import runs on the way."""
    return imports_in(name, MODULES[name].read_text())


def imports_in(name: str, source: str) -> set[str]:
    """`imports` of `source`, read as the module `name`."""
    path = MODULES.get(name, PACKAGE / (name.split(".", 1)[-1].replace(".", "/") + ".py"))
    tree = ast.parse(source)
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            targets = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target in MODULES:
                parts = target.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    found.discard(name)
    # a module's own packages run before it: not a dependency of its own
    found -= {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")))}
    return {m for m in found if m in MODULES}


def room_of(name: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(ROOMS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{name} is in no room: add it to ROOMS (and to the README's layout table)"
    return level


def test_every_module_is_in_a_room():
    for name in MODULES:
        room_of(name)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = {name: imports(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_inside_functions_and_type_checking_count():
    """The check sees an import made only inside a function or only for type hints: a planted
    module importing the patch's model that way closes a cycle with the model."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .model import StreamedModel\n"
        "def f():\n    from .saving import save_streamed\n"
    )
    found = imports_in("streamspec.patch.planted", source)
    assert {"streamspec.patch.model", "streamspec.patch.saving"} <= found
    graph = {name: imports(name) for name in MODULES}
    graph["streamspec.patch.planted"] = found
    graph["streamspec.patch.model"] = graph["streamspec.patch.model"] | {"streamspec.patch.planted"}
    assert find_cycle(graph) is not None


def test_rooms_depend_only_on_rooms_below():
    wrong = []
    for name in MODULES:
        own = room_of(name)
        for target in imports(name):
            other = room_of(target)
            same_package = target.split(".")[:2] == name.split(".")[:2]
            if other > own or (other == own and ROOMS[own][0] == "uses" and not same_package):
                wrong.append(f"{name} ({ROOMS[own][0]}) imports {target} ({ROOMS[other][0]})")
    assert not wrong, "\n".join(wrong)


def test_the_readme_layout_names_every_room():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    for _, prefixes in ROOMS:
        for prefix in prefixes:
            if prefix != "streamspec":
                shown = prefix.replace(".", "/")
                assert shown in layout, f"the README's layout table does not name {shown}"


def test_the_slow_tier_names_tests_that_exist():
    """A renamed test must not drop out of the slow tier unnoticed."""
    from conftest import SLOW_MODULES, SLOW_TESTS

    tests = ROOT / "tests"
    for module in SLOW_MODULES:
        assert len(list(tests.rglob(f"{module}.py"))) == 1, module
    sources = "\n".join(p.read_text() for p in tests.rglob("test_*.py"))
    for name in SLOW_TESTS:
        assert f"def {name}(" in sources, name


def _private_imports(name: str) -> list[tuple[str, str]]:
    """(module, name) of every private name (a leading underscore) `name` imports from another module."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            if target.startswith("streamspec"):
                found += [(target, alias.name) for alias in node.names if alias.name.startswith("_")
                          and not alias.name.startswith("__")]
    return found


def test_no_private_name_is_imported_from_another_room():
    """A module may use another module's private helpers only inside its own room (package):
    across rooms the contract is public names."""
    wrong = []
    for name in MODULES:
        for target, imported in _private_imports(name):
            if room_of(target) != room_of(name) or target.split(".")[:2] != name.split(".")[:2]:
                wrong.append(f"{name} imports {target}.{imported}")
    assert not wrong, wrong


def test_tests_are_grouped_by_room():
    """Each test module lives in the folder of the room it tests (tests/<room>/), none at the top."""
    tests = ROOT / "tests"
    assert not list(tests.glob("test_*.py")), "put test modules in tests/<room>/"
    allowed = {name for name, _ in ROOMS} | {"evaluation", "training", "serving", "reason"}
    assert {p.parent.name for p in tests.rglob("test_*.py")} <= allowed
