"""The one table behind the method, attack and data-source registries: instances of registered
classes by name, their built-ins imported on first use (compare PEFT's ``register_peft_method``
and Opacus's accountant registry). The accountants' registry is ``privacy/accountants.py``'s own:
``privacy/`` imports nothing from ``tasks/``."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable


def import_folder(package: str, path) -> None:
    """Import each module of ``package`` (its ``__path__``: ``path``) not starting with ``_``,
    in alphabetical order (each registers itself when imported)."""
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


class Registry:
    """Registered instances of ``kind`` (a method, an attack, a data source) by their class's
    ``name``. ``load`` imports the built-ins and plugins once, on first use (again after a failed
    try); ``unknown``: the one line for a name nobody registered ({name}, {names})."""

    def __init__(self, kind: str, load: Callable[[], None], unknown: str):
        self.kind, self.load, self.unknown = kind, load, unknown
        self.loaded = False
        self.items: dict[str, Any] = {}
        self.owners: dict[str, str] = {}

    def add(self, cls: type, check: Callable[[type, dict], None] | None = None) -> type:
        """Register an instance of ``cls`` under ``cls.name`` (see :meth:`put`); ``check(cls,
        registered)`` refuses what else this kind forbids."""
        name = getattr(cls, "name", None)
        self._check_name(name)
        if check is not None:
            check(cls, {n: item for n, item in self.items.items() if n != name})
        self.put(name, cls(), cls.__qualname__)
        return cls

    def put(self, name: str, item: Any, owner: str) -> None:
        """Register ``item`` under ``name``; ``owner``: who registers it (a class's or a module's
        qualified name). A second owner registering the name is an error (the same owner again, e.g. on a reload,
        replaces itself)."""
        self._check_name(name)
        if name in self.items and self.owners[name] != owner:
            raise ValueError(f"{self.kind} {name!r} is already registered by {self.owners[name]}")
        self.items[name], self.owners[name] = item, owner

    def _check_name(self, name: object) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            article = "an" if self.kind[0] in "aeiou" else "a"
            raise ValueError(f"{article} {self.kind} needs an identifier as its name, got {name!r}")

    def remove(self, name: str) -> None:
        """Unregister ``name`` (a test's toy, a plugin being reloaded)."""
        self.ensure_loaded()
        if self.items.pop(name, None) is None:
            raise KeyError(f"{self.kind} {name!r} is not registered")
        del self.owners[name]

    def ensure_loaded(self) -> None:
        if self.loaded:
            return
        self.loaded = True
        try:
            self.load()
        except BaseException:
            self.loaded = False
            raise

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        self.ensure_loaded()
        return list(self.items)

    def values(self) -> list:
        """The registered instances, in registration order."""
        self.ensure_loaded()
        return list(self.items.values())

    def missing(self, name: object) -> str:
        """The one line for ``name``, which nobody registered."""
        return self.unknown.format(name=repr(name), names=", ".join(self.names()))

    def get(self, name: str):
        """The instance registered as ``name``; one line naming the registered ones otherwise."""
        self.ensure_loaded()
        try:
            return self.items[name]
        except (KeyError, TypeError):
            raise KeyError(self.missing(name)) from None
