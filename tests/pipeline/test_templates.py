"""The set-up's empty, migrated databases (tasks/templates.py): used only where they exist, for the
installed versions, and where no setting says otherwise."""

from __future__ import annotations

import sqlite3

import pytest

from tasks import templates
from tasks.record import TEMPLATE_ENV
from tasks.state import PREFECT_TEMPLATE_ENV


def test_defaults_name_the_templates_that_exist_and_nothing_set(tmp_path, monkeypatch):
    monkeypatch.setattr(templates, "FOLDER", tmp_path)
    env: dict[str, str] = {}
    templates.defaults(env)
    assert env == {}  # none made: a first run migrates, as without a set-up
    templates.prefect_template().write_bytes(b"")
    templates.mlflow_template().write_bytes(b"")
    templates.defaults(env)
    assert env == {PREFECT_TEMPLATE_ENV: str(templates.prefect_template()), TEMPLATE_ENV: str(tmp_path)}
    kept = {PREFECT_TEMPLATE_ENV: "", TEMPLATE_ENV: "/elsewhere"}
    templates.defaults(kept)  # a setting (even an empty one: no template) wins
    assert kept == {PREFECT_TEMPLATE_ENV: "", TEMPLATE_ENV: "/elsewhere"}


def test_a_template_is_named_by_the_installed_version():
    import mlflow
    import prefect

    assert templates.prefect_template().name == f"prefect-{prefect.__version__}.db"
    assert templates.mlflow_template().name == f"mlflow-{mlflow.__version__}-empty.db"


@pytest.mark.slow
def test_the_made_templates_are_migrated_and_hold_no_run(tmp_path):
    from privprompt_commands.templates import make

    made = make(tmp_path)
    assert sorted(p.name for p in made) == sorted([templates.prefect_template(tmp_path).name,
                                                   templates.mlflow_template(tmp_path).name])
    with sqlite3.connect(templates.prefect_template(tmp_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM alembic_version").fetchone()[0] == 1
        assert db.execute("SELECT COUNT(*) FROM flow_run").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM block_type").fetchone()[0] > 0  # registered: what a first start spends
    with sqlite3.connect(templates.mlflow_template(tmp_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0
    for p in made:
        assert p.stat().st_mode & 0o077 == 0
    assert make(tmp_path) == []  # made once
