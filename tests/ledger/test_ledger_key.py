"""The key of keyed record digests never sits in the ledger database (issue 35, defect 4).

The ledger keeps a 16-byte keyed digest of every train and test record of every dataset. With the
key, anyone who can read the database (a DBA, a backup, a read-only analyst) could test any text
for membership offline. So the key lives in a key file of each machine's state folder, which the
team shares with ``privprompt key export`` / ``privprompt key import``; the database records only
the key's id. A ledger written by the earlier code (schema 6, the key in a ``team_key`` table)
moves its key to the key file on first use and keeps every entry.

* a client holding only the ledger URL finds no key material in any table or column (raw, hex or
  base64), and no value in the database, used as the key, computes a stored digest;
* the normal flow works: a run records digests on machine A, machine B is refused until it imports
  the key, then charges the same source to the same dataset;
* the checked-in ``fixtures/schema6_team_ledger.sqlite`` (made by the code before this change,
  ``fixtures/make_schema6_team_ledger.py``) migrates without losing a row, and its file keeps no
  copy of the key (VACUUM);
* PostgreSQL (``-m servers``) the same way.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa

from privacy import events as ev
from privacy.ledger import Ledger, LedgerKeyError, key_id_of
from privacy.ledger.schema import RECORD_DIGEST_BYTES
from tasks.data import record_digests, records_key
from tasks.state import export_key, import_key, installation_secret, state_paths, team_key
from tests.ledger.test_dataset_records import _charge, _data_cfg, _write

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
_spec = importlib.util.spec_from_file_location("make_schema6_team_ledger", FIXTURES / "make_schema6_team_ledger.py")
_maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_maker)

WORDS = ("quiet", "loud", "bright", "grim", "warm", "cold", "slow", "brisk")


def _rows(tag: str, n: int) -> list[dict]:
    return [{"text": f"{tag} {i}: a {WORDS[i % 8]} film, {WORDS[(i * 3) % 8]} acting and a {WORDS[(i * 5) % 8]} end",
             "label": ("negative", "positive")[i % 2]} for i in range(n)]


TRAIN, TEST = _rows("train", 60), _rows("test", 20)


@pytest.fixture(autouse=True)
def _no_key_file_override(monkeypatch):
    monkeypatch.delenv("PRIVPROMPT_TEAM_KEY_FILE", raising=False)


def _digests(blob: bytes) -> set[bytes]:
    return {blob[i:i + RECORD_DIGEST_BYTES] for i in range(0, len(blob), RECORD_DIGEST_BYTES)}


def _cells(url: str) -> list[bytes]:
    """Every value a client with the ledger URL can read: every row of every table (and the schema)."""
    from privacy.ledger.store import resolve

    engine = sa.create_engine(resolve(url)[0])  # the driver the ledger itself uses
    out = []
    try:
        with engine.connect() as conn:
            names = sa.inspect(conn).get_table_names()
            assert {"datasets", "entries", "dataset_records", "trail", "ledger_meta"} <= set(names)
            for name in names:
                for row in conn.execute(sa.text(f'SELECT * FROM "{name}"')):
                    for value in row:
                        if value is None:
                            continue
                        out.append(bytes(value) if isinstance(value, (bytes, bytearray, memoryview))
                                   else str(value).encode())
            if engine.dialect.name == "sqlite":
                out += [str(r[0]).encode() for r in conn.execute(sa.text("SELECT sql FROM sqlite_master"))
                        if r[0]]
    finally:
        engine.dispose()
    return out


def _forms(key: bytes) -> list[bytes]:
    """The key as it could be written down: raw, hex, base64."""
    return [key, key.hex().encode(), key.hex().upper().encode(), base64.b64encode(key),
            base64.b64encode(key).rstrip(b"="), base64.urlsafe_b64encode(key).rstrip(b"=")]


def _candidate_keys(cells: list[bytes]) -> set[bytes]:
    """Every value in the database as a key, and what it decodes to (hex, base64), and every run of
    text in JSON values (the trail's details)."""
    out = set()
    for c in cells:
        out.add(c)
        text = c.decode("utf-8", "ignore")
        parts = [text]
        try:
            parts += [str(v) for v in _flatten(json.loads(text))]
        except ValueError:
            pass
        for p in parts:
            out.add(p.encode())
            try:
                out.add(bytes.fromhex(p))
            except ValueError:
                pass
            try:
                out.add(base64.b64decode(p, validate=True))
            except ValueError:
                pass
    return {c for c in out if c}


def _flatten(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _flatten(v)
    elif isinstance(value, list):
        for v in value:
            yield from _flatten(v)
    else:
        yield value


def assert_url_alone_computes_no_digest(url: str, key: bytes, members: list[str], files: list[Path] = ()) -> None:
    """No form of ``key`` in any cell (or in the database files), and no value of the database, as the
    key, gives the stored digest of a member; with the key itself it does (the test is not vacuous)."""
    cells = _cells(url)
    stored = set()
    for c in cells:
        if len(c) == RECORD_DIGEST_BYTES:
            stored.add(c)
    assert record_digests(key, members[:1]) in stored           # with the key: a membership oracle
    for form in _forms(key):
        assert not any(form in c for c in cells), "key material in the ledger database"
        for f in files:
            if f.exists():
                assert form not in f.read_bytes(), f"key material in {f.name}"
    candidates = _candidate_keys(cells)
    assert len(candidates) > 50
    member_digests = {record_digests(c, members[:3]) for c in candidates}
    assert not any(_digests(d) & stored for d in member_digests)


def test_a_client_holding_only_the_ledger_url_cannot_compute_a_stored_digest(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    url = f"sqlite:///{tmp_path / 'team' / 'ledger.sqlite'}"
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", url)
    data = _write(tmp_path / "data", TRAIN, TEST)
    part, row, ledger = _charge(_data_cfg(data, "toy", tmp_path / "machine-a"))  # a run records its digests
    key = installation_secret(tmp_path / "machine-a" / "private")
    assert len(_digests(ledger.record_digests(row["fingerprint"]))) == len(TRAIN) + len(TEST)
    assert ledger.team_key_id() == key_id_of(key)
    db = tmp_path / "team" / "ledger.sqlite"
    assert_url_alone_computes_no_digest(url, key, [r["text"] for r in TRAIN],
                                        [db, db.with_name(db.name + "-wal")])
    # machine B: refused without the key, with one line saying how to get it
    with pytest.raises(LedgerKeyError, match="privprompt key export FILE.*privprompt key import FILE") as info:
        _charge(_data_cfg(data, "toy", tmp_path / "machine-b"))
    assert "\n" not in str(info.value) and key.hex() not in str(info.value)
    # the team shares the key: one command on each machine
    shared = tmp_path / "handover" / "team.key"
    assert main(["--state-dir", str(tmp_path / "machine-a"), "key", "export", str(shared)]) == 0
    out = capsys.readouterr().out
    assert key_id_of(key) in out and key.hex() not in out
    assert shared.read_bytes() == key and shared.stat().st_mode & 0o777 == 0o600
    assert main(["--state-dir", str(tmp_path / "machine-b"), "key", "import", str(shared)]) == 0
    assert main(["--state-dir", str(tmp_path / "machine-b"), "key", "show"]) == 0
    out = capsys.readouterr().out
    assert f"team key {key_id_of(key)}" in out and "team-keys" in out and key.hex() not in out
    part_b, row_b, _ = _charge(_data_cfg(data, "toy", tmp_path / "machine-b"))  # the second run, same ledger
    assert row_b["fingerprint"] == row["fingerprint"] and row_b["how"] == "key"
    assert part_b.source_key == part.source_key and len(ledger.datasets()) == 1
    # exporting over another key file, and importing a file that is not a key, are refused (one line)
    (tmp_path / "taken.key").write_bytes(b"x" * 32)
    assert main(["--state-dir", str(tmp_path / "machine-a"), "key", "export", str(tmp_path / "taken.key")]) == 2
    assert "already holds another key" in capsys.readouterr().err
    (tmp_path / "short.key").write_bytes(b"x" * 7)
    assert main(["--state-dir", str(tmp_path / "machine-b"), "key", "import", str(tmp_path / "short.key")]) == 2
    assert "not a 32-byte key" in capsys.readouterr().err


def test_the_export_of_a_ledger_holds_no_key_and_its_import_names_the_key_by_id(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    url = f"sqlite:///{tmp_path / 'team.sqlite'}"
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", url)
    data = _write(tmp_path / "data", TRAIN, TEST)
    _charge(_data_cfg(data, "toy", tmp_path / "machine-a"))
    key = installation_secret(tmp_path / "machine-a" / "private")
    exported = Ledger(url).export()
    text = json.dumps(exported)
    assert exported["team_key_id"] == key_id_of(key) and not any(f.decode() in text for f in _forms(key)[1:])
    # restored into another team ledger: the key id comes along, the key does not
    (tmp_path / "backup.json").write_text(text)
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{tmp_path / 'restored.sqlite'}")
    assert main(["--state-dir", str(tmp_path / "machine-c"), "ledger", "import", str(tmp_path / "backup.json")]) == 0
    capsys.readouterr()
    assert Ledger(tmp_path / "restored.sqlite").team_key_id() == key_id_of(key)
    with pytest.raises(LedgerKeyError, match=f"team key {key_id_of(key)}"):
        installation_secret(tmp_path / "machine-c" / "private")
    other = tmp_path / "other.key"
    other.write_bytes(bytes(32))
    with pytest.raises(LedgerKeyError, match="ask the team for that key's file"):
        import_key(state_paths(str(tmp_path / "machine-c")), other)
    export_key(state_paths(str(tmp_path / "machine-a"), url), tmp_path / "a.key")
    assert import_key(state_paths(str(tmp_path / "machine-c")), tmp_path / "a.key")[0] == key_id_of(key)
    assert installation_secret(tmp_path / "machine-c" / "private") == key


def test_a_lost_installation_key_is_not_minted_anew_over_its_ledgers_datasets(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    monkeypatch.delenv("PRIVPROMPT_LEDGER_URL", raising=False)
    data = _write(tmp_path / "data", TRAIN, TEST)
    _, row, _ = _charge(_data_cfg(data, "toy", tmp_path / "solo"))
    assert main(["--state-dir", str(tmp_path / "solo"), "key", "export", str(tmp_path / "backup.key")]) == 0
    (tmp_path / "solo" / "secrets" / "installation.key").unlink()
    # a fresh key would name the same records another dataset, with a fresh cap: refused, one line
    with pytest.raises(LedgerKeyError, match="restore the key file from a backup.*privprompt key import"):
        installation_secret(tmp_path / "solo" / "private")
    assert main(["--state-dir", str(tmp_path / "solo"), "key", "import", str(tmp_path / "backup.key")]) == 0
    capsys.readouterr()
    _, again, _ = _charge(_data_cfg(data, "toy", tmp_path / "solo"))
    assert again["fingerprint"] == row["fingerprint"] and again["how"] == "key"


# ---- a ledger written by the code before this change ---------------------------------------------

def _rows_of(path: Path) -> dict[str, list]:
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                             "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in tables}
    finally:
        conn.close()


def test_a_schema6_team_ledger_moves_its_key_out_and_keeps_every_entry(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    db = tmp_path / "team" / "ledger.sqlite"
    db.parent.mkdir()
    shutil.copyfile(FIXTURES / _maker.FILE, db)
    before = _rows_of(db)
    ((_, old_key, *_),) = before["team_key"]          # the old code kept the team key here
    assert len(old_key) == 32 and before["dataset_records"]
    url = f"sqlite:///{db}"
    members = _maker.fixture_texts("a", 40)
    with pytest.raises(AssertionError, match="key material"):  # as the old code left it: a membership oracle
        assert_url_alone_computes_no_digest(url, old_key, members)
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", url)
    paths = state_paths(str(tmp_path / "machine-a"))
    ledger = paths.open_ledger()                       # first use: the key moves to machine A's key file
    key_id = key_id_of(old_key)
    kept = paths.team_key_file(key_id)
    assert kept.read_bytes() == old_key and kept.stat().st_mode & 0o777 == 0o600
    after = _rows_of(db)
    assert "team_key" not in after
    for table in ("datasets", "entries", "cap_changes", "record_sets", "dataset_records"):
        assert after[table] == before[table], table    # not a single entry, digest or change lost
    assert after["trail"][:len(before["trail"])] == before["trail"]
    (moved,) = after["trail"][len(before["trail"]):]
    assert moved[2] == "team_key_moved" and json.loads(moved[5])["key_id"] == key_id
    assert ledger.team_key_id() == key_id and sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == 8
    # no copy of the key in the file, its free pages or its log
    assert_url_alone_computes_no_digest(url, old_key, members, [db, db.with_name(db.name + "-wal")])
    # the ledger composes as before, the key is the one its datasets were made with
    assert installation_secret(paths.private) == old_key
    digests = record_digests(old_key, members)
    match = ledger.match_source(records_key(old_key, digests), digests, name="toy-a")
    assert match["how"] == "key" and match["name"] == "toy-a" and match["committed_runs"] == 2
    assert match["reserved_runs"] == 1 and match["released_runs"] == 1 and match["nonprivate_uses"] == 1
    assert {d["name"] for d in ledger.datasets()} == {"toy-a", "toy-b", "legacy-no-records"}
    # a second use changes nothing; another machine is told how to get the key, then has it
    trail = ledger.trail()
    assert paths.open_ledger().trail() == trail
    with pytest.raises(LedgerKeyError, match=f"team key {key_id}.*privprompt key import FILE"):
        installation_secret(tmp_path / "machine-b" / "private")
    assert main(["--state-dir", str(tmp_path / "machine-a"), "key", "export", str(tmp_path / "team.key")]) == 0
    assert main(["--state-dir", str(tmp_path / "machine-b"), "key", "import", str(tmp_path / "team.key")]) == 0
    capsys.readouterr()
    assert installation_secret(tmp_path / "machine-b" / "private") == old_key


def test_the_key_is_moved_to_the_file_named_by_the_environment(tmp_path, monkeypatch):
    db = tmp_path / "ledger.sqlite"
    shutil.copyfile(FIXTURES / _maker.FILE, db)
    old_key = _rows_of(db)["team_key"][0][1]
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{db}")
    monkeypatch.setenv("PRIVPROMPT_TEAM_KEY_FILE", str(tmp_path / "team-share" / "privprompt.key"))
    assert installation_secret(tmp_path / "machine" / "private") == old_key
    assert (tmp_path / "team-share" / "privprompt.key").read_bytes() == old_key
    assert not (tmp_path / "machine" / "secrets" / "team-keys").exists()


def test_a_key_that_cannot_be_kept_stays_in_the_database(tmp_path, monkeypatch):
    """The key leaves the database only once it is safe in its file: a failed write changes nothing."""
    db = tmp_path / "ledger.sqlite"
    shutil.copyfile(FIXTURES / _maker.FILE, db)
    before = _rows_of(db)
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{db}")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("PRIVPROMPT_TEAM_KEY_FILE", str(blocker / "team.key"))
    with pytest.raises(OSError):
        state_paths(str(tmp_path / "machine")).open_ledger()
    after = _rows_of(db)
    assert after["team_key"] == before["team_key"] and after["trail"] == before["trail"]


# ---- key files and backups are their owner's alone ----

def test_a_key_file_open_to_others_is_refused_where_it_is_used_as_the_key(tmp_path, monkeypatch, capsys):
    """$PRIVPROMPT_TEAM_KEY_FILE of mode 0644 (or group-writable): team_key() and `key show` refuse it in
    one line, as ssh refuses such a private key; at 0600 it is the key."""
    from privprompt_cli import main

    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{tmp_path / 'team' / 'ledger.sqlite'}")
    keyfile = tmp_path / "share" / "team.key"
    keyfile.parent.mkdir()
    key = bytes(range(1, 33))
    keyfile.write_bytes(key)
    monkeypatch.setenv("PRIVPROMPT_TEAM_KEY_FILE", str(keyfile))
    paths = state_paths(str(tmp_path / "machine"))
    for mode in (0o644, 0o640, 0o620, 0o604):
        keyfile.chmod(mode)
        with pytest.raises(LedgerKeyError, match=f"open to others than its owner \\(mode {mode:04o}\\).*chmod 600") as info:
            team_key(paths)
        assert "\n" not in str(info.value) and key.hex() not in str(info.value)
        assert main(["--state-dir", str(tmp_path / "machine"), "key", "show"]) == 2
        err = capsys.readouterr().err
        assert f"mode {mode:04o}" in err and err.count("\n") == 1
    assert Ledger(tmp_path / "team" / "ledger.sqlite").team_key_id() is None   # nothing recorded from it
    keyfile.chmod(0o600)
    assert team_key(paths) == key
    assert main(["--state-dir", str(tmp_path / "machine"), "key", "show"]) == 0
    assert key_id_of(key) in capsys.readouterr().out


def test_key_import_of_an_open_copy_keeps_it_0600_and_warns(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{tmp_path / 'team' / 'ledger.sqlite'}")
    brought = tmp_path / "brought.key"
    key = bytes(range(2, 34))
    brought.write_bytes(key)
    brought.chmod(0o644)
    assert main(["--state-dir", str(tmp_path / "machine"), "key", "import", str(brought)]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "mode 0644" in captured.err and f"delete {brought}" in captured.err
    assert captured.err.count("\n") == 1 and key.hex() not in captured.err + captured.out
    kept = state_paths(str(tmp_path / "machine")).team_key_file(key_id_of(key))
    assert kept.read_bytes() == key and kept.stat().st_mode & 0o777 == 0o600
    assert kept.parent.stat().st_mode & 0o777 == 0o700
    # a copy that is the owner's alone: no warning
    private_copy = tmp_path / "private.key"
    export_key(state_paths(str(tmp_path / "machine")), private_copy)
    assert main(["--state-dir", str(tmp_path / "machine"), "key", "import", str(private_copy)]) == 0
    assert capsys.readouterr().err == ""


def test_the_state_folders_own_key_file_left_open_is_tightened_not_refused(tmp_path):
    paths = state_paths(str(tmp_path / "solo")).create()
    key = installation_secret(paths.private)
    paths.installation_key.chmod(0o644)   # as a copy restored with a loose umask, in the 0700 folder
    assert installation_secret(paths.private) == key
    assert paths.installation_key.stat().st_mode & 0o777 == 0o600


def test_ledger_json_out_writes_a_new_0600_file_whatever_the_umask(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    led = Ledger(tmp_path / "solo" / "ledger.sqlite")
    led.register_source("k" * 64, "toy", 8.0, 1e-5, [bytes([i]) * 16 for i in range(20)])
    led.reserve("k" * 64, "r1", ev.ExponentialEvent(0.5))
    out = tmp_path / "backups" / "backup.json"
    out.parent.mkdir()
    old_umask = os.umask(0o022)
    try:
        assert main(["--state-dir", str(tmp_path / "solo"), "ledger", "--json", "--out", str(out)]) == 0
    finally:
        os.umask(old_umask)
    assert str(out) in capsys.readouterr().out
    assert out.stat().st_mode & 0o777 == 0o600
    data = json.loads(out.read_text())
    assert data["format"] == led.export()["format"] and [e["run_id"] for e in data["entries"]] == ["r1"]
    assert data["record_digests"] == led.export()["record_digests"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["backup.json"]   # no temporary file left
    # never over an existing file (one line; the file is unchanged); --out needs --json
    before = out.read_bytes()
    assert main(["--state-dir", str(tmp_path / "solo"), "ledger", "--json", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "exists: refusing to replace it" in err and err.count("\n") == 1 and out.read_bytes() == before
    assert main(["--state-dir", str(tmp_path / "solo"), "ledger", "--out", str(tmp_path / "x.json")]) == 2
    assert "--json --out" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    assert main(["--state-dir", str(tmp_path / "solo"), "ledger", "--json", "--out",
                 str(tmp_path / "nowhere" / "b.json")]) == 2
    assert "no folder" in capsys.readouterr().err
    # a state folder without a ledger yet: the empty export, 0600 too
    empty = tmp_path / "backups" / "empty.json"
    assert main(["--state-dir", str(tmp_path / "fresh"), "ledger", "--json", "--out", str(empty)]) == 0
    assert empty.stat().st_mode & 0o777 == 0o600 and json.loads(empty.read_text())["entries"] == []


# ---- PostgreSQL (-m servers) ------------------------------------------------------------------------

from tests.ledger.test_ledger_team import postgres  # noqa: E402,F401  (the throwaway cluster)


@pytest.mark.servers
def test_postgres_team_ledger_holds_no_key_and_the_team_flow_works(postgres, tmp_path, monkeypatch):
    url = postgres.database()
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", url)
    data = _write(tmp_path / "data", TRAIN, TEST)
    _, row, _ = _charge(_data_cfg(data, "toy", tmp_path / "machine-a"))
    key = installation_secret(tmp_path / "machine-a" / "private")
    assert_url_alone_computes_no_digest(url, key, [r["text"] for r in TRAIN])
    with pytest.raises(LedgerKeyError, match="privprompt key import FILE"):
        _charge(_data_cfg(data, "toy", tmp_path / "machine-b"))
    export_key(state_paths(str(tmp_path / "machine-a")), tmp_path / "team.key")
    import_key(state_paths(str(tmp_path / "machine-b")), tmp_path / "team.key")
    _, row_b, _ = _charge(_data_cfg(data, "toy", tmp_path / "machine-b"))
    assert row_b["fingerprint"] == row["fingerprint"] and row_b["how"] == "key"


@pytest.mark.servers
def test_postgres_ledger_of_schema6_moves_its_key_out(postgres, tmp_path, monkeypatch):
    """A PostgreSQL ledger as schema 6 left it (the team key in table team_key): its first use moves
    the key to the key file, records its id and drops the table; every row stays."""
    url = postgres.database()
    old_key = bytes(range(32))
    led = Ledger(url)
    digests = record_digests(old_key, [r["text"] for r in TRAIN])
    fp = led.register_source(records_key(old_key, digests), "toy", 8.0, 1e-5, digests)["fingerprint"]
    led.reserve(fp, "r1", ev.ExponentialEvent(0.5))
    with led._store.write() as conn:  # what schema 6 held
        conn.exec_driver_sql("CREATE TABLE team_key (id INTEGER PRIMARY KEY CHECK (id = 1), key BYTEA NOT NULL, "
                             "created_at TEXT NOT NULL, host TEXT NOT NULL, os_user TEXT NOT NULL)")
        conn.execute(sa.text("INSERT INTO team_key VALUES (1, :k, 'then', 'h', 'u')"), {"k": old_key})
        conn.exec_driver_sql("UPDATE ledger_meta SET value = '6' WHERE name = 'schema_version'")
    before = led.export()
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", url)
    paths = state_paths(str(tmp_path / "machine-a"))
    ledger = paths.open_ledger()
    assert paths.team_key_file(key_id_of(old_key)).read_bytes() == old_key
    assert ledger.team_key_id() == key_id_of(old_key) and not ledger.holds_legacy_team_key()
    after = ledger.export()
    for table in ("datasets", "entries", "cap_changes", "record_digests"):
        assert after[table] == before[table]
    assert after["trail"][:-1] == before["trail"] and after["trail"][-1]["action"] == "team_key_moved"
    assert_url_alone_computes_no_digest(url, old_key, [r["text"] for r in TRAIN])
    assert installation_secret(paths.private) == old_key


def test_two_first_runs_at_once_share_the_key_the_first_one_wrote(tmp_path, monkeypatch):
    """Two processes starting on a fresh state folder both mint a key: the one that loses the atomic
    link gets the key the other wrote, not an error (review 10, F5) — and never a second key."""
    import tasks.state as state

    real, other = state.store_key_file, b"\x07" * 32

    def racing(path, key, must_match=True):
        real(path, other)  # the other process links its key first
        return real(path, key, must_match=must_match)

    monkeypatch.setattr(state, "store_key_file", racing)
    private = tmp_path / "state" / "private"
    assert installation_secret(private) == other
    monkeypatch.setattr(state, "store_key_file", real)
    assert installation_secret(private) == other  # the file kept: the first writer's
