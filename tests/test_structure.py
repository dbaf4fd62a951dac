"""The shape of the package: imports between rooms (folders and top-level modules) and between modules point one
way only, and functions fit on a screen."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kubetrain

SRC = Path(kubetrain.__file__).parent
MAX_FUNCTION_LINES = 80
# Functions allowed to be longer, each with its reason (keep this list short).
LONG_FUNCTIONS: dict[str, str] = {}
# Modules allowed to import each other, each pair with its reason (keep this list short; delete an entry with the
# change that breaks its cycle).
# Pairs of modules allowed to import each other, each with the issue that removes it (none today).
MODULE_CYCLES: dict[frozenset[str], str] = {}


def room(module: str) -> str | None:
    """The folder (or top-level module) of `kubetrain.a.b`: `a`; None outside the package and for the package's
    own __init__ (importing `kubetrain` itself)."""
    parts = module.split(".")
    inside = parts[0] == "kubetrain" and len(parts) > 1 and parts[1] != "__init__"
    return parts[1] if inside and ((SRC / parts[1]).is_dir() or (SRC / f"{parts[1]}.py").is_file()) else None


def python_files() -> Iterator[tuple[str, Path]]:
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        yield ".".join(("kubetrain", *rel.with_suffix("").parts)), path


def imported_modules(module: str, path: Path) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def room_graph() -> dict[str, set[str]]:
    """room -> the rooms it imports (inside functions too: a lazy import is still a dependency). A room is a
    folder or a top-level module (doctor.py, memory.py, errors.py): `train/memory_check.py -> doctor.py ->
    train/device.py` is a cycle between the rooms `train` and `doctor`."""
    graph: dict[str, set[str]] = {}
    for module, path in python_files():
        here = room(module)
        if here is None:
            continue
        for target in imported_modules(module, path):
            there = room(target)
            if there and there != here:
                graph.setdefault(here, set()).add(there)
    return graph


def module_graph() -> dict[str, set[str]]:
    """module -> the modules it imports. A name imported from a module counts as that module; an import of a
    package counts as its __init__ only when the name is defined there, not re-exported from a module of it."""
    modules = dict(python_files())
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        for target in imported_modules(module, path):
            found = next((name for name in (target, target.rsplit(".", 1)[0]) if name in modules), None)
            if found and found != module:
                graph.setdefault(module, set()).add(found)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_two_rooms_import_each_other() -> None:
    graph = room_graph()
    assert "train" in graph and "config" in graph["train"]  # the walk sees real imports
    assert "hardware" in graph["doctor"] and "errors" in graph["train"]  # top-level modules are rooms too
    cycle = find_cycle(graph)
    assert cycle is None, "rooms import each other: " + " -> ".join(cycle or [])


def test_no_two_modules_import_each_other() -> None:
    graph = module_graph()
    assert "kubetrain.memory" in graph["kubetrain.train.memory_check"]  # the walk sees real imports
    for pair in MODULE_CYCLES:  # an allowed pair stays listed only while it is a cycle
        a, b = sorted(pair)
        assert b in graph.get(a, ()) and a in graph.get(b, ()), f"{a} <-> {b} is no cycle now: delete its entry"
    allowed = {a: {b for b in targets if frozenset({a, b}) not in MODULE_CYCLES} for a, targets in graph.items()}
    cycle = find_cycle(allowed)
    assert cycle is None, "modules import each other: " + " -> ".join(cycle or [])


def test_no_function_is_longer_than_a_screen() -> None:
    long = []
    for module, path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                name = f"{module}.{node.name}"
                if lines > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS:
                    long.append(f"{name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_every_import_of_our_own_modules_resolves() -> None:
    # mypy's ignore_missing_imports (for third-party packages) also hides a lazy import of a module we moved
    import importlib.util

    missing = set()
    for module, path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            for name in names:
                if name.split(".")[0] == "kubetrain" and importlib.util.find_spec(name) is None:
                    missing.add(f"{name} (in {module})")
    assert not missing, f"imports of modules that do not exist: {', '.join(sorted(missing))}"


def test_a_test_runs_in_an_empty_folder_outside_the_checkout() -> None:
    # tests/conftest.py's autouse fixture: a `runs/` the README's first command leaves in the checkout (k8s render
    # and doctor read runs/<run.name> of the working folder) must not change any test's result
    here = Path.cwd().resolve()
    assert list(here.iterdir()) == []
    assert Path(kubetrain.__file__).resolve().parents[2] not in [here, *here.parents]
