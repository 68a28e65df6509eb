"""The code's structure, read from its own imports: the worker and the wire contract never import the portal, and
no package's modules import each other in a cycle. Function-level imports count (a late import is how a cycle
hides); imports under ``if TYPE_CHECKING:`` do not (they never run). That the web process loads neither torch nor
hivemind is checked where it runs, by importing it (tests/test_api.py, tests/test_install.py), and not here."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"app": ROOT / "app", "dedloc_worker": ROOT / "worker" / "dedloc_worker",
            "dedloc_common": ROOT / "common" / "dedloc_common"}


def sources(package: str) -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (its source, whether it is a package's ``__init__``), for every .py file of
    ``package``."""
    folder = PACKAGES[package]
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = (package, *path.relative_to(folder).with_suffix("").parts)
        init = parts[-1] == "__init__"
        found[".".join(parts[:-1] if init else parts)] = (path.read_text(), init)
    return found


def type_checking_only(node: ast.AST) -> bool:
    """Whether ``node`` is ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``), whose body never runs."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, source: str, init: bool, known: set[str]) -> set[str]:
    """What module ``name`` imports anywhere in ``source`` (a function body too), as dotted names: ``from X import
    Y`` is X.Y where that is one of the ``known`` modules, else X. Relative imports are resolved against ``name``'s
    package (``name`` itself where ``init``)."""
    package = name.split(".") if init else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the other ``modules`` it imports."""
    known = set(modules)
    return {name: (imports_of(name, source, init, known) & known) - {name} for name, (source, init) in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle in ``edges``, as its modules (the first repeated last); [] where there is none."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return []


def test_a_cycle_hidden_in_a_function_body_is_found_and_one_under_type_checking_is_not():
    """The reader's control, on modules written here: a late, relative import closing a cycle is found."""
    fine = {"pkg": ("", True), "pkg.a": ("from pkg import b\n", False), "pkg.b": ("import pkg.c\n", False),
            "pkg.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import thing\n", False)}
    assert graph(fine) == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": set()}
    assert cycle(graph(fine)) == []
    late = dict(fine, **{"pkg.c": ("def f():\n    from . import a\n    from .a import thing\n", False)})
    assert sorted(cycle(graph(late))[1:]) == ["pkg.a", "pkg.b", "pkg.c"]
    nested = {"pkg": ("", True), "pkg.sub": ("from .. import top\n", True), "pkg.top": ("", False)}
    assert graph(nested)["pkg.sub"] == {"pkg.top"}


def test_the_worker_and_the_contract_never_import_the_portal():
    control = sources("app")["app.credit.ledger"]
    assert "dedloc_common.contract" in imports_of("app.credit.ledger", *control, set())  # the reader reads
    for package in ("dedloc_worker", "dedloc_common"):
        modules = sources(package)
        assert len(modules) > 3
        portal = {(name, target) for name, (source, init) in modules.items()
                  for target in imports_of(name, source, init, set(modules))
                  if target == "app" or target.startswith("app.")}
        assert not portal, f"{package} imports the portal: {sorted(portal)}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_modules_of_a_package_import_each_other_in_a_cycle(package):
    edges = graph(sources(package))
    assert any(edges.values())  # the reader found this package's own imports
    found = cycle(edges)
    assert not found, f"import cycle in {package}: {' -> '.join(found)}"
