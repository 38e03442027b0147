"""The method registry: one table of methods by name (``tasks.registry.Registry``, the table the
attacks and data sources use too; compare PEFT's ``register_peft_method``). Flows, the CLI, the audit and the sweep look methods up here
and never compare method names.

A method lives in ONE package: ``tasks/methods/<name>/`` holds its :class:`~tasks.methods.base.MethodSpec`
(registered with :func:`register_method`), its :class:`~tasks.methods.base.Mechanism` and config block (``method.py``), its own torch
code, and its privacy events if it has new ones. Every package in this folder is imported (and so
registered) on first use: adding a method is adding its package, plus a config file and tests
(see the README); nothing else lists methods. A package elsewhere registers the same way when it
is imported (``register_method`` is the public door; the config's ``methods:`` block validates
``methods.<name>`` against the registered block when a config is parsed: the schema never changes).

Generic torch stays in ``models/`` (backbones, prompt kinds, per-sample-gradient DP training with
its step hooks, scoring); ``base.py`` beside the packages is the interface; what several methods
share sits below them in the toolkit ``tasks/methodkit/`` (classifiers and encodings, soft-prompt /
prefix (DP-)SGD from settings, the skeletons several packages extend). A method package imports
the interface, the toolkit and the data-level modules, never another method package
(``tests/methods/test_architecture_methods.py``).
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from ..registry import Registry
from .base import (Extras, LevelPanel, Mechanism, MethodContext, MethodPlan, MethodSpec, PostProcessed,  # noqa: F401
                   PrivateRows, ReferenceAccuracy, Report, ReportArtifact, ReportMetric, SummaryColumn, Trained,
                   Traits, Variant)
from .legacy import Method, spec_from_class  # noqa: F401


def register_method(method: "MethodSpec | type[Method]"):
    """Register ``method`` under its name: a :class:`MethodSpec`, or (the interface before it, as a
    class decorator) a :class:`Method` subclass, registered as its spec. A second registration of
    a name by another module is an error (the same module again, e.g. on a reload, replaces
    itself). A method registered late (a package outside this folder, imported later) is
    configured like the others: ``methods.<name>`` is validated against its ``config_class`` when a
    config is parsed. Returns ``method``."""
    import sys

    spec = spec_from_class(method) if isinstance(method, type) else method
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"register_method takes a MethodSpec (or a Method subclass), got {method!r}")
    # the module that registers the name owns it (a shared toolkit mechanism owns nothing): another
    # module registering it again is refused, the same module again (a reload) replaces itself
    owner = (f"{method.__module__}.{method.__qualname__}" if isinstance(method, type)
             else f"module {sys._getframe(1).f_globals.get('__name__', '?')}")
    METHODS.put(spec.name, spec, owner)
    return method


def unregister_method(name: str) -> None:
    """Remove ``name`` from the registry (configs parsed afterwards have no ``methods.<name>``): a
    method added for a while (a test's toy method, a plugin being reloaded)."""
    METHODS.remove(name)


PLUGIN_GROUP = "privprompt.methods"
PLUGIN_ENV = "PRIVPROMPT_METHOD_PLUGINS"


def _load_builtins() -> None:
    """Import every method package of this folder (once; alphabetical order), then the modules
    named in ``$PRIVPROMPT_METHOD_PLUGINS`` (comma-separated, importable from ``sys.path``: inherited
    by Dask workers and subprocesses), then the packages installed distributions declare under the
    ``privprompt.methods`` entry-point group (a method kept in its own repository:
    ``[project.entry-points."privprompt.methods"] my_method = "my_package"``), so the CLI,
    deployments and workers know it without an import of their own."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - one line naming the plugin
            raise ImportError(f"method plugin {module!r} (${PLUGIN_ENV}) failed to import: "
                              f"{type(exc).__name__}: {exc}") from exc
    from importlib.metadata import entry_points

    for point in sorted(entry_points(group=PLUGIN_GROUP), key=lambda p: p.name):
        try:
            point.load()
        except Exception as exc:  # noqa: BLE001 - one line naming the plugin
            raise ImportError(f"method plugin {point.name!r} ({point.value}, entry point group {PLUGIN_GROUP}) "
                              f"failed to import: {type(exc).__name__}: {exc}") from exc


METHODS = Registry("method", _load_builtins, "method {name} is not registered; registered methods: {names}")


def registered_methods() -> list[str]:
    return METHODS.names()


def get_method(name: str) -> MethodSpec:
    return METHODS.get(name)
