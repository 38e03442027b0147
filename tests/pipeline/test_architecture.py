"""The layering rules of the code, checked on its import graph (issue 36).

The graph is built from the source with ``ast``, imports inside functions included (a function-level
import is a dependency all the same: it only defers it until the function runs). An edge A → B means
module A imports project module B: ``from pkg import name`` counts as importing ``pkg.name`` when
that is a module, else ``pkg``.

* ``privacy/`` has no import cycle: its modules form layers (validation, events → trials → rdp →
  pld → accountants → accountant → calibrate, selection …), each readable and testable from below.
* ``privacy/`` outside its ledger subpackage (``privacy/ledger/``) imports no torch, Prefect, MLflow
  or SQLAlchemy, directly or through another project module: the privacy claims rest on numpy,
  scipy and dp-accounting alone. The ledger subpackage is the only part of ``privacy/`` allowed
  SQLAlchemy (and nothing else heavy), and it imports nothing from ``tasks/``, ``flows/`` or ``models/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("privacy", "models", "tasks", "flows", "privprompt_commands")
SCRIPTS = ("privprompt_cli", "privprompt_worker")
# the ledger subpackage (SQLAlchemy, sqlite, a team's PostgreSQL): the one part of privacy/ allowed
# SQLAlchemy, and no other heavy framework
LEDGER = "privacy.ledger"
HEAVY = {"torch", "prefect", "mlflow", "sqlalchemy"}


def in_ledger(module: str) -> bool:
    return module == LEDGER or module.startswith(LEDGER + ".")


def project_modules() -> dict[str, Path]:
    """Dotted name → file of every module of the project (packages by their ``__init__``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for script in SCRIPTS:
        if (REPO / f"{script}.py").is_file():
            modules[script] = REPO / f"{script}.py"
    return modules


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every absolute name the source imports, anywhere (module level or inside functions):
    ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and ``a.b``."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` that can run: all of it but the bodies of ``if TYPE_CHECKING:``
    (annotations only, never imported at run time; their ``else`` branches do run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _is_type_checking(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def test_imports_under_type_checking_are_not_run_time_imports():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\ndef f():\n    import c\n"
    names = {alias.name for n in runtime_nodes(ast.parse(source)) if isinstance(n, ast.Import) for alias in n.names}
    assert names == {"b", "c"}


def module_imports(source: str, module: str, is_package: bool, modules) -> set[str]:
    """The project modules the source imports when it runs (inside functions too; not the
    annotation-only imports under ``if TYPE_CHECKING:``): for ``from a import b``, ``a.b`` when it
    is a module, else ``a``; for ``import a.b``, the longest module prefix of ``a.b``."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()

    def longest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for node in runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(filter(None, (longest(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else longest(base)
                if target:
                    out.add(target)
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: module_imports(p.read_text(), m, p.name == "__init__.py", modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]], scope: str) -> list[list[str]]:
    """The import cycles among the modules under ``scope``: each strongly connected component
    of more than one module (Tarjan), sorted."""
    nodes = sorted(m for m in graph if not scope or m == scope or m.startswith(scope + "."))
    inside = set(nodes)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v] & inside):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_counts_imports_inside_functions_and_relative_ones():
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    source = ("import numpy\nfrom . import b\n"
              "def f():\n    from .sub.c import thing\n    from ..outside import x\n"
              "class K:\n    def g(self):\n        import pkg.sub\n        from pkg import helper\n")
    assert module_imports(source, "pkg.a", False, modules) == {"pkg.b", "pkg.sub.c", "pkg.sub", "pkg"}
    assert "numpy" in imported_names(source, "pkg.a", False)
    assert module_imports("from . import a\nfrom .a import y\n", "pkg.sub", True, modules | {"pkg.sub.a"}) == \
        {"pkg.sub.a"}
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}, "a") == [["a.x", "a.y", "a.z"]]
    assert cycles({"a.x": {"a.y"}, "a.y": set(), "b.q": {"a.x"}}, "a") == []


def test_the_project_graph_is_read_whole():
    graph = import_graph()
    assert {"privacy.accountant", "privacy.calibrate", "privacy.accountants", "tasks.lifecycle"} <= set(graph)
    assert "privacy.accountant" in graph["tasks.lifecycle"]  # a module-level import
    assert "privacy.accountant" in graph["tasks.selection"]  # inside functions there


def test_privacy_has_no_import_cycle():
    found = cycles(import_graph(), "privacy")
    assert found == [], f"import cycles among privacy/ modules (imports inside functions counted): {found}"


def test_tasks_has_no_import_cycle():
    found = cycles(import_graph(), "tasks")
    assert found == [], f"import cycles among tasks/ modules: {found}"


def test_the_project_has_no_import_cycle():
    """Among all the project's modules (privacy, models, tasks, flows, the scripts), imports inside
    functions counted."""
    found = cycles(import_graph(), "")
    assert found == [], f"import cycles among the project's modules: {found}"


def _reach(graph: dict[str, set[str]], module: str) -> set[str]:
    """``module`` and every project module it imports, transitively."""
    reach, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in reach:
            reach.add(m)
            todo.extend(graph[m])
    return reach


def _heavy_imports(modules: dict[str, Path], graph, module: str, heavy: set[str]) -> list[str]:
    """'M imports X' for each project module M reachable from ``module`` that imports one of ``heavy``."""
    found = []
    for m in sorted(_reach(graph, module)):
        path = modules[m]
        names = sorted(n for n in imported_names(path.read_text(), m, path.name == "__init__.py")
                       if n.split(".")[0].lower() in heavy)
        if names:
            found.append(f"{m} imports {', '.join(names)}")
    return found


def test_privacy_outside_the_ledger_subpackage_imports_no_heavy_framework():
    """privacy/ outside privacy/ledger/ imports no torch, Prefect, MLflow or SQLAlchemy, directly or
    through any project module it imports (transitively): so none of it imports the ledger either."""
    modules = project_modules()
    graph = import_graph()
    math_modules = sorted(m for m in modules if m.startswith("privacy") and not in_ledger(m))
    assert "privacy.accountant" in math_modules and "privacy.ledger" not in math_modules
    assert "privacy.ledger.store" in modules and "privacy.ledger_store" not in modules  # the subpackage is read
    offenders = {m: found for m in math_modules if (found := _heavy_imports(modules, graph, m, HEAVY))}
    assert offenders == {}, f"privacy/ outside its ledger subpackage reaching a heavy framework: {offenders}"


def test_the_ledger_subpackage_is_the_only_privacy_part_allowed_sqlalchemy():
    """The ledger subpackage uses SQLAlchemy (it is its store) but no torch, Prefect or MLflow, and it
    imports nothing from tasks/, flows/ or models/ (not even through privacy/): it sits under them."""
    modules = project_modules()
    graph = import_graph()
    ledger = sorted(m for m in modules if in_ledger(m))
    assert {"privacy.ledger", "privacy.ledger.store", "privacy.ledger.schema", "privacy.ledger.ledger"} <= set(ledger)
    sqlalchemy_users = sorted(m for m in modules if m.startswith("privacy") and any(
        n.split(".")[0] == "sqlalchemy"
        for n in imported_names(modules[m].read_text(), m, modules[m].name == "__init__.py")))
    assert sqlalchemy_users and all(in_ledger(m) for m in sqlalchemy_users), sqlalchemy_users
    offenders = {m: found for m in ledger if (found := _heavy_imports(modules, graph, m, HEAVY - {"sqlalchemy"}))}
    assert offenders == {}, f"the ledger subpackage reaching torch, Prefect or MLflow: {offenders}"
    upward = {m: sorted(d for d in _reach(graph, m) if d.split(".")[0] in ("tasks", "flows", "models")
                        or d in SCRIPTS) for m in ledger}
    assert {m: d for m, d in upward.items() if d} == {}, f"the ledger subpackage importing tasks/flows/models: {upward}"


# ---- function length (issue 36: no function over 80 lines, at most five over 60) ---------------

LONGEST, LONG, MOST_LONG = 80, 60, 5

def function_lengths(source: str) -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to its last line) of every function and method,
    nested ones too (a nested function counts in its own right and inside its parent)."""
    out = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def long_functions(limit: int) -> list[tuple[int, str]]:
    """(lines, ``file:function``) of the project's functions over ``limit`` lines, longest first
    (the project: its packages and scripts; tests, benches and docs' result scripts are not)."""
    found = []
    for path in project_modules().values():
        rel = path.relative_to(REPO).as_posix()
        found += [(n, f"{rel}:{name}") for name, n in function_lengths(path.read_text()) if n > limit]
    return sorted(found, reverse=True)


def test_function_lengths_are_measured_from_def_to_last_line():
    source = "def f():\n    x = 1\n\n    def g():\n        return x\n    return g\n\n\nclass A:\n    def m(self):\n        pass\n"
    assert function_lengths(source) == [("f", 6), ("f.g", 2), ("A.m", 2)]


def test_no_function_over_80_lines_and_at_most_five_over_60():
    over_longest, over_long = long_functions(LONGEST), long_functions(LONG)
    assert over_longest == [], f"functions over {LONGEST} lines: {over_longest}"
    assert len(over_long) <= MOST_LONG, f"more than {MOST_LONG} functions over {LONG} lines: {over_long}"
