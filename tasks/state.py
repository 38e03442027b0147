"""The state folder and the environment of an in-process run (embedded Prefect, SQLite MLflow).

The state folder — the config's ``state_dir``, else ``$PRIVPROMPT_HOME``, else one stable folder
per user (``platformdirs.user_data_dir("privprompt")``, e.g. ``~/.local/share/privprompt``; never
relative to the working folder, so running from another folder never starts a new ledger) —
holds the MLflow database and artifacts, the budget ledger (unless the ledger is elsewhere),
Prefect's home, and ``private/``: the one place private working data is written.

The ledger: the config's ``ledger.url``, else ``$PRIVPROMPT_LEDGER_URL``, else the SQLite file
``<state>/ledger.sqlite``. A ledger elsewhere (a team's PostgreSQL, or a SQLite file outside the
state folder) also keeps the key of keyed fingerprints and splits (:func:`installation_secret`),
so that every machine using it names a dataset the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def digest_key(fields: dict, length: int = 16) -> str:
    """The first ``length`` hex digits of the SHA-256 of ``fields`` as sorted JSON: the key under
    which a made-once result (a partition, a draw, a distilled student, a cached prompt) is found
    again. A key whose ``fields`` include a digest of private data names a private-side path only."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:length]


LEDGER_URL_ENV = "PRIVPROMPT_LEDGER_URL"


def default_state_dir() -> Path:
    """The per-user state folder used when neither the config nor $PRIVPROMPT_HOME names one."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("privprompt", appauthor=False))


@dataclass(frozen=True)
class StatePaths:
    root: Path
    ledger_setting: str | None = None  # the config's ledger.url (None: $PRIVPROMPT_LEDGER_URL or the file)

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def ledger(self) -> Path:
        """The embedded ledger file of this state folder (used when no ledger URL is set)."""
        return self.root / "ledger.sqlite"

    @property
    def ledger_url(self) -> str:
        """Where this state folder's runs keep their budget: the config's ``ledger.url``, else
        ``$PRIVPROMPT_LEDGER_URL``, else ``sqlite:///<state>/ledger.sqlite``."""
        from privacy.ledger_store import sqlite_url

        return self.ledger_setting or os.environ.get(LEDGER_URL_ENV) or sqlite_url(self.ledger)

    @property
    def ledger_is_shared(self) -> bool:
        """True when the ledger is not this state folder's own file (a team's database, or a file
        elsewhere): it then keeps the team key of fingerprints and splits."""
        from privacy.ledger_store import resolve

        return resolve(self.ledger_url)[1] != self.ledger.resolve()

    @property
    def ledger_location(self) -> str:
        """The ledger's URL with its password masked (for people and logs)."""
        from privacy.ledger_store import mask_url

        return mask_url(self.ledger_url)

    def ledger_exists(self) -> bool:
        """Whether a ledger is there to read without creating one: the file exists, or the
        ledger is a database elsewhere (opened, and its tables made, on first use)."""
        return self.ledger_is_shared or self.ledger.is_file()

    def open_ledger(self):
        """The :class:`privacy.ledger.Ledger` of this state folder (created if it does not exist)."""
        from privacy.ledger import Ledger

        return Ledger(self.ledger_url)

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def private(self) -> Path:
        return self.root / "private"

    def create(self) -> "StatePaths":
        """The state folder and its folders, mode 0700 whatever the umask; folders and files left
        readable by others (a state folder made before this rule, a crash before a run's end)
        are tightened (:meth:`tighten`)."""
        for p in (self.root, self.artifacts, self.prefect_home, self.private):
            make_private_dir(p)
        self.tighten()
        return self

    def tighten(self) -> None:
        """The private side, owner-only: the state folder 0700; ``private/`` and ``secrets/``,
        every folder in them 0700 and every file 0600; the state folder's own files (the ledger
        and MLflow databases and their journals) 0600. Called when the state is opened and when
        a flow ends, so that files a library wrote with the caller's umask (parquet, safetensors,
        numpy, plots) do not stay 0644 (inside 0700 folders, they were never reachable)."""
        if not self.root.is_dir():
            return
        owner_only(self.root)
        for tree in (self.private, self.root / SECRETS_DIR):
            owner_only_tree(tree)
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    owner_only(entry.path)


SECRET_NAME = "installation.key"
SECRETS_DIR = "secrets"

# ---- the private side: owner-only, whatever the caller's umask --------------------------------
# Folders are made 0700 one by one (os.mkdir's mode is cut by the umask; chmod sets it), and files
# that code under the state folder writes are made 0600 (or tightened when a flow ends). The
# process umask is left alone: it is process-wide (threads of Prefect, MLflow and Dask read and set
# it), and outside the state folder (a shared Hugging Face cache, `report --out`) the caller's
# umask is what the caller wants.

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def owner_only(path: str | Path) -> None:
    """Remove the group's and others' permissions of ``path`` (a folder 0700, a file 0600 as
    written; a link is left alone). Entries that vanished or belong to someone else are skipped."""
    import stat

    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
            return
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
    except (FileNotFoundError, PermissionError):
        pass


def owner_only_tree(top: str | Path) -> None:
    """:func:`owner_only` on ``top`` and everything under it (links are not followed)."""
    if not os.path.isdir(top):
        return
    owner_only(top)
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            owner_only(os.path.join(folder, name))


def make_private_dir(path: str | Path) -> Path:
    """``mkdir -p path`` with every folder it makes mode 0700, whatever the umask; an existing
    ``path`` is tightened to owner-only. Returns ``path``."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR_MODE)
            os.chmod(d, PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile by a concurrent process (of this user)
            pass
    owner_only(path)
    return path


def private_file(path: str | Path) -> Path:
    """``path`` (a file under the state folder, just written) made 0600. Returns ``path``."""
    os.chmod(path, PRIVATE_FILE_MODE)
    return Path(path)


def open_private(path: str | Path, mode: str = "a"):
    """``open(path, mode)`` of a file created 0600 (never readable by others, not even for a
    moment): ``mode`` is ``"a"`` or ``"w"`` (text) or ``"ab"`` / ``"wb"``."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


_TEAM_KEYS: dict[str, bytes] = {}
# state folder → the ledger.url of the config that named it in this process (state_paths with a
# ledger_url): code that knows only a folder (the keyed fingerprint of a dataset) uses that ledger too
_CONFIGURED_LEDGERS: dict[Path, str] = {}


def key_id(private_dir: str | Path) -> str:
    """A name of the key :func:`installation_secret` gives for ``private_dir`` (an HMAC of a
    constant under it: it tells keys apart and reveals nothing of the key)."""
    import hashlib
    import hmac

    return hmac.new(installation_secret(private_dir), b"privprompt/key-id", hashlib.sha256).hexdigest()[:16]


def installation_secret(private_dir: str | Path, ledger_url: str | None = None) -> bytes:
    """This installation's secret key (32 bytes from ``secrets``): the HMAC key of dataset
    fingerprints and keyed splits, so that a published fingerprint confirms no guess about the
    data to anyone without it. Never logged or returned in a result.

    With a ledger elsewhere (``ledger_url``, else ``$PRIVPROMPT_LEDGER_URL``, other than this
    state folder's own file) it is the TEAM key kept in that ledger (created once, by whichever
    machine comes first; refused over a ledger that has datasets and no key): every machine names
    a dataset the same way. Otherwise it is kept in ``<state>/secrets/installation.key`` (mode
    0600; ``<state>`` is the parent of ``private_dir``), created atomically on first use. Not under
    ``private/``: public-data stages use it to check that public data does not overlap the
    private source."""
    import secrets
    import tempfile

    root = Path(private_dir).resolve().parent
    paths = StatePaths(root, ledger_url or _CONFIGURED_LEDGERS.get(root))
    if paths.ledger_is_shared:
        url = paths.ledger_url
        if url not in _TEAM_KEYS:
            _TEAM_KEYS[url] = paths.open_ledger().team_key(mint=True)
        return _TEAM_KEYS[url]
    directory = paths.root / SECRETS_DIR
    path = directory / SECRET_NAME
    if path.is_file():
        key = path.read_bytes()
        if len(key) == 32:
            return key
        raise ValueError(f"{path} is not a 32-byte key: restore it from a backup (fingerprints and the "
                         "ledger's dataset keys depend on it) or remove it to start a new installation")
    make_private_dir(directory)  # the state folder too, when this makes it
    fd, tmp = tempfile.mkstemp(prefix=".installation-", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_bytes(32))
        os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and never replaces a key another process created first
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    return path.read_bytes()


@contextmanager
def exclusive(lock_path: str | Path):
    """An exclusive advisory lock (``flock``) on ``lock_path`` for the block, between threads
    and processes of this machine (Dask workers): for work that must happen once, like a private
    draw that is published and shared. Released when the block ends or the process dies."""
    import fcntl

    lock_path = Path(lock_path)
    make_private_dir(lock_path.parent)
    with open_private(lock_path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def made_once(path: Path, make, load, save, usable=lambda data: True):
    """The result stored at ``path``, made by ``make()`` and stored by ``save(result, path)`` only
    when there is none (or ``usable`` refuses the stored one), under :func:`exclusive`: runs on
    parallel workers that need it at the same moment make it once."""
    with exclusive(path.with_name(path.name + ".lock")):
        data = load(path) if path.is_file() else None
        if data is None or not usable(data):
            data = make()
            save(data, path)
    return data


def state_paths(state_dir: str | None = None, ledger_url: str | None = None) -> StatePaths:
    """The state folder: ``state_dir`` (the config's), else ``$PRIVPROMPT_HOME``, else the per-user
    :func:`default_state_dir`. ``ledger_url``: the config's ``ledger.url`` (None: the environment's
    or the state folder's file)."""
    root = Path(state_dir or os.environ.get("PRIVPROMPT_HOME") or default_state_dir()).expanduser().resolve()
    if ledger_url:
        _CONFIGURED_LEDGERS[root] = ledger_url
    return StatePaths(root, ledger_url or None)


def config_state_paths(cfg) -> StatePaths:
    """:func:`state_paths` of a config (its ``state_dir`` and ``ledger.url``)."""
    ledger = getattr(cfg, "ledger", None)
    return state_paths(cfg.state_dir, getattr(ledger, "url", None))


def default_data_root(config_value: str | None = None) -> str | None:
    """``$PRIVPROMPT_DATA_ROOT``, else ``../shared/data`` (next to the working directory or to
    the checkout) when it exists, else the config's ``data_root``."""
    env = os.environ.get("PRIVPROMPT_DATA_ROOT")
    if env:
        return env
    for candidate in (Path.cwd().parent / "shared" / "data", REPO_ROOT.parent / "shared" / "data"):
        if candidate.is_dir():
            return str(candidate.resolve())
    return config_value


def tracking_uri(paths: StatePaths) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{paths.mlflow_db}"


def configure_environment(paths: StatePaths) -> None:
    """Environment for embedded Prefect and local MLflow; call before importing prefect."""
    paths.create()
    env = {
        "PREFECT_HOME": str(paths.prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # first start on a fresh PREFECT_HOME runs migrations: 16-19 s on 2 cores (NOTES.md)
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(paths.prefect_home / "storage"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "TOKENIZERS_PARALLELISM": "false",
        "GIT_PYTHON_REFRESH": "quiet",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "DASK_LOGGING__DISTRIBUTED": "warning",  # audit shadows: keep the terminal readable
        "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED": "warning",
    }
    for k, v in env.items():
        os.environ.setdefault(k, v)
    os.environ["PREFECT_HOME"] = str(paths.prefect_home)
    if paths.ledger_setting:  # the config's ledger: this process's and its workers' (Dask) from now on
        os.environ[LEDGER_URL_ENV] = paths.ledger_setting
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(paths.prefect_home / "storage")
