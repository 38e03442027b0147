"""Where a dataset's records come from, by name (a registry, like the methods' and the attacks'):
the file formats of a data folder's split files (``jsonl``, ``csv``, ``parquet``: a split is the file
``<split><suffix>`` of one registered format) and the sources a config names itself (``hub``: a
Hugging Face hub dataset, ``data.hub``). :mod:`tasks.data` reads every source through this registry
and never compares format names or suffixes.

A source lives in ONE module of this folder: a :class:`DataSource` subclass decorated with
:func:`register_source`. Every module here is imported (and so registered) on first use; a source
elsewhere registers the same way when it is imported (a test's toy format, a plugin). A reader returns
rows as dicts (the config's ``data.text_field`` / ``data.label_field`` / unit field pick the columns)
and raises :class:`~tasks.errors.DataError` in one line that never quotes a record's content.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import DataError
from ..registry import Registry, import_folder


class DataSource:
    """A kind of data source. A file format has ``suffixes`` and :meth:`read_file`; a source named by
    the config answers :meth:`named_by` and has :meth:`read_split`."""

    name: str = ""
    suffixes: tuple[str, ...] = ()  # lower case, with the dot; empty: not a file format
    # which format's file is the split when a folder holds one in several (lower first; the built-ins
    # keep the order they always had: .jsonl, .json, .csv, .parquet)
    precedence: int = 100

    def read_file(self, path: Path) -> list[dict]:
        """The rows of one split file."""
        raise NotImplementedError(f"data source {self.name!r} reads no files")

    def named_by(self, cfg: Any) -> bool:
        """Whether the data config ``cfg`` names this source itself (instead of a data folder)."""
        return False

    def read_split(self, cfg: Any, split: str) -> list[dict]:
        """The rows of one split of the source the config names."""
        raise NotImplementedError(f"data source {self.name!r} is not named by a config")

    def describe(self, cfg: Any, split: str) -> str:
        """How errors name one split of the source the config names (never a record)."""
        return f"{self.name} dataset {cfg.name}:{split}"

    def signature(self, cfg: Any) -> str:
        """Identifies the source the config names (caches notice another one)."""
        return f"{self.name}:{cfg.name}"


def _check(cls, registered) -> None:
    """A file suffix belongs to one source; suffixes are lower case with the dot."""
    for other in registered.values():
        shared = set(other.suffixes) & {s.lower() for s in cls.suffixes}
        if shared:
            raise ValueError(f"data source {cls.name!r}: file suffix {sorted(shared)[0]!r} is already read by "
                             f"data source {other.name!r}")
    if any(not s.startswith(".") or s != s.lower() for s in cls.suffixes):
        raise ValueError(f"data source {cls.name!r}: suffixes are lower case and start with a dot, got {cls.suffixes}")


SOURCES = Registry("data source", lambda: import_folder(__name__, __path__),
                   "unknown data source {name}; registered data sources: {names}")


def register_source(cls: type[DataSource]) -> type[DataSource]:
    """Class decorator: register ``cls`` under ``cls.name``; a name, or a file suffix, that another
    class registered already is an error."""
    return SOURCES.add(cls, _check)


def unregister_source(name: str) -> None:
    """Remove ``name`` from the registry (a source added for a while: a test's toy format)."""
    SOURCES.remove(name)


def registered_sources() -> list[str]:
    """The registered source names, in registration order."""
    return SOURCES.names()


def get_source(name: str) -> DataSource:
    """The source registered as ``name``; one line listing the registered ones when there is none."""
    return SOURCES.get(name)


def _file_formats() -> list[DataSource]:
    return sorted((s for s in SOURCES.values() if s.suffixes), key=lambda s: s.precedence)


def file_suffixes() -> tuple[str, ...]:
    """Every registered file suffix, in precedence order (the first present file is the split)."""
    return tuple(suffix for source in _file_formats() for suffix in source.suffixes)


def source_for_file(path: Path) -> DataSource:
    """The file format of ``path`` by its suffix; one line listing the registered ones otherwise."""
    suffix = path.suffix.lower()
    for source in _file_formats():
        if suffix in source.suffixes:
            return source
    raise DataError(f"unsupported data file format {path.suffix!r} ({path}); use {', '.join(file_suffixes())}")


def named_source(cfg: Any) -> DataSource | None:
    """The source the data config names itself (e.g. ``data.hub``), None for a data folder's files."""
    for source in SOURCES.values():
        if source.named_by(cfg):
            return source
    return None


def read_file(path: Path) -> list[dict]:
    """The rows of one split file, read by its format; a file that cannot be read is one line
    naming the file and the kind of problem, never its content."""
    source = source_for_file(path)
    try:
        return source.read_file(path)
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {path}: {type(err).__name__}") from None


def malformed(path: Path, err: BaseException) -> DataError:
    """The one-line error of a file its format's parser refused (the parser's message may quote the
    file's content, so only its type is given)."""
    return DataError(f"cannot read {path}: malformed {path.suffix.lower().lstrip('.')} ({type(err).__name__})")
