"""A team's ledger (issue 25): one ledger reached by URL from several state folders ("machines"),
reservations serialised by the database under concurrency (SQLite here; PostgreSQL under
``-m servers``), the append-only audit trail, export/import, the team key, and where the ledger
lives (per-user default state folder, URL with its password masked)."""

from __future__ import annotations

import glob
import io
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from privacy import events as ev
from privacy.accountant import spend
from privacy.ledger import (BudgetExceededError, Ledger, LedgerError, LedgerKeyError, LedgerUnavailableError,
                            LedgerURLError, UnknownRunError, key_id_of)
from tasks.state import import_key, installation_secret, state_paths

FP = "c0ffee" + "0" * 58
DELTA = 1e-5
EXP = ev.ExponentialEvent(0.5)


def composed(k: int) -> float:
    return spend(ev.ComposedEvent((EXP,) * k), DELTA).epsilon if k else 0.0


# ---- where the ledger lives -------------------------------------------------------------------

def test_ledger_url_precedence_config_then_environment_then_state_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIVPROMPT_LEDGER_URL", raising=False)
    own = state_paths(str(tmp_path / "a"))
    assert own.ledger_url == f"sqlite:///{tmp_path / 'a' / 'ledger.sqlite'}" and not own.ledger_is_shared
    team = f"sqlite:///{tmp_path / 'team' / 'ledger.sqlite'}"
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", team)
    assert state_paths(str(tmp_path / "a")).ledger_url == team and state_paths(str(tmp_path / "a")).ledger_is_shared
    configured = f"sqlite:///{tmp_path / 'configured.sqlite'}"
    assert state_paths(str(tmp_path / "a"), configured).ledger_url == configured
    # the environment naming the state folder's own file is no shared ledger
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{tmp_path / 'a' / 'ledger.sqlite'}")
    assert not state_paths(str(tmp_path / "a")).ledger_is_shared


def test_default_state_folder_is_per_user_not_the_working_folder(tmp_path, monkeypatch):
    from platformdirs import user_data_dir

    monkeypatch.delenv("PRIVPROMPT_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))  # never the real user folder in tests
    roots = set()
    for cwd in (tmp_path / "one", tmp_path / "two"):
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        roots.add(state_paths().root)
    assert roots == {Path(user_data_dir("privprompt", appauthor=False)).resolve()}
    assert str(tmp_path / "xdg") in str(roots.pop())
    monkeypatch.setenv("PRIVPROMPT_HOME", str(tmp_path / "home"))
    assert state_paths().root == (tmp_path / "home").resolve()
    assert state_paths(str(tmp_path / "cfg")).root == (tmp_path / "cfg").resolve()


@pytest.mark.parametrize("url, match", [
    ("mysql://u@h/db", "unknown ledger URL scheme 'mysql'"),
    ("sqlite:///relative.sqlite", "relative path"),
    ("sqlite://", "names no file"),
    ("postgresql+nodriver://u@h/db", "no PostgreSQL driver 'nodriver'"),
    ("postgresql://u@h", "names no database"),
])
def test_bad_ledger_urls_fail_with_one_line(url, match):
    with pytest.raises(LedgerURLError, match=match) as info:
        Ledger(url)
    assert "\n" not in str(info.value)


def test_missing_postgres_driver_says_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_drivers(name, *args, **kwargs):
        if name.split(".")[0] in ("psycopg2", "psycopg"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_drivers)
    with pytest.raises(LedgerURLError, match="pip install psycopg2-binary"):
        Ledger("postgresql://privprompt@127.0.0.1:1/ledger")


def test_unreachable_database_fails_with_one_line_and_masked_password():
    pytest.importorskip("psycopg2")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(LedgerUnavailableError) as info:
        Ledger(f"postgresql://privprompt:hunter2@127.0.0.1:{port}/ledger")
    text = str(info.value)
    assert "\n" not in text and "hunter2" not in text and "***" in text and "could not be used" in text


def test_config_ledger_url_is_checked_and_never_carries_a_password(tmp_path):
    from tasks.config import config_hash, parse_config
    from tasks.errors import ConfigError

    import yaml

    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml").read_text())
    base.pop("ledger", None)
    cfg = parse_config({**base, "ledger": {"url": f"sqlite:///{tmp_path / 'team.sqlite'}"}})
    assert cfg.ledger.url.endswith("team.sqlite")
    assert config_hash(cfg) == config_hash(parse_config(base))  # where the ledger is is not what a run is
    with pytest.raises(ConfigError, match="carries a password") as info:
        parse_config({**base, "ledger": {"url": "postgresql://u:secret@h/db"}})
    assert "secret" not in str(info.value)
    with pytest.raises(ConfigError, match="unknown ledger URL scheme"):
        parse_config({**base, "ledger": {"url": "mongodb://h/db"}})


# ---- the audit trail ----------------------------------------------------------------------------

def test_every_change_appends_to_the_trail_and_a_refusal_appends_nothing(tmp_path):
    import getpass

    led = Ledger(tmp_path / "l.sqlite")
    led.register_dataset(FP, "sst2", composed(2) * 1.0001, DELTA)
    led.reserve(FP, "a", EXP, "first")
    led.reserve(FP, "a", EXP)                        # an idempotent retry changes nothing
    led.mark_read("a")
    led.commit("a", EXP)
    led.reserve(FP, "b", EXP)
    before = led.trail()
    with pytest.raises(BudgetExceededError):
        led.reserve(FP, "c", EXP)
    assert led.trail() == before                     # a refusal changes nothing
    led.release("b", "model did not load")
    led.reserve(FP, "b", EXP)                        # a retry of the released run
    led.abort("b", "config mistake found before reading")
    led.record_nonprivate(FP, "base", "non-private baseline")
    led.record_ldp(FP, "rapt-draw", "d_X draw", eta=10.0)
    led.lower_cap(FP, composed(1) * 1.5, "policy")
    led.change_delta(FP, 1e-6, "δ policy")
    rows = led.trail()
    assert [r["action"] for r in rows] == ["register", "reserve", "mark_read", "commit", "reserve", "release",
                                           "reserve", "abort", "nonprivate", "ldp", "cap_change", "cap_change"]
    assert [r["run_id"] for r in rows][:4] == [None, "a", "a", "a"]
    assert all(r["host"] == socket.gethostname() and r["os_user"] == getpass.getuser() and r["at"] for r in rows)
    assert rows[3]["detail"]["epsilon"] == pytest.approx(composed(1))
    assert rows[5]["detail"]["reason"] == "model did not load"
    assert rows[-1]["detail"]["new_delta"] == 1e-6 and rows[-1]["detail"]["reason"] == "δ policy"
    assert [r["action"] for r in led.trail(run_id="b")] == ["reserve", "release", "reserve", "abort"]
    with pytest.raises(Exception, match="append-only"):  # the database refuses to rewrite history
        with led._store.write() as conn:
            conn.exec_driver_sql("UPDATE trail SET action = 'x'")
    with pytest.raises(Exception, match="append-only"):
        with led._store.write() as conn:
            conn.exec_driver_sql("DELETE FROM trail")
    assert led.trail() == rows


# ---- export and import --------------------------------------------------------------------------

def _filled(led: Ledger) -> None:
    led.register_dataset(FP, "sst2", 8.0, DELTA)
    led.register_dataset("d" * 64, "other", 4.0, DELTA)
    led.reserve(FP, "r1", ev.dpsgd_event(0.01, 1.0, 100))
    led.mark_read("r1")
    led.commit("r1", ev.dpsgd_event(0.01, 1.0, 60))
    led.reserve(FP, "r2", EXP)                       # open: counts in full
    led.reserve("d" * 64, "r3", EXP)
    led.release("r3", "never read")
    led.record_nonprivate(FP, "np", "baseline")
    led.lower_cap("d" * 64, 3.0, "policy")


def _tables(export: dict) -> dict:
    return {t: export[t] for t in ("datasets", "entries", "cap_changes")}


def test_export_and_import_restore_the_whole_ledger(tmp_path):
    src = Ledger(tmp_path / "src.sqlite")
    _filled(src)
    data = json.loads(json.dumps(src.export()))      # through JSON, as the CLI writes it
    assert [r["action"] for r in data["trail"]][:2] == ["register", "register"]
    dst = Ledger(tmp_path / "dst.sqlite")
    counts = dst.import_ledger(data)
    assert counts == {"datasets": 2, "entries": 4, "cap_changes": 1, "trail": len(data["trail"])}
    again = dst.export()
    assert _tables(again) == _tables(data)
    assert again["trail"][:-1] == data["trail"] and again["trail"][-1]["action"] == "import"
    assert dst.datasets() == src.datasets() and dst.entries() == src.entries()
    assert dst.spent(FP) == src.spent(FP)
    # ids continue after the restored ones, and the restored budget keeps composing
    dst.reserve(FP, "r4", EXP)
    assert dst.entries()[-1]["run_id"] == "r4"
    with pytest.raises(LedgerError, match="not empty"):
        dst.import_ledger(data)
    with pytest.raises(LedgerError, match="not a ledger export"):
        Ledger(tmp_path / "x.sqlite").import_ledger({"datasets": []})


def test_cli_ledger_json_and_import(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    src = tmp_path / "src"
    _filled(state_paths(str(src)).open_ledger())
    assert main(["--state-dir", str(src), "ledger"]) == 0
    out = capsys.readouterr().out
    assert f"ledger: sqlite:///{src / 'ledger.sqlite'} (this state folder's own)" in out
    assert main(["--state-dir", str(src), "ledger", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    backup = tmp_path / "backup.json"
    backup.write_text(json.dumps(exported))
    dst = tmp_path / "dst"
    assert main(["--state-dir", str(dst), "ledger", "import", str(backup)]) == 0
    assert "2 datasets, 4 entries, 1 cap_changes" in capsys.readouterr().out
    assert _tables(state_paths(str(dst)).open_ledger().export()) == _tables(exported)
    assert main(["--state-dir", str(dst), "ledger", "import", str(backup)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and err.count("\n") == 1
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", "postgresql://u:topsecret@127.0.0.1:1/x")
    assert main(["--state-dir", str(dst), "ledger"]) == 2
    err = capsys.readouterr().err
    assert "topsecret" not in err and err.count("\n") == 1


# ---- the team key ---------------------------------------------------------------------------------

def test_team_key_lives_in_a_key_file_never_in_the_ledger(tmp_path, monkeypatch):
    team = f"sqlite:///{tmp_path / 'team' / 'ledger.sqlite'}"
    monkeypatch.delenv("PRIVPROMPT_LEDGER_URL", raising=False)
    monkeypatch.delenv("PRIVPROMPT_TEAM_KEY_FILE", raising=False)
    local = installation_secret(tmp_path / "solo" / "private")          # a machine's own ledger: its file
    assert (tmp_path / "solo" / "secrets" / "installation.key").read_bytes() == local
    a = installation_secret(tmp_path / "a" / "private", team)            # the first machine creates the team key
    key_id = Ledger(team).team_key_id()
    assert key_id == key_id_of(a) and a != local and len(a) == 32
    kept = tmp_path / "a" / "secrets" / "team-keys" / f"{key_id}.key"
    assert kept.read_bytes() == a and kept.stat().st_mode & 0o777 == 0o600
    assert kept.parent.stat().st_mode & 0o777 == kept.parent.parent.stat().st_mode & 0o777 == 0o700
    assert not (tmp_path / "a" / "secrets" / "installation.key").exists()
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", team)
    with pytest.raises(LedgerKeyError, match=f"team key {key_id}.*privprompt key export FILE.*privprompt key import FILE"
                       ) as info:                                        # another machine has no key: refused
        installation_secret(tmp_path / "b" / "private")
    assert "\n" not in str(info.value)
    assert import_key(state_paths(str(tmp_path / "b")), kept)[0] == key_id
    assert installation_secret(tmp_path / "b" / "private") == a
    assert [r["action"] for r in Ledger(team).trail()] == ["team_key"]
    # a key file of another key is refused, by the ledger's key id
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    with pytest.raises(LedgerKeyError, match=f"keeps its datasets under team key {key_id}"):
        import_key(state_paths(str(tmp_path / "c")), other)


def test_no_new_team_key_over_a_ledger_with_datasets(tmp_path, monkeypatch):
    led = Ledger(tmp_path / "imported.sqlite")
    led.register_dataset(FP, "sst2", 8.0, DELTA)      # e.g. a machine's ledger imported into the team's
    with pytest.raises(LedgerKeyError, match="no team key"):
        led.set_team_key_id(key_id_of(os.urandom(32)), minted=True)
    monkeypatch.delenv("PRIVPROMPT_TEAM_KEY_FILE", raising=False)
    with pytest.raises(LedgerKeyError, match="no team key recorded.*privprompt key import KEYFILE"):
        installation_secret(tmp_path / "m" / "private", f"sqlite:///{tmp_path / 'imported.sqlite'}")
    assert led.team_key_id() is None
    key = os.urandom(32)
    assert led.set_team_key_id(key_id_of(key)) == key_id_of(key) == led.team_key_id()
    assert led.set_team_key_id(key_id_of(key)) == key_id_of(key)     # the same key again: no-op
    with pytest.raises(LedgerKeyError, match="refusing to change it"):
        led.set_team_key_id(key_id_of(os.urandom(32)))
    assert led.export()["team_key_id"] == key_id_of(key)
    assert key.hex() not in json.dumps(led.export())  # the key is never in the ledger


# ---- concurrency: processes in two state folders against one cap -------------------------------

N_PROCS, ATTEMPTS, FITS = 8, 3, 10  # 24 reservations, exactly 10 fit, 14 refused


def _team_worker(state_dir: str, url: str, key_file: str, wid: int, barrier, results) -> None:
    from privacy.ledger import BudgetExceededError as Refused
    from privacy.ledger import UnknownRunError as NoEntry
    from tasks.state import StatePaths as Paths
    from tasks.state import installation_secret as secret

    out = {"wid": wid, "ok": [], "refused": [], "errors": []}
    try:
        paths = Paths(Path(state_dir), url)
        os.environ["PRIVPROMPT_TEAM_KEY_FILE"] = key_file  # the team's key file, shared by every machine
        barrier.wait(timeout=300)
        out["key"] = secret(paths.private, url).hex()  # every machine at once: one team key
        barrier.wait(timeout=300)                      # the parent registers the dataset
        barrier.wait(timeout=300)
        led = paths.open_ledger()
        for j in range(ATTEMPTS):
            run_id = f"{Path(state_dir).name}-{wid}-{j}"
            try:
                r = led.reserve(FP, run_id, EXP, f"worker {wid}")
            except Refused as err:
                try:
                    led.entry(run_id)
                    recorded = True
                except NoEntry:
                    recorded = False
                out["refused"].append((run_id, err.spent, err.total, recorded, led.spent(FP).epsilon))
                continue
            out["ok"].append((run_id, r.spent_epsilon, r.remaining_epsilon))
            led.mark_read(run_id)
            led.commit(run_id, EXP)
    except Exception as exc:  # reported to the parent
        out["errors"].append(repr(exc))
    results.put(out)


def run_team_reservations(url: str, tmp_path: Path) -> dict:
    """N_PROCS processes in two state folders reserve against one cap on the ledger at ``url``;
    checks every promise and returns the figures."""
    led = Ledger(url)
    cap = (composed(FITS) + composed(FITS + 1)) / 2
    assert composed(FITS) < cap < composed(FITS + 1)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(N_PROCS + 1)
    results = ctx.Queue()
    machines = [tmp_path / "machine-a", tmp_path / "machine-b"]
    key_file = str(tmp_path / "shared" / "team.key")
    procs = [ctx.Process(target=_team_worker, args=(str(machines[i % 2]), url, key_file, i, barrier, results))
             for i in range(N_PROCS)]
    for p in procs:
        p.start()
    barrier.wait(timeout=300)
    barrier.wait(timeout=300)
    led.register_dataset(FP, "team-data", cap, DELTA)
    barrier.wait(timeout=300)
    outs = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [o["errors"] for o in outs] == [[]] * N_PROCS
    ok = [x for o in outs for x in o["ok"]]
    refused = [x for o in outs for x in o["refused"]]
    # exactly the expected number admitted and refused
    assert len(ok) == FITS and len(refused) == N_PROCS * ATTEMPTS - FITS
    # the remaining budget exact after each step: the k-th admitted reservation saw k composed runs
    assert sorted(round(s, 9) for _, s, _ in ok) == [round(composed(k), 9) for k in range(1, FITS + 1)]
    for _, s, remaining in ok:
        assert remaining == pytest.approx(cap - s, abs=1e-12)
    # a refusal changes nothing: not recorded, spent unchanged at the full FITS runs
    for run_id, spent, total, recorded, spent_after in refused:
        assert not recorded
        assert spent == pytest.approx(composed(FITS)) and total == pytest.approx(composed(FITS + 1))
        assert spent_after == pytest.approx(composed(FITS))
    # the committed total never exceeds the cap; nothing lost
    entries = led.entries(FP)
    assert len(entries) == FITS and all(e["status"] == "committed" for e in entries)
    assert sorted(e["run_id"] for e in entries) == sorted(r for r, _, _ in ok)
    assert led.spent(FP).epsilon == pytest.approx(composed(FITS)) and led.spent(FP).epsilon <= cap
    assert led.remaining(FP) == pytest.approx(cap - composed(FITS))
    # one team key for every machine, minted once, in the team's key file and never in the ledger
    keys = {o["key"] for o in outs}
    assert keys == {Path(key_file).read_bytes().hex()} and key_id_of(bytes.fromhex(keys.pop())) == led.team_key_id()
    trail = led.trail()
    actions = [r["action"] for r in trail]
    assert actions.count("team_key") == 1 and actions.count("register") == 1
    assert actions.count("reserve") == actions.count("mark_read") == actions.count("commit") == FITS
    assert {r["pid"] for r in trail if r["action"] == "reserve"} <= {p.pid for p in procs}
    return {"processes": N_PROCS, "state_folders": len(machines), "reservations": N_PROCS * ATTEMPTS,
            "admitted": len(ok), "refused": len(refused), "lost": FITS - len(entries),
            "cap": cap, "spent": led.spent(FP).epsilon}


def test_team_reservations_on_one_sqlite_ledger(tmp_path):
    url = f"sqlite:///{tmp_path / 'team' / 'ledger.sqlite'}"
    figures = run_team_reservations(url, tmp_path)
    assert figures["lost"] == 0


# ---- PostgreSQL (-m servers) ----------------------------------------------------------------------

def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: [int(x) for x in Path(p).parent.name.split(".") if x.isdigit()])
    if found:
        return Path(found[-1])
    which = shutil.which("initdb")
    return Path(which).parent if which else None


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """A throwaway PostgreSQL cluster on localhost (as scripts/team_servers.sh starts one)."""
    pg_bin = _pg_bin()
    if pg_bin is None:
        pytest.skip("PostgreSQL binaries are absent (apt-get install postgresql)")
    pytest.importorskip("psycopg2", reason="psycopg2 is missing: pip install psycopg2-binary "
                                           "(bash scripts/team_servers.sh installs it)")
    run_as = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        run_as = ["runuser", "-u", "postgres", "--"]
        data = Path(tempfile.mkdtemp(prefix="privprompt-test-pg-", dir="/var/tmp"))
        shutil.chown(data, "postgres")
    else:
        data = tmp_path_factory.mktemp("pg")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.run([*run_as, str(pg_bin / "initdb"), "-D", str(data / "db"), "-U", "privprompt", "--auth=trust"],
                   check=True, capture_output=True)

    class Cluster:
        def database(self) -> str:
            """A fresh database on the cluster: its URL."""
            name = f"ledger_{uuid.uuid4().hex[:10]}"
            subprocess.run([*run_as, str(pg_bin / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U",
                            "privprompt", name], check=True, capture_output=True)
            return f"postgresql://privprompt@127.0.0.1:{port}/{name}"

        def stop(self) -> None:
            subprocess.run([*run_as, str(pg_bin / "pg_ctl"), "-D", str(data / "db"), "-m", "fast", "stop"],
                           check=True, capture_output=True)

        def start(self) -> None:
            subprocess.run([*run_as, str(pg_bin / "pg_ctl"), "-D", str(data / "db"), "-l", str(data / "db" / "log"),
                            "-w", "-o", f"-p {port} -k /tmp -c listen_addresses=127.0.0.1", "start"], check=True,
                           capture_output=True)

    cluster = Cluster()
    cluster.start()
    try:
        yield cluster
    finally:
        subprocess.run([*run_as, str(pg_bin / "pg_ctl"), "-D", str(data / "db"), "-m", "fast", "stop"],
                       capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.servers
def test_team_reservations_on_postgres(postgres, tmp_path):
    figures = run_team_reservations(postgres.database(), tmp_path)
    assert figures["lost"] == 0
    print("team ledger figures (PostgreSQL):", json.dumps(figures))


@pytest.mark.servers
def test_postgres_ledger_semantics_trail_export_and_key(postgres, tmp_path):
    url = postgres.database()
    led = Ledger(url)
    assert led.shared and led.path is None
    _filled(led)
    rows = led.trail()
    assert [r["action"] for r in rows][:3] == ["register", "register", "reserve"]
    with pytest.raises(Exception, match="append-only"):
        with led._store.write() as conn:
            conn.exec_driver_sql("DELETE FROM trail")
    # a SQLite ledger restored into PostgreSQL and back composes the same
    data = json.loads(json.dumps(led.export()))
    other = Ledger(postgres.database())
    other.import_ledger(data, team_key=b"k" * 32)
    assert _tables(other.export()) == _tables(data) and other.team_key_id() == key_id_of(b"k" * 32)
    other.reserve(FP, "after-import", EXP)                 # the id sequence continues after the restored ids
    assert other.entries()[-1]["run_id"] == "after-import"
    local = Ledger(tmp_path / "back.sqlite")
    local.import_ledger(data)
    assert local.datasets() == led.datasets()
    with pytest.raises(LedgerKeyError, match="no team key"):
        led.set_team_key_id(key_id_of(b"m" * 32), minted=True)
    with pytest.raises(UnknownRunError):
        led.commit("nope", EXP)


@pytest.mark.servers
def test_postgres_restart_fails_with_a_clear_error_and_loses_nothing(postgres):
    led = Ledger(postgres.database())
    led.register_dataset(FP, "sst2", 8.0, DELTA)
    led.reserve(FP, "before", EXP)
    postgres.stop()  # the server goes away: one clear error; it comes back: everything is there
    try:
        with pytest.raises(LedgerUnavailableError, match="could not be used") as info:
            led.reserve(FP, "during", EXP)
        assert "\n" not in str(info.value)
    finally:
        postgres.start()
    assert [e["run_id"] for e in led.entries()] == ["before"]
    assert led.reserve(FP, "after", EXP).spent_epsilon == pytest.approx(composed(2))


def test_ledger_and_budget_commands_use_the_ledger_url(tmp_path, monkeypatch, capsys):
    from privprompt_cli import main

    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{tmp_path / 'team.sqlite'}")
    assert main(["--state-dir", str(tmp_path / "s"), "ledger"]) == 0
    out = capsys.readouterr().out
    assert f"sqlite:///{tmp_path / 'team.sqlite'}" in out
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["--state-dir", str(tmp_path / "s"), "budget", "reservations"]) == 0
    assert "no open reservations" in buf.getvalue()


# ---- a writer killed while it holds the ledger's write lock ---------------------------------------

_HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from privacy.ledger import Ledger
from privacy.ledger.common import _q
led = Ledger({url!r})
with led._store.write() as conn:  # the write lock, and a reservation inserted but not committed
    _q(conn, "INSERT INTO entries (run_id, fingerprint, kind, status, reserved_event, epsilon_reserved, description,"
             " created_at) VALUES ('killed', ?, 'dp', 'reserved', '{{}}', 1.0, '', 'now')", ({fp!r},))
    print("holding", flush=True)
    time.sleep(600)
"""


def kill_writer_holding_the_lock(url: str) -> float:
    """kill -9 a process inside a write transaction; the next reservation must go through at once,
    and nothing of the killed transaction may be in the ledger. Returns the wait in seconds."""
    import signal
    import sys
    import time

    led = Ledger(url)
    led.register_dataset(FP, "sst2", 8.0, DELTA)
    led.reserve(FP, "before", EXP)
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.format(repo=repo, url=url, fp=FP)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    started = time.monotonic()
    r = led.reserve(FP, "after", EXP)
    waited = time.monotonic() - started
    assert r.spent_epsilon == pytest.approx(composed(2))
    assert [e["run_id"] for e in led.entries()] == ["before", "after"]   # nothing of the killed writer
    assert [t["run_id"] for t in led.trail() if t["action"] == "reserve"] == ["before", "after"]
    return waited


def test_killed_writer_leaves_no_lock_and_no_row_on_sqlite(tmp_path):
    assert kill_writer_holding_the_lock(f"sqlite:///{tmp_path / 'team.sqlite'}") < 10


@pytest.mark.servers
def test_killed_writer_leaves_no_lock_and_no_row_on_postgres(postgres):
    assert kill_writer_holding_the_lock(postgres.database()) < 10


def test_a_configured_ledger_url_names_the_key_of_its_state_folder(tmp_path, monkeypatch):
    """plan and run build their paths from the config (ledger.url); the keyed fingerprint, made
    from the state folder alone, must use the same ledger's team key without any environment."""
    monkeypatch.delenv("PRIVPROMPT_LEDGER_URL", raising=False)
    url = f"sqlite:///{tmp_path / 'team.sqlite'}"
    monkeypatch.delenv("PRIVPROMPT_TEAM_KEY_FILE", raising=False)
    paths = state_paths(str(tmp_path / "cfg-state"), url)
    key = installation_secret(paths.private)
    assert key_id_of(key) == Ledger(url).team_key_id()
    assert paths.team_key_file(key_id_of(key)).read_bytes() == key and not paths.installation_key.exists()


# ---- one attempt reads: the read claim is atomic ---------------------------------------------------

def _claim_worker(url: str, run_id: str, barrier, results) -> None:
    from privacy.ledger import Ledger as L
    from privacy.ledger import ReadClaimedError as Claimed

    led = L(url)
    barrier.wait(timeout=120)
    try:
        led.claim_read(run_id)
        results.put("claimed")
    except Claimed:
        results.put("refused")
    except Exception as exc:  # reported to the parent
        results.put(repr(exc))


def run_read_claims(url: str, procs: int = 6) -> list[str]:
    """``procs`` attempts of one run, released together, claim its first private read: exactly one
    gets it, every other is refused, one mark_read in the trail."""
    led = Ledger(url)
    led.register_dataset(FP, "claims", 5.0, DELTA)
    led.reserve(FP, "run-1", EXP, "one run, several attempts")
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_claim_worker, args=(url, "run-1", barrier, results)) for _ in range(procs)]
    for p in workers:
        p.start()
    outcomes = sorted(results.get(timeout=120) for _ in workers)
    for p in workers:
        p.join(timeout=60)
    assert outcomes == ["claimed"] + ["refused"] * (procs - 1)
    assert [r["action"] for r in led.trail()].count("mark_read") == 1
    assert led.entry("run-1")["read_started_at"] is not None
    with pytest.raises(ValueError, match="stays spent"):  # claimed: never released
        led.release("run-1", "test")
    return outcomes


def test_one_attempt_of_a_run_claims_its_read_on_sqlite(tmp_path):
    run_read_claims(f"sqlite:///{tmp_path / 'ledger.sqlite'}")


def test_mark_read_stays_idempotent_while_claim_read_refuses_a_second_claim(tmp_path):
    from privacy.ledger import ReadClaimedError

    led = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    led.register_dataset(FP, "claims", 5.0, DELTA)
    led.reserve(FP, "r", EXP, "x")
    first = led.claim_read("r")["read_started_at"]
    assert led.mark_read("r")["read_started_at"] == first  # marking again keeps the first time
    with pytest.raises(ReadClaimedError, match="began reading private data at"):
        led.claim_read("r")


@pytest.mark.servers
def test_one_attempt_of_a_run_claims_its_read_on_postgres(postgres):
    run_read_claims(postgres.database())
