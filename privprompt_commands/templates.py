"""``python -m privprompt_commands.templates``: make the empty, migrated databases a new state folder
starts from (``tasks/templates.py``), where they are missing. ``scripts/setup.sh`` runs it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tasks.templates import FOLDER, backup_sqlite, mlflow_template, prefect_template


def make(folder: Path | None = None) -> list[Path]:
    """Make the missing templates in ``folder``; the paths made."""
    folder = folder or FOLDER
    made = []
    folder.mkdir(parents=True, exist_ok=True)
    if not mlflow_template(folder).is_file():
        from tasks.record import _template

        made.append(_template(folder))
    target = prefect_template(folder)
    if not target.is_file():
        _make_prefect(target)
        made.append(target)
    return made


def _make_prefect(target: Path) -> None:
    """Start Prefect's server once on a throwaway home (its migrations and block registrations),
    stop it, and keep a consistent copy of its database (sqlite's backup) at ``target``."""
    from .run import _local_prefect_server

    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED")}
    with tempfile.TemporaryDirectory(prefix="privprompt-prefect-template-") as home:
        os.environ["PREFECT_HOME"] = home
        os.environ.pop("PREFECT_API_URL", None)
        os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        try:
            server = _local_prefect_server().start()
            try:
                server._wait()
            finally:
                server.stop()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        backup_sqlite(Path(home) / "prefect.db", target)


if __name__ == "__main__":
    for path in make():
        print(f"made {path}")
