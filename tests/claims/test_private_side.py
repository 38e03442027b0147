"""The private side is the owner's alone (issue 35, defects 5 and 6).

* The state folder, ``private/`` and every file written there are 0700 / 0600 whatever the
  caller's umask (0022 and 0000 here), and so is a SQLite ledger file (the state folder's, or a
  team's elsewhere) with its journals; folders made 0755 before this rule are tightened on first
  use. A second local user (made with ``useradd``; skipped where that is impossible) cannot list
  the state folder or ``private/`` or read the ledger file after a real run.
* A dp run publishes no exact split size: not the train / holdout / test counts, not the loss
  attack's pool counts (``mia.loss.n_members`` / ``n_nonmembers``), not a base rate that gives
  both pools; the pools are sized from the released sizes.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


class _Umask:
    def __init__(self, mask: int):
        self.mask = mask

    def __enter__(self):
        self.old = os.umask(self.mask)

    def __exit__(self, *exc):
        os.umask(self.old)


def _assert_owner_only_tree(top: Path) -> list[Path]:
    """Every folder under ``top`` (itself included) 0700 and every file 0600; returns the files."""
    assert _mode(top) == 0o700, top
    files = []
    for folder, dirs, names in os.walk(top):
        for d in dirs:
            assert _mode(Path(folder) / d) == 0o700, Path(folder) / d
        for n in names:
            p = Path(folder) / n
            if p.is_symlink():
                continue
            assert _mode(p) == 0o600, (p, oct(_mode(p)))
            files.append(p)
    return files


# ---- the building blocks, under the umasks a caller may have -----------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask0022", "umask0000"])
def test_state_folders_are_made_and_tightened_owner_only(tmp_path, umask):
    from tasks.state import make_private_dir, open_private, state_paths

    outside = tmp_path / "outside.txt"
    outside.write_text("not ours to tighten")
    outside.chmod(0o644)
    with _Umask(umask):
        # a state folder of an earlier version: folders 0755, files 0644 (a link to a file elsewhere)
        old = tmp_path / "old"
        (old / "private" / "runs" / "r1").mkdir(parents=True)
        for d in (old, old / "private", old / "private" / "runs", old / "private" / "runs" / "r1"):
            d.chmod(0o755)
        (old / "private" / "runs" / "r1" / "history.json").write_text("[]")
        (old / "private" / "runs" / "r1" / "history.json").chmod(0o644)
        (old / "private" / "link").symlink_to(outside)
        (old / "ledger.sqlite").write_bytes(b"")
        (old / "ledger.sqlite").chmod(0o644)
        paths = state_paths(str(old)).create()
        assert _mode(paths.root) == 0o700
        assert [p.name for p in _assert_owner_only_tree(paths.private)] == ["history.json"]  # the link: not a file
        assert _mode(outside) == 0o644  # a link is never followed out of the state folder
        assert _mode(paths.ledger) == 0o600
        for folder in (paths.artifacts, paths.prefect_home):
            assert _mode(folder) == 0o700
        # a fresh state folder and a nested private folder, every level 0700
        fresh = state_paths(str(tmp_path / "a" / "b" / "state")).create()
        assert _mode(fresh.root) == _mode(fresh.root.parent) == 0o700
        deep = make_private_dir(fresh.private / "x" / "y")
        assert _mode(deep) == _mode(deep.parent) == 0o700
        with open_private(deep / "f.log", "a") as handle:
            handle.write("line\n")
        assert _mode(deep / "f.log") == 0o600


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask0022", "umask0000"])
def test_sqlite_ledger_files_are_owner_only(tmp_path, umask):
    """The state folder's ledger and a team's SQLite file elsewhere: 0600 from their creation, and
    the journals SQLite makes beside them too; an existing 0644 file is tightened when opened."""
    from privacy.ledger import Ledger
    from tasks.state import state_paths

    with _Umask(umask):
        paths = state_paths(str(tmp_path / "state")).create()
        team = tmp_path / "team" / "shared.sqlite"
        for ledger in (paths.open_ledger(), Ledger(f"sqlite:///{team}")):
            assert ledger.datasets() == []
        for db in (paths.ledger, team):
            assert _mode(db) == 0o600
            con = sqlite3.connect(db)  # an open WAL connection: its -wal and -shm exist
            try:
                con.execute("SELECT count(*) FROM sqlite_master").fetchall()
                journals = [db.with_name(db.name + s) for s in ("-wal", "-shm")]
                assert all(j.exists() for j in journals)
                assert [_mode(j) for j in journals] == [0o600, 0o600]
            finally:
                con.close()
        assert _mode(team.parent) == 0o700
        team.chmod(0o644)  # a file made before this rule
        Ledger(f"sqlite:///{team}").datasets()
        assert _mode(team) == 0o600


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask0022", "umask0000"])
def test_selection_log_and_private_history_are_owner_only(tmp_path, umask):
    from tasks.release_store import write_private_history as _write_private_history
    from tasks.selection import private_logger

    with _Umask(umask):
        log = tmp_path / f"selection-{umask}.log"
        private_logger(log).info("trial 1 of K: score 0.5")
        assert _mode(log) == 0o600 and "trial 1" in log.read_text()
        path = _write_private_history(tmp_path, "m", [{"step": 1, "loss": 0.7, "batch_size": 31}])
        assert _mode(path) == _mode(tmp_path / "m_training_curve.png") == 0o600


# ---- a real run under the caller's umask, and a second local user -----------------------------

@pytest.fixture(scope="module")
def other_user():
    """A second local user (``useradd``), removed afterwards; skipped where it cannot be made."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("making a second local user needs root, useradd and setpriv")
    name = f"ppprobe{os.getpid() % 100000}"
    made = subprocess.run(["useradd", "--no-create-home", "--no-user-group", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as_user(user, *argv) -> subprocess.CompletedProcess:
    uid, gid = user
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *argv],
                          capture_output=True, text=True, timeout=60)


# umask 0000 (the worst case) by default; 0022 too with -m slow (a run costs 30-50 s on 2 cores)
@pytest.fixture(scope="module", params=[pytest.param(0o022, marks=pytest.mark.slow), 0o000],
                ids=["umask0022", "umask0000"])
def private_run(request, prefect_harness, sst2_dir):
    """A dp run (prompt_dpsgd with the loss attack: partition, ledger, MLflow, the run's private
    history) in a state folder that a second user could reach (its parent is 0755) and whose
    folders an earlier version made 0755, under the caller's umask ``request.param``."""
    from flows.method_flow import method_flow

    base = Path(tempfile.mkdtemp(prefix="privprompt-perms-", dir="/tmp"))
    base.chmod(0o755)
    try:
        data = _toy_dataset(base / "data", sst2_dir, n_train=300, n_test=83)
        (base / "readable.txt").write_text("anyone may read this")
        (base / "readable.txt").chmod(0o644)
        state = base / "state"
        (state / "private").mkdir(parents=True)
        state.chmod(0o755)
        (state / "private").chmod(0o755)
        (state / "private" / "notes.txt").write_text("left by an earlier version")
        (state / "private" / "notes.txt").chmod(0o644)
        cfg = _config(data, state, **{"mia.max_examples": 1000})
        cfg["methods"]["zero_shot"]["enabled"] = False
        cfg["methods"]["prompt_sgd"]["enabled"] = False
        with _Umask(request.param):
            summary = method_flow(cfg)
        yield {"summary": summary, "state": state, "base": base, "umask": request.param, "config": cfg}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_after_a_run_the_private_side_is_owner_only(private_run):
    state = private_run["state"]
    assert _mode(state) == 0o700
    files = _assert_owner_only_tree(state / "private")
    names = {p.name for p in files}
    assert {"notes.txt", "manifest.json", "train.parquet", "holdout.parquet"} <= names
    assert any(n.endswith("_history.json") for n in names)  # per-step losses, batch sizes, clip rates
    _assert_owner_only_tree(state / "secrets")
    assert _mode(state / "ledger.sqlite") == 0o600
    for journal in (state / "ledger.sqlite-wal", state / "ledger.sqlite-shm"):
        assert not journal.exists() or _mode(journal) == 0o600


def test_another_local_user_reads_nothing_of_a_run(private_run, other_user):
    state, base = private_run["state"], private_run["base"]
    assert _as_user(other_user, "cat", str(base / "readable.txt")).returncode == 0  # the probe can read
    assert _as_user(other_user, "ls", str(base)).returncode == 0
    history = next((state / "private" / "runs").rglob("*_history.json"))
    manifest = next((state / "private" / "partitions").glob("*/manifest.json"))
    for argv in (["ls", str(state)], ["ls", str(state / "private")], ["cat", str(state / "ledger.sqlite")],
                 ["cat", str(state / "mlflow.db")], ["cat", str(history)], ["cat", str(manifest)],
                 ["cat", str(state / "private" / "notes.txt")]):
        probe = _as_user(other_user, *argv)
        assert probe.returncode != 0 and "Permission denied" in probe.stderr, (argv, probe.stdout[:200])


def _config_numbers(node) -> set[float]:
    """The numbers a config holds (public: a published value equal to one says nothing of the data)."""
    if isinstance(node, dict):
        return set().union(*map(_config_numbers, node.values())) if node else set()
    if isinstance(node, (list, tuple)):
        return set().union(*map(_config_numbers, node)) if node else set()
    return {float(node)} if isinstance(node, (int, float)) and not isinstance(node, bool) else set()


def test_a_dp_run_publishes_no_exact_split_size(private_run):
    """Every param, metric and tag of the run and its child runs: no exact train / holdout / test
    count, no exact pool count of the loss attack (with mia.max_examples above every split, today's
    pools WERE the splits), and no base rate n_a / (n_a + n_b) of exact counts. The pools are the
    released sizes. (test.accuracy over the exact test split is the documented exception: a ratio,
    never the count.)"""
    from tasks.data import Partition

    state, summary = private_run["state"], private_run["summary"]
    part = Partition(**json.loads(next((state / "private" / "partitions").glob("*/manifest.json")).read_text()))
    released = part.sizes
    exact = {"train": part.n_train, "holdout": part.n_holdout, "test": part.n_test}
    published = {"train": released.n_train, "holdout": released.n_holdout, "test": released.n_test}
    # a released size that happens to equal its exact one (noise rounded to 0) is published lawfully
    secret = {n for k, n in exact.items() if n != published[k]} - _config_numbers(private_run["config"])
    assert secret, "every released size equals its exact one: nothing to test in this draw"
    ratios = {a / (a + b) for a in exact.values() for b in exact.values()}
    lawful = {a / (a + b) for a in published.values() for b in published.values()}
    client = _mlflow(state)
    parent = client.get_run(summary["mlflow_run_id"])
    runs = [parent] + client.search_runs([parent.info.experiment_id],
                                         f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    seen = 0
    for run in runs:
        values = {**run.data.params, **run.data.metrics,
                  **{k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}}
        for key, value in values.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            seen += 1
            assert number not in secret, (run.data.tags.get("mlflow.runName"), key, value)
            if 0 < number < 1:
                assert not any(abs(number - r) < 1e-12 for r in ratios - lawful), (key, value)
    assert seen > 20
    m = parent.data.metrics
    # the loss attack's pools: the released sizes (mia.max_examples is above every split)
    assert (m["mia.loss.n_members"], m["mia.loss.n_nonmembers"]) == (released.n_train, released.n_holdout)
    assert m["mia.loss.precision_base_rate"] == pytest.approx(
        released.n_train / (released.n_train + released.n_holdout))
    assert [int(parent.data.params[f"data.n_{k}"]) for k in exact] == list(published.values())


def test_encoding_a_long_private_text_logs_no_length(capfd, caplog):
    """Review 8, H5: the tokenizer's "sequence length is longer than the specified maximum (N > M)"
    warning printed one private record's exact token length; every tokenizer call that sees private
    text passes verbose=False (the classifiers' encoding; the causal engine's and RAPT's likewise)."""
    import logging

    from models import build_classifier, load_backbone

    clf = build_classifier(load_backbone("tiny-bert", "cpu"), ["negative", "positive"])
    with caplog.at_level(logging.WARNING):
        clf.encode(["word " * 3000], max_length=24)
    out, err = capfd.readouterr()
    assert "3000" not in out + err + caplog.text and "longer than" not in out + err + caplog.text
