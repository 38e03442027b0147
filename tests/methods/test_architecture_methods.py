"""Methods depend downward only (issue 36): a method package under ``tasks/methods/<m>/`` imports
the method interface, the toolkit ``tasks/methodkit/`` and the data-level modules — never another
method package, at module level or inside a function; the toolkit imports no method package; the
comparison report reads what methods declare and names none of them. Checked on the source with
``ast`` (imports under ``if TYPE_CHECKING:`` are not run, and are not counted)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
METHODS = REPO / "tasks" / "methods"
TOOLKIT = REPO / "tasks" / "methodkit"
METHOD_PACKAGES = sorted(p.name for p in METHODS.iterdir() if (p / "__init__.py").is_file())
# what a method package may import from tasks/ besides its own package: the registry's door
# (``tasks.methods``: register_method, get_method), the interface, the toolkit, the data level
ALLOWED = ("tasks.methods.base", "tasks.methodkit", "tasks.schema", "tasks.errors", "tasks.data", "tasks.state",
           "tasks.prompts", "tasks.neighbours")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``source`` — module level and inside functions
    and classes; ``from X import y`` counts X and X.y (y may be a submodule); relative imports are
    resolved against ``module``; ``importlib.import_module("...")`` with a literal counts too."""
    tree = ast.parse(source)
    skipped = _type_checking_nodes(tree)
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _is_under(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def _files(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        yield path, _module_name(path), path.name == "__init__.py"


def test_the_scanner_sees_imports_inside_functions_and_relative_ones():
    """The check below is only as good as its scanner: it resolves relative imports, counts
    ``from .. import <package>`` and imports inside functions, skips TYPE_CHECKING blocks."""
    source = ("from typing import TYPE_CHECKING\nfrom .. import register_method\n"
              "if TYPE_CHECKING:\n    from ..rapt.model import RaptModel\n"
              "class M:\n    def train(self):\n        from ..prompt_dpsgd.method import PromptDPSGD\n"
              "        from .. import dpzero\n        import importlib\n"
              "        importlib.import_module('tasks.methods.post.transfer')\n")
    found = [m for _, m in imported_modules(source, "tasks.methods.toy.method")]
    assert "tasks.methods.prompt_dpsgd.method" in found and "tasks.methods.dpzero" in found
    assert "tasks.methods.post.transfer" in found and "tasks.methods.register_method" in found
    assert not [m for m in found if m.startswith("tasks.methods.rapt")]  # TYPE_CHECKING only
    assert _module_name(METHODS / "post" / "__init__.py") == "tasks.methods.post"
    assert [m for _, m in imported_modules("from .method import Post", "tasks.methods.post", is_package=True)] == [
        "tasks.methods.post.method", "tasks.methods.post.method.Post"]
    own = "tasks.methods.toy"
    assert _allowed("tasks.methods.register_method", own) and _allowed("tasks.methodkit.training", own)
    assert not _allowed("tasks.stages", own) and not _allowed("tasks.methods.rapt", own)


def _allowed(name: str, own: str) -> bool:
    """May a module of the method package ``own`` import ``name``?"""
    if not name.startswith("tasks.") or name == "tasks.methods" or _is_under(name, own):
        return True
    if any(_is_under(name, a) for a in ALLOWED):
        return True
    if name.startswith("tasks.methods."):  # ``from tasks.methods import register_method``: the registry's door
        rest = name[len("tasks.methods."):]
        return "." not in rest and rest not in METHOD_PACKAGES and not (METHODS / f"{rest}.py").exists()
    return False


@pytest.mark.parametrize("package", METHOD_PACKAGES)
def test_a_method_package_imports_no_other_method_package(package):
    others = [f"tasks.methods.{p}" for p in METHOD_PACKAGES if p != package]
    own = f"tasks.methods.{package}"
    wrong = []
    for path, module, is_package in _files(METHODS / package):
        for line, name in imported_modules(path.read_text(), module, is_package):
            where = f"{path.relative_to(REPO)}:{line}"
            if any(_is_under(name, other) for other in others):
                wrong.append(f"{where} imports {name} (another method package)")
            elif not _allowed(name, own):
                wrong.append(f"{where} imports {name} (a method package imports only its own modules, the "
                             f"registry's door tasks.methods and {', '.join(ALLOWED)})")
    assert not wrong, "\n".join(wrong)


def test_the_toolkit_imports_no_method_package():
    wrong = [f"{path.relative_to(REPO)}:{line} imports {name}"
             for path, module, is_package in _files(TOOLKIT)
             for line, name in imported_modules(path.read_text(), module, is_package)
             if any(_is_under(name, f"tasks.methods.{p}") for p in METHOD_PACKAGES)
             or any(_is_under(name, f"tasks.{above}") for above in ("stages", "lifecycle", "selection", "pipeline",
                                                                     "comparison", "audit", "publish"))]
    assert not wrong, "\n".join(wrong)


def test_no_platform_module_imports_a_method_package():
    """The platform (``tasks/`` outside ``tasks/methods/``, ``flows/``, the CLI) reaches a method only
    through the registry: what several need sits in the toolkit or in ``models/``."""
    paths = [p for p in (REPO / "tasks").rglob("*.py") if METHODS not in p.parents]
    paths += [*(REPO / "flows").rglob("*.py"), *(REPO / "privprompt_commands").rglob("*.py"), REPO / "privprompt_cli.py",
              REPO / "privprompt_worker.py"]
    wrong = []
    for path in sorted(paths):
        rel = path.relative_to(REPO)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for line, name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if any(_is_under(name, f"tasks.methods.{p}") for p in METHOD_PACKAGES):
                wrong.append(f"{rel}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_comparison_names_no_method():
    """tasks/comparison.py reads what the methods declare: no registered method's name (or class
    name) appears in it as a word, nor a method's label, nor an import of a method package."""
    from tasks.methods import get_method, registered_methods

    text = (REPO / "tasks" / "comparison.py").read_text()
    hits = []
    for name in registered_methods():
        method = get_method(name)
        for word, flags in ((name, re.I), (type(method).__name__, 0), (method.label, 0)):
            if word and re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text, flags):
                hits.append(f"{name}: {word!r}")
    assert not hits, hits
    found = [m for _, m in imported_modules(text, "tasks.comparison")]
    assert not [m for m in found if any(_is_under(m, f"tasks.methods.{p}") for p in METHOD_PACKAGES)]
    assert not [m for m in found if _is_under(m, "tasks.methodkit")]


def test_each_method_is_registered_by_its_own_package():
    """Each built-in spec is declared by one method package's module; its mechanism is that
    package's own class or the toolkit's (tasks/methodkit) — never another method package's."""
    import sys

    from tasks.methods import METHODS

    for spec in METHODS.values():
        holders = {name for name, module in list(sys.modules.items())
                   if name.startswith("tasks.methods.") and name.count(".") >= 3
                   and any(value is spec for value in vars(module).values())}
        if not holders:
            continue  # a package outside the project (a test's toy method)
        packages = {h.split(".")[2] for h in holders}
        assert len(packages) == 1, (spec.name, holders)
        mechanism = type(spec.mechanism).__module__
        assert mechanism.startswith("tasks.methodkit.") or mechanism.split(".")[2] in packages, (spec.name, mechanism)
        for base in type(spec.mechanism).__mro__[1:]:
            if base.__module__.startswith("tasks.methods.") and base.__module__ not in ("tasks.methods.base",
                                                                                     "tasks.methods.legacy"):
                assert base.__module__.split(".")[2] in packages, (spec.name, base)


def _post_config(tmp_path, **post):
    from tasks.config import parse_config

    shared = REPO.parent / "shared" / "data"
    return parse_config({
        "method": "post", "experiment": "x", "state_dir": str(tmp_path), "allow_nonprivate_baselines": True,
        "data": {"name": "sst2", "labels": ["negative", "positive"]}, "models": {"local": "tiny-gpt2"},
        "public": {"name": "tweet_sentiment", "path": str(shared / "tweet_sentiment"), "size": 40},
        "methods": {"post": post}})


def test_post_full_pt_runs_the_toolkits_nonprivate_trainer_through_the_lifecycle(tmp_path):
    """POST's Full PT asks the flow's door (``run_method``: the lifecycle, which records the
    non-private use in the ledger) for the method the toolkit's non-private trainer is registered
    as — by the toolkit's class, not another package's name."""
    from tasks.methodkit.prompt_methods import NonPrivateSoftPrompt
    from tasks.methods import get_method

    cfg = _post_config(tmp_path, full_pt=True)
    asked = []

    def run_method(name):
        asked.append(name)
        return SimpleNamespace(prompt_path="/private/full_pt.safetensors")

    result = SimpleNamespace(epsilon=1.0, guarantee="dp", source_prompt_path="/outputs/post_source.safetensors")
    variants = get_method("post").extras.variants(SimpleNamespace(cfg=cfg), result, {"student_dir": "/s"}, run_method)
    assert len(asked) == 1 and isinstance(get_method(asked[0]).mechanism, NonPrivateSoftPrompt)
    full = [v for v in variants if v.name == "full_pt"]
    assert full and full[0].prompt_path == "/private/full_pt.safetensors" and full[0].guarantee == "none"
    assert get_method("post").extras.variants(SimpleNamespace(cfg=_post_config(tmp_path)), result, {"student_dir": "/s"},
                                       run_method) and len(asked) == 1  # off: nothing else trained


def test_post_full_pt_without_the_nonprivate_trainer_is_refused_at_config_time(tmp_path):
    """Were the non-private trainer not registered, the config says so in one line before anything
    runs (not after the DP run has spent its budget)."""
    from tasks.errors import ConfigError
    from tasks.methodkit.prompt_methods import NON_PRIVATE_SOFT_PROMPT, NonPrivateSoftPrompt
    from tasks.methods import get_method, register_method, unregister_method

    registered = get_method(NON_PRIVATE_SOFT_PROMPT)
    unregister_method(NON_PRIVATE_SOFT_PROMPT)
    try:
        with pytest.raises(ConfigError, match="non-private soft-prompt trainer registered as 'prompt_sgd'"):
            _post_config(tmp_path, full_pt=True)
        _post_config(tmp_path)  # without Full PT nothing needs it
    finally:
        register_method(registered)
    assert isinstance(get_method(NON_PRIVATE_SOFT_PROMPT).mechanism, NonPrivateSoftPrompt)


def _import_graph() -> dict[str, set[str]]:
    """The project's modules (tasks, privacy, flows, models) → the project modules they import
    (inside functions too; an imported name resolves to the deepest module it lies in)."""
    modules = {}
    for top in ("tasks", "privacy", "flows", "models"):
        for path, module, is_package in _files(REPO / top):
            modules[module] = (path, is_package)
    graph = {}
    for module, (path, is_package) in modules.items():
        graph[module] = set()
        for _, name in imported_modules(path.read_text(), module, is_package):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def _in_cycles(graph: dict[str, set[str]]) -> set[str]:
    """The modules that lie on an import circle (strongly connected components of 2 or more)."""
    index, low, stack, on, cyclic = {}, {}, [], set(), set()

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                cyclic.update(component)

    for v in graph:
        if v not in index:
            visit(v)
    return cyclic


def test_the_methods_layer_lies_on_no_import_circle():
    """The method interface, the toolkit, every method package and the comparison report import
    only downward: none of them lies on an import circle of the project (counting imports inside
    functions), whatever circles remain above them."""
    graph = _import_graph()
    assert {"tasks.methods.base", "tasks.methodkit.classifiers", "tasks.comparison"} <= set(graph)
    assert _in_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {"a", "b", "c"}  # the finder finds one
    layer = [m for m in _in_cycles(graph)
             if _is_under(m, "tasks.methods") or _is_under(m, "tasks.methodkit") or m == "tasks.comparison"]
    assert not layer, sorted(layer)


def test_the_toolkits_split_reader_reads_what_the_data_layer_reads(tmp_path):
    """The toolkit reads a partition split without ``tasks.data`` (above it, with the config
    schema): the same texts and labels as ``tasks.data.read_partition_split``, extra columns aside."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.data import read_partition_split
    from tasks.methodkit.classifiers import read_split

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"unit": ["u1", "u2", "u1"], "text": ["a fine film", "dull é", ""],
                             "label": ["positive", "negative", "positive"]}), path)
    assert read_split(str(path)) == read_partition_split(str(path)) == (
        ["a fine film", "dull é", ""], ["positive", "negative", "positive"])
