"""The state folder and the environment of an in-process run (embedded Prefect, SQLite MLflow).

The state folder — the config's ``state_dir``, else ``$PRIVPROMPT_HOME``, else one stable folder
per user (``platformdirs.user_data_dir("privprompt")``, e.g. ``~/.local/share/privprompt``; never
relative to the working folder, so running from another folder never starts a new ledger) —
holds the MLflow database and artifacts, the budget ledger (unless the ledger is elsewhere),
Prefect's home, and ``private/``: the one place private working data is written.

The ledger: the config's ``ledger.url``, else ``$PRIVPROMPT_LEDGER_URL``, else the SQLite file
``<state>/ledger.sqlite``. The key of keyed record digests, fingerprints and splits
(:func:`installation_secret`) never sits in the ledger's database, which holds the digests: for the
state folder's own ledger it is ``<state>/secrets/installation.key``; for a ledger elsewhere (a
team's PostgreSQL, or a SQLite file outside the state folder) it is the TEAM key, in
``<state>/secrets/team-keys/<key id>.key`` (or the file ``$PRIVPROMPT_TEAM_KEY_FILE`` names), the
same on every machine of the team: ``privprompt key export FILE`` on a machine that has it,
``privprompt key import FILE`` on one that joins (:func:`export_key`, :func:`import_key`). The
ledger records the key's id only, and refuses a machine without the key with one line saying how
to get it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .templates import PREFECT_TEMPLATE_ENV, defaults  # the name: callers and tests read it from state too

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
        from privacy.ledger.store import sqlite_url

        return self.ledger_setting or os.environ.get(LEDGER_URL_ENV) or sqlite_url(self.ledger)

    @property
    def ledger_is_shared(self) -> bool:
        """True when the ledger is not this state folder's own file (a team's database, or a file
        elsewhere): it then keeps the team key of fingerprints and splits."""
        from privacy.ledger.store import resolve

        return resolve(self.ledger_url)[1] != self.ledger.resolve()

    @property
    def ledger_location(self) -> str:
        """The ledger's URL with its password masked (for people and logs)."""
        from privacy.ledger.store import mask_url

        return mask_url(self.ledger_url)

    def ledger_exists(self) -> bool:
        """Whether a ledger is there to read without creating one: the file exists, or the
        ledger is a database elsewhere (opened, and its tables made, on first use)."""
        return self.ledger_is_shared or self.ledger.is_file()

    def open_ledger(self):
        """The :class:`privacy.ledger.Ledger` of this state folder (created if it does not exist). A
        ledger whose database still holds the team key (schemas 4-6) has it moved out on this first
        use: to its key file here (:meth:`team_key_file`), then deleted from the database."""
        from privacy.ledger import Ledger, key_id_of

        ledger = Ledger(self.ledger_url)
        if self.ledger_url not in _KEY_OUT_OF_DB:
            ledger.move_team_key_out(lambda key: store_key_file(self.team_key_file(key_id_of(key)), key))
            _KEY_OUT_OF_DB.add(self.ledger_url)
        return ledger

    @property
    def secrets(self) -> Path:
        """Where this state folder keeps its keys (0700; not under ``private/``: public-data stages
        use the key to check that public data does not overlap the private source)."""
        return self.root / "secrets"

    @property
    def installation_key(self) -> Path:
        """The key of this state folder's own ledger."""
        return self.secrets / SECRET_NAME

    def team_key_file(self, key_id: str) -> Path:
        """Where the team key of id ``key_id`` is kept: ``$PRIVPROMPT_TEAM_KEY_FILE`` when set, else
        ``<state>/secrets/team-keys/<key id>.key`` (one file per team ledger's key)."""
        env = os.environ.get(TEAM_KEY_FILE_ENV)
        if env:
            return Path(env).expanduser().resolve()
        return self.secrets / TEAM_KEYS_DIR / f"{key_id}.key"

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
TEAM_KEY_FILE_ENV = "PRIVPROMPT_TEAM_KEY_FILE"
TEAM_KEYS_DIR = "team-keys"
KEY_BYTES = 32
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

OPERATOR_LOG = "operator.log"


def operator_note(paths: "StatePaths", line: str) -> None:
    """A line for the operator alone, about private data (which registered dataset a source is
    charged to): written to this process's terminal (stderr, past Python's logging and any
    ``print`` capture, so never into Prefect's or MLflow's stores) and appended to
    ``private/operator.log`` (0600)."""
    import datetime

    sys.stderr.write(f"note (private, this terminal only): {line}\n")
    sys.stderr.flush()
    make_private_dir(paths.private)
    with open_private(paths.private / OPERATOR_LOG, "a") as handle:
        handle.write(f"{datetime.datetime.now(datetime.timezone.utc).isoformat()} {line}\n")


_TEAM_KEYS: dict[tuple, bytes] = {}
_KEY_OUT_OF_DB: set[str] = set()  # ledger URLs whose database this process found without a team key
# state folder → the ledger.url of the config that named it in this process (state_paths with a
# ledger_url): code that knows only a folder (the keyed fingerprint of a dataset) uses that ledger too
_CONFIGURED_LEDGERS: dict[Path, str] = {}


def key_id(private_dir: str | Path) -> str:
    """A name of the key :func:`installation_secret` gives for ``private_dir`` (an HMAC of a
    constant under it: it tells keys apart and reveals nothing of the key)."""
    from privacy.ledger import key_id_of

    return key_id_of(installation_secret(private_dir))


def installation_secret(private_dir: str | Path, ledger_url: str | None = None) -> bytes:
    """This installation's secret key (32 bytes from ``secrets``): the HMAC key of record digests,
    dataset fingerprints and keyed splits, so that a published fingerprint confirms no guess about
    the data to anyone without it. Never logged or returned in a result, and never kept in the
    ledger's database (which holds the keyed record digests).

    With a ledger elsewhere (``ledger_url``, else ``$PRIVPROMPT_LEDGER_URL``, other than this state
    folder's own file) it is the TEAM key of that ledger (:func:`team_key`): every machine names a
    dataset the same way. Otherwise it is kept in ``<state>/secrets/installation.key`` (mode 0600;
    ``<state>`` is the parent of ``private_dir``), created atomically on first use — but never over
    a ledger that already has datasets (their fingerprints were made with the lost key: restore it).
    Not under ``private/``: public-data stages use it to check that public data does not overlap
    the private source."""
    import secrets

    root = Path(private_dir).resolve().parent
    paths = StatePaths(root, ledger_url or _CONFIGURED_LEDGERS.get(root))
    if paths.ledger_is_shared:
        cached = (paths.ledger_url, str(root), os.environ.get(TEAM_KEY_FILE_ENV))
        if cached not in _TEAM_KEYS:
            _TEAM_KEYS[cached] = team_key(paths)
        return _TEAM_KEYS[cached]
    path = paths.installation_key
    if path.is_file():
        owner_only(path)  # the state folder's own file (inside 0700 folders): tightened, as on every open
        return read_key_file(path)
    if paths.ledger.is_file():
        from privacy.ledger import LedgerKeyError

        ledger = paths.open_ledger()
        if ledger.has_datasets():
            raise LedgerKeyError(
                f"{path} is missing but ledger {paths.ledger} has datasets keyed with it (their fingerprints and record "
                "digests): restore the key file from a backup, or import it: privprompt key import KEYFILE")
    # a key just minted loses quietly to one another process wrote first (two first runs at once)
    return store_key_file(path, secrets.token_bytes(KEY_BYTES), must_match=False)


def key_file_exposure(path: str | Path, mode: int | None = None) -> str | None:
    """Why the key file ``path`` is not its owner's alone (ssh's rule: no permission for the group
    or others; ``mode``: its ``st_mode`` when already known), or None when it is."""
    import stat

    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None
    if not mode & 0o077:
        return None
    return f"key file {path} is open to others than its owner (mode {stat.S_IMODE(mode):04o})"


def read_key_file(path: str | Path, private: bool = True) -> bytes:
    """The 32-byte key in ``path``; one line (:class:`privacy.ledger.LedgerKeyError`) when it cannot be
    read or is not a key. ``private`` (every file used AS the key): a file that its group or others
    may read or write is refused, as ssh refuses such a private key — with the ledger the key tells
    whether any text is in the data. Not ``private``: a file being imported (:func:`import_key`,
    which keeps its copy 0600; the caller warns)."""
    from privacy.ledger import LedgerKeyError

    try:
        with open(path, "rb") as handle:
            exposed = key_file_exposure(path, os.fstat(handle.fileno()).st_mode) if private else None
            key = handle.read(KEY_BYTES + 1)
    except OSError as exc:
        raise LedgerKeyError(f"cannot read key file {path}: {exc.strerror}") from None
    if exposed:
        raise LedgerKeyError(f"{exposed}: refused, a key file must be readable by its owner only (with the ledger "
                             f"it tells whether any text is in the data): chmod 600 {path}")
    if len(key) != KEY_BYTES:
        raise LedgerKeyError(f"{path} is not a {KEY_BYTES}-byte key: restore it from a backup or the team "
                             "(fingerprints and the ledger's dataset keys depend on it)")
    return key


def store_key_file(path: str | Path, key: bytes, must_match: bool = True) -> bytes:
    """Keep ``key`` in ``path`` (mode 0600; a folder created for it is 0700), atomically and never
    replacing a file: when ``path`` already holds this key, nothing changes. Another key there is
    refused (:class:`privacy.ledger.LedgerKeyError`) unless not ``must_match`` (a key just minted,
    which loses to the one another process wrote first). Returns the key now in ``path``."""
    import tempfile

    from privacy.ledger import LedgerKeyError, key_id_of

    path = Path(path)
    if not path.is_file():
        for folder in reversed([path.parent, *path.parent.parents]):  # every folder made here is 0700
            if not folder.exists():
                folder.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".key-", dir=path.parent)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, key)
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)  # atomic, and never replaces a key another process created first
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    stored = read_key_file(path, private=False)
    if stored != key and must_match:
        raise LedgerKeyError(f"{path} already holds another key (id {key_id_of(stored)}, not {key_id_of(key)}): "
                             "refusing to replace it; move it away first if it is not needed")
    return read_key_file(path)  # the file kept is the owner's alone (one made here is; an old one open to others: refused)


def _missing_team_key(paths: StatePaths, key_id: str | None) -> Exception:
    from privacy.ledger import LedgerKeyError

    where = f"ledger {paths.ledger_location}"
    if key_id is None:
        return LedgerKeyError(
            f"{where} has registered datasets but no team key recorded: their fingerprints were made with another "
            "key; import the key they were made with: privprompt key import KEYFILE (e.g. "
            "<state>/secrets/installation.key of the machine whose ledger was imported)")
    env = os.environ.get(TEAM_KEY_FILE_ENV)
    has = f"{TEAM_KEY_FILE_ENV}={env} names no key file" if env else "this machine does not have it"
    return LedgerKeyError(
        f"{where} keeps its datasets' keyed record digests under team key {key_id}, and {has}: on a machine of "
        "the team that has it run `privprompt key export FILE`, bring FILE here privately (with the ledger it "
        f"tells who is in the data) and run `privprompt key import FILE` (or set {TEAM_KEY_FILE_ENV}=FILE)")


def team_key(paths: StatePaths, mint: bool = True) -> bytes:
    """The team key of the shared ledger of ``paths``: the key file whose id the ledger records
    (``$PRIVPROMPT_TEAM_KEY_FILE`` when set, else ``<state>/secrets/team-keys/<key id>.key``). A key
    file of another id is refused; none is refused with one line saying how to get it
    (``privprompt key import``). A ledger that records no key id: a key in ``$PRIVPROMPT_TEAM_KEY_FILE``
    is recorded as its key; with no dataset registered, ``mint`` creates one (32 bytes from
    ``secrets``), writes it to its file and records its id (whichever machine records first wins:
    another machine's key file is then useless and removed)."""
    import secrets

    from privacy.ledger import LedgerKeyError, key_id_of

    ledger = paths.open_ledger()  # moves a key the database still holds out first
    key_id = ledger.team_key_id()
    env = os.environ.get(TEAM_KEY_FILE_ENV)
    if key_id is not None:
        path = paths.team_key_file(key_id)
        if not path.is_file():
            raise _missing_team_key(paths, key_id)
        if not env:
            owner_only(path)  # the state folder's own file; $PRIVPROMPT_TEAM_KEY_FILE's is the user's: refused if open
        key = read_key_file(path)
        if key_id_of(key) != key_id:
            raise LedgerKeyError(f"{path} holds team key {key_id_of(key)}, but ledger {paths.ledger_location} keeps "
                                 f"its datasets under team key {key_id}: privprompt key import the team's key file")
        return key
    if env and Path(env).expanduser().is_file():  # the team's key, named explicitly: recorded as the ledger's
        key = read_key_file(Path(env).expanduser())
        ledger.set_team_key_id(key_id_of(key))  # refused when another machine recorded another key first
        return key
    if ledger.has_datasets() or not mint:
        raise _missing_team_key(paths, None)
    fresh = secrets.token_bytes(KEY_BYTES)
    path = paths.team_key_file(key_id_of(fresh))
    key = store_key_file(path, fresh, must_match=False)  # $PRIVPROMPT_TEAM_KEY_FILE: the first writer's key
    try:
        recorded = ledger.set_team_key_id(key_id_of(key), minted=True)
    except LedgerKeyError:
        if key == fresh and not env:
            path.unlink(missing_ok=True)
        raise
    if recorded != key_id_of(key):  # another machine recorded its key first: this one is of no use
        if not env:
            path.unlink(missing_ok=True)
        return team_key(paths, mint=False)
    return key


def ledger_key(paths: StatePaths, mint: bool = True) -> bytes:
    """The key of the ledger of ``paths``: the team key of a shared ledger (:func:`team_key`), else
    the state folder's ``installation.key``."""
    if paths.ledger_is_shared:
        return team_key(paths, mint)
    if not mint and not paths.installation_key.is_file():
        from privacy.ledger import LedgerKeyError

        raise LedgerKeyError(f"this state folder has no key yet ({paths.installation_key}): no run has used it")
    return installation_secret(paths.private)


def export_key(paths: StatePaths, destination: str | Path) -> tuple[str, Path]:
    """Write the key of the ledger of ``paths`` (:func:`ledger_key`; a new team ledger's key is
    created here) to ``destination`` (mode 0600, never replacing another file) for the team to
    import. Returns (key id, the file)."""
    from privacy.ledger import key_id_of

    key = ledger_key(paths)
    destination = Path(destination).expanduser().resolve()
    store_key_file(destination, key)  # refused when another key is there
    return key_id_of(key), destination


def import_key(paths: StatePaths, source: str | Path) -> tuple[str, Path]:
    """Keep the key in ``source`` as the key of the ledger of ``paths`` (``source`` may be open to
    others, e.g. copied with a loose umask: it is read, and the copy kept is 0600; the CLI warns and
    says to delete it). A shared ledger: checked
    against the key id it records (another key is refused), or recorded as its key when it records
    none; kept in :meth:`StatePaths.team_key_file`. The state folder's own ledger: kept as its
    ``installation.key`` (refused when a different one is there). Returns (key id, where it is kept)."""
    from privacy.ledger import LedgerKeyError, key_id_of

    key = read_key_file(source, private=False)  # a copy brought here: kept 0600 below (the caller warns)
    key_id = key_id_of(key)
    if paths.ledger_is_shared:
        ledger = paths.open_ledger()
        stored = ledger.team_key_id()
        if stored is not None and stored != key_id:
            raise LedgerKeyError(f"{source} holds key {key_id}, but ledger {paths.ledger_location} keeps its datasets "
                                 f"under team key {stored}: ask the team for that key's file")
        if stored is None:
            ledger.set_team_key_id(key_id)
        target = paths.team_key_file(key_id)
    else:
        target = paths.installation_key
    store_key_file(target, key)
    for cached in [c for c in _TEAM_KEYS if c[0] == paths.ledger_url]:
        del _TEAM_KEYS[cached]
    return key_id, target


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


UI_MARKER = "ui.json"  # under PREFECT_HOME while `privprompt ui` serves the Prefect UI of that home


def persistent_ui_url(prefect_home: str | Path | None) -> str:
    """The Prefect UI that `privprompt ui` serves on this state folder's Prefect home, while its
    process lives ("" when none): a run's "View at" link points there, never at a throwaway server."""
    if not prefect_home:
        return ""
    try:
        marker = json.loads((Path(prefect_home) / UI_MARKER).read_text())
        os.kill(int(marker["pid"]), 0)
        return str(marker["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


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
    defaults()  # the set-up's templates, where it made them and no setting says otherwise
    template = os.environ.get(PREFECT_TEMPLATE_ENV)
    if template and not any(os.environ.get(k) for k in _PREFECT_DB_SETTINGS):
        # the ephemeral server's database is this home's prefect.db: start it as a copy of a
        # migrated one, not from the ~20 s of migrations and block registrations of a first start
        seed_copy(Path(template), paths.prefect_home / "prefect.db")


# A migrated Prefect database to copy into a new PREFECT_HOME (the test suite keeps one per run:
# tests/conftest.py); a setting naming the server or its database elsewhere makes it irrelevant.
_PREFECT_DB_SETTINGS = ("PREFECT_API_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL",
                        "PREFECT_API_DATABASE_CONNECTION_URL")


def seed_copy(template: Path, target: Path) -> bool:
    """Put a 0600 copy of ``template`` at ``target`` when nothing is there (a hard link from a
    temporary copy beside it: a file made there meanwhile is never replaced). For the empty,
    migrated databases a new state folder can start from (they only save time): False, and
    nothing written, where the template or the folder is missing or the copy fails."""
    if target.exists() or not target.parent.is_dir() or not template.is_file():
        return False
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-", suffix=".tmp")  # 0600
        try:
            with os.fdopen(fd, "wb") as out, template.open("rb") as src:
                shutil.copyfileobj(src, out)
            os.link(tmp, target)
        finally:
            os.unlink(tmp)
    except OSError:  # FileExistsError included: made meanwhile
        return False
    return True
