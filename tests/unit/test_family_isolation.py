"""A family lives in its package: no module outside `families/<name>/` names that family's classes, its
Diffusers pipeline names, its family names or aliases, or imports its package (`registry.py`, the one list
of families, and the tests excepted). What a family's DiT needs from the loader is in its record
(`DitFacts`); what its requests carry is its typed conditioning, not fields of `Req`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from python_sources import parse_python

import diffserve
from diffserve.registry import FAMILIES

SRC = Path(diffserve.__file__).parent
FAMILIES_DIR = SRC / "families"
#: Allowed to name every family: the list of them.
ALLOWED = {SRC / "registry.py"}


def _package_of(family_module: str) -> str:
    return family_module.split(".")[2]  # diffserve.families.<package>.record


def family_markers() -> dict[str, set[str]]:
    """Per family package: the class names it defines, its Diffusers pipeline names and its spellings."""
    markers: dict[str, set[str]] = {}
    for family in FAMILIES:
        package = _package_of(family.pipeline_cls.__module__)
        names = markers.setdefault(package, set())
        names.update({family.diffusers_pipeline, family.name, *family.aliases})
    for package, names in markers.items():
        for path in (FAMILIES_DIR / package).rglob("*.py"):
            tree = parse_python(path)
            names.update(node.name for node in tree.body if isinstance(node, ast.ClassDef))
    return markers


def _strings_and_names(path: Path) -> tuple[set[str], set[str], set[str]]:
    """Identifiers used, string constants, and imported module names of one source file (docstrings and
    comments are prose and do not count)."""
    tree = parse_python(path)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    identifiers: set[str] = set()
    strings: set[str] = set()
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            identifiers.add(node.id)
        elif isinstance(node, ast.Attribute):
            identifiers.add(node.attr)
        elif isinstance(node, ast.alias):
            identifiers.add(node.asname or node.name.rpartition(".")[2])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            strings.add(node.value)
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return identifiers, strings, modules


def find_violations(markers: dict[str, set[str]], root: Path = SRC) -> list[str]:
    """`path: what` for every module outside a family's package that names that family."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path in ALLOWED:
            continue
        identifiers, strings, modules = _strings_and_names(path)
        for package, names in markers.items():
            if (FAMILIES_DIR / package) in path.parents:
                continue
            prefix = f"diffserve.families.{package}"
            named = sorted(
                {n for n in names if n in identifiers}
                | {
                    n
                    for n in names
                    if any(re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w.-])", s) for s in strings)
                }
                | {m for m in modules if m == prefix or m.startswith(prefix + ".")}
            )
            if named:
                found.append(f"{path.relative_to(root)} names the {package} family: {', '.join(named)}")
    return found


def test_no_module_outside_a_family_package_names_that_family() -> None:
    violations = find_violations(family_markers())
    assert not violations, "\n".join(violations)


def test_the_check_finds_a_module_that_names_a_family(tmp_path: Path) -> None:
    (tmp_path / "engine_part.py").write_text(
        'from diffserve.families.flux.pipeline import FluxPipeline\n\nKIND = "ltx2-t2v"\n'
    )
    (tmp_path / "clean.py").write_text(
        '"""Mentions FluxPipeline in prose only."""\n\nX = 1  # FluxPipeline\n'
    )
    violations = find_violations(family_markers(), tmp_path)
    assert len(violations) == 2
    assert any("flux family" in v and "FluxPipeline" in v for v in violations)
    assert any("ltx2 family" in v and "ltx2-t2v" in v for v in violations)
