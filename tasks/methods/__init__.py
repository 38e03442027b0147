"""The method registry: one table of methods by name (compare PEFT's ``register_peft_method``
and Opacus's accountant registry). Flows, the CLI, the audit and the sweep look methods up here
and never compare method names.

Adding a method: a config block and a :class:`~tasks.methods.base.Method` subclass in a module
of this package, decorated with :func:`register_method`, its import in ``BUILTIN`` below, its
torch code under ``models/``, a config file and tests (see the README).
"""

from __future__ import annotations

import importlib

from .base import (Method, MethodContext, MethodPlan, PostProcessed, PrivateRows, Trained,  # noqa: F401
                   Variant)

_REGISTRY: dict[str, Method] = {}

# the built-in methods, one module each
BUILTIN = ("zero_shot", "prompt_sgd", "prompt_dpsgd", "prefix_dpsgd", "privacy_flat", "post", "dpzero", "dp_opt",
           "rapt")


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: register ``cls`` under ``cls.name`` (a second registration of a name
    by another class is an error)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a method needs an identifier as its name, got {name!r}")
    existing = _REGISTRY.get(name)
    if existing is not None and type(existing) is not cls and type(existing).__qualname__ != cls.__qualname__:
        raise ValueError(f"method {name!r} is already registered by {type(existing).__qualname__}")
    _REGISTRY[name] = cls()
    return cls


def _load_builtins() -> None:
    for module in BUILTIN:
        importlib.import_module(f"{__name__}.{module}")


def registered_methods() -> list[str]:
    _load_builtins()
    return list(_REGISTRY)


def get_method(name: str) -> Method:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"method {name!r} is not registered; registered methods: {', '.join(_REGISTRY)}") from None
