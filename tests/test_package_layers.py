"""The package's shape: its layers, which way imports run, and no import circle.

``ferrum_service`` is four layers (README, "Development map"): ``core`` (types, errors, the cache
registry, sampling, the step plan) below ``executors`` below ``hosting`` (a model on its worker,
batching, admission) below ``wire`` (gRPC services and the contract conversion); ``server.py`` and
``cli.py`` wire them together on top. A module may import from its own layer or the layers below it,
never above; and no chain of imports leads back to where it started (``TYPE_CHECKING`` imports
count: a type that names the layer above is still an arrow running back up).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ferrum_service"
#: Layer ranks: a module may import ranks <= its own.
RANK = {"core": 0, "executors": 1, "hosting": 2, "wire": 3}
TOP = 4  # server.py, cli.py, logs.py, __main__.py
TESTING = 5  # ferrum_service.testing: helpers for tests and benchmarks, above everything
#: Most lines a hand-written module may have.
MAX_MODULE_LINES = 700


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _rank(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) < 2:
        return TOP
    if parts[1] == "testing":
        return TESTING
    return RANK.get(parts[1], TOP)


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # an attribute of a module: the module
                    t = t.rpartition(".")[0]
                if t and t != mod and t != "ferrum_service":
                    graph[mod].add(t)
    return graph


def test_imports_never_run_up_a_layer():
    graph = _imports(_modules())
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if _rank(t) > _rank(m))
    assert not up, "imports running up a layer:\n" + "\n".join(up)


def test_no_import_circle():
    graph = _imports(_modules())
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_every_module_sits_in_a_layer():
    loose = sorted(m for m in _modules() if m.count(".") == 1 and m.split(".")[1] not in
                   {"server", "cli", "logs", "__main__", "settings", *RANK, "testing"})
    assert not loose, f"modules outside the layers: {loose}"


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path: pathlib.Path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {n} lines (at most {MAX_MODULE_LINES})"


def test_the_readme_map_names_every_module():
    readme = (PACKAGE.parent / "README.md").read_text()
    block = readme[readme.index("## Development"):]
    block = block[: block.index("\n## ", 1)] if "\n## " in block[1:] else block
    unnamed = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and p.stem not in block)
    assert not unnamed, f"modules the README's development map does not name: {unnamed}"
