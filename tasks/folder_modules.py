"""Import every module of a registry's folder once: how the attack and data-source registries
load their built-ins (each module registers itself when imported)."""

from __future__ import annotations

import importlib
import pkgutil


def import_folder(package: str, path) -> None:
    """Import each module of ``package`` (its ``__path__``: ``path``) not starting with ``_``,
    in alphabetical order."""
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")
