"""The package's import graph, read with `ast` (every import, at module level or inside a function):
no cycles between diffserve's packages, and the engine core never imports the server or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

from python_sources import parse_python

import diffserve

ROOT = Path(diffserve.__file__).parent
#: Packages that must not import the front ends (`server`, `cli`): the engine runs without them.
CORE = ("runtime", "families", "pipelines", "models", "layers", "stages", "loader", "platforms")
FRONT_ENDS = ("server", "cli")


def _unit(module: str) -> str:
    """The graph node of a dotted module name: its top-level package or module under diffserve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Dotted names of the diffserve modules `path` imports."""
    tree = parse_python(path)
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
    return {name for name in found if name == "diffserve" or name.startswith("diffserve.")}


def package_graph() -> dict[str, set[str]]:
    """Edges between diffserve's top-level packages and modules (self-edges dropped)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":
            continue  # the package's own re-exports (`from diffserve import DiffGenerator`)
        source = _unit(_module_name(path))
        targets = {_unit(name) for name in _imports(path) if name != "diffserve"} - {source}
        graph.setdefault(source, set()).update(targets)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()
    assert {"runtime", "pipelines", "server", "cli", "models", "layers"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_the_engine_core_never_imports_the_front_ends() -> None:
    graph = package_graph()
    offending = {core: sorted(graph.get(core, set()) & set(FRONT_ENDS)) for core in CORE}
    if any(offending.values()):  # name the files, to tell a real import from a file a test left there
        files = [
            str(path.relative_to(ROOT))
            for path in ROOT.rglob("*.py")
            if _unit(_module_name(path)) in CORE
            and {_unit(name) for name in _imports(path)} & set(FRONT_ENDS)
        ]
        raise AssertionError(f"core packages importing server/cli: {offending}, in {files}")


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
