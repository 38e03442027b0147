"""Empty, migrated databases made once at set-up, for a new state folder to start from.

A first run on a fresh state folder otherwise waits for Prefect's migrations and block registrations
(16-19 s on 2 cores) and MLflow's schema migrations (5-9 s) before its flow begins. ``scripts/setup.sh``
makes both here, in the environment's ``share/privprompt`` (``python -m privprompt_commands.templates``), named by
the installed versions; :func:`defaults` points ``$PRIVPROMPT_PREFECT_TEMPLATE`` and
``$PRIVPROMPT_MLFLOW_TEMPLATE`` at them when they exist and nothing else is set. They hold schemas and
Prefect's built-in block types only: no run, no record, nothing of any dataset. A template of another
version is never used (an upgraded package starts from its own migrations, as without one).
"""

from __future__ import annotations

import importlib.metadata
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

FOLDER = Path(sys.prefix) / "share" / "privprompt"
MLFLOW_TEMPLATE_ENV = "PRIVPROMPT_MLFLOW_TEMPLATE"  # a folder of migrated empty MLflow stores (tasks/record.py)
PREFECT_TEMPLATE_ENV = "PRIVPROMPT_PREFECT_TEMPLATE"  # a migrated Prefect database (tasks/state.py)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def prefect_template(folder: Path | None = None) -> Path:
    return (folder or FOLDER) / f"prefect-{_version('prefect')}.db"


def mlflow_template(folder: Path | None = None) -> Path:
    return (folder or FOLDER) / f"mlflow-{_version('mlflow')}-empty.db"  # the name tasks.record._template makes


def defaults(environ=os.environ) -> None:
    """Point the template settings at this environment's templates where they exist and are unset."""
    if PREFECT_TEMPLATE_ENV not in environ and prefect_template().is_file():
        environ[PREFECT_TEMPLATE_ENV] = str(prefect_template())
    if MLFLOW_TEMPLATE_ENV not in environ and mlflow_template().is_file():
        environ[MLFLOW_TEMPLATE_ENV] = str(mlflow_template().parent)


def backup_sqlite(source: Path, target: Path) -> None:
    """A consistent copy of the SQLite database ``source`` (sqlite's online backup) put at ``target``
    in one atomic replace: a reader sees no file or the whole copy."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-", suffix=".tmp")
    os.close(fd)
    try:
        src, dst = sqlite3.connect(source), sqlite3.connect(tmp)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
