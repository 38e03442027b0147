"""Partition a labelled text dataset into private train / holdout / test Parquet files.

Plain functions (no Prefect): read a data folder's split files or a hub dataset through the
registry of data sources (:mod:`tasks.sources`: JSONL, CSV, Parquet, the hub; one module each), map labels,
split and subsample by a keyed hash of each record (so one source record added or removed changes
only its own assignment), optionally plant canaries, write Parquet under ``<state>/private/``,
fingerprint the training partition, and keep the source's keyed record digests (the ledger knows a
dataset by its records: :func:`record_digests`). Nothing here logs or returns example text.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import tempfile
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import sources
from .schema import DataConfig
from .errors import DataError
from .state import digest_key, make_private_dir, owner_only_tree

@dataclass(frozen=True)
class Partition:
    """Where a partition lives and what it holds (counts, labels, fingerprint); no text."""

    dataset: str
    directory: str
    fingerprint: str          # keyed hash (HMAC) of this partition's training texts and labels
    labels: list[str]
    n_train: int
    n_holdout: int
    n_test: int
    n_canaries_planted: int
    # the ledger's key of the private SOURCE dataset: in the manifest, the source's own records key
    # (``source_key``); a run replaces it by the key of the registered dataset the source is charged
    # to (:func:`tasks.charge.source_dataset`), which may be another one sharing its records
    dataset_key: str = ""
    source_key: str = ""      # keyed hash of the source's record set (:func:`records_key`)
    legacy_key: str = ""      # the source's key before ledger schema 5 (keyed hash of its files' bytes)
    # the split sizes as released (Gaussian noise from secret randomness, drawn once per partition:
    # :func:`release_sizes`): what runs publish and plan with; the exact sizes above stay local
    released: dict = field(default_factory=dict)
    # the privacy unit (``data.privacy_unit``): `record`, or the field naming a person; with a user
    # unit the train / holdout files carry each row's keyed unit digest (column ``unit``), the exact
    # unit counts below stay local and the released sizes count units. A record-level run on a
    # dataset of people (``data.person_field``; ``unit`` stays `record`): the field, by which whole
    # people were split and capped, and ``group_size`` = k > 0: its rows carry no units (the
    # mechanism is per record), its sizes count records, and its events are charged for k records
    # of a person (:attr:`ledger_unit`)
    unit: str = "record"
    person_field: str = ""
    group_size: int = 0
    n_train_units: int = 0
    n_holdout_units: int = 0
    n_test_units: int = 0
    n_canary_units_planted: int = 0  # with a user unit: planted canary units (n_canaries_planted counts records)
    # exact, for the operator's terminal only (never published): the source records
    # ``data.max_records_per_unit`` left out, and the test split's label counts
    n_dropped_by_cap: int = 0
    test_label_counts: dict = field(default_factory=dict)

    @property
    def ledger_unit(self) -> str:
        """The unit its ledger dataset and every charge are stated for: ``unit``, or the person's
        field of a record-level run on a dataset of people."""
        return self.unit if self.unit != "record" else (self.person_field or "record")

    @property
    def train_path(self) -> str:
        return str(Path(self.directory) / "train.parquet")

    @property
    def holdout_path(self) -> str:
        return str(Path(self.directory) / "holdout.parquet")

    @property
    def test_path(self) -> str:
        return str(Path(self.directory) / "test.parquet")

    @property
    def canaries_path(self) -> str:
        return str(Path(self.directory) / "canaries.parquet")

    @property
    def records_path(self) -> str:
        """The source's keyed record digests (:func:`record_digests`), private working data."""
        return str(Path(self.directory) / RECORDS_FILE)

    def source_records(self) -> "SourceRecords":
        return SourceRecords(self.source_key, Path(self.records_path).read_bytes(), self.legacy_key)

    @property
    def published_key(self) -> str:
        """The ``dataset.fingerprint`` a run publishes: the keyed hash of its SOURCE's own records,
        never the key of the ledger dataset it is charged to — which dataset that is depends on
        whether one record also lies in another source (a published charged key would tell a
        record's presence with certainty). The charged key stays in the local ledger."""
        return self.source_key or self.dataset_key

    @property
    def sizes(self) -> "ReleasedSizes":
        """The released split sizes (what a run publishes and plans with)."""
        return ReleasedSizes(**self.released)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ReleasedSizes:
    """A partition's split sizes as released by one Gaussian mechanism on the disjoint counts
    (``privacy.mechanisms.release_counts``: σ records of noise, L2 sensitivity 1 under add/remove
    of one source record). Runs publish these as ``data.n_train`` / ``data.n_holdout`` /
    ``data.n_test``, derive the sampling rate q = B/n_train, the step count and δ from them, and
    compose :attr:`event` into every dp run's ε: an exact n would give away one record's presence
    to someone who knows all the others (and q, steps and δ = 0.1/n would carry it)."""

    n_train: int
    n_holdout: int
    n_test: int
    sigma: float
    # what the counts count: `record`, or the user-unit field (then they are counts of units)
    unit: str = "record"

    @property
    def event(self):
        from privacy.mechanisms import count_release_event

        return count_release_event(self.sigma)

    @property
    def n_for_delta(self) -> int:
        """n for the δ rule (δ ≤ 1/(10 n), δ ≥ 1/n refused): the released n_train plus 3σ, an upper
        bound on the exact size but with probability 0.13%, so the rule errs towards a smaller δ."""
        import math

        return int(self.n_train + math.ceil(3 * self.sigma))

    def params(self) -> dict:
        params = {"data.n_train": self.n_train, "data.n_holdout": self.n_holdout, "data.n_test": self.n_test,
                  "data.size_noise_sigma": self.sigma}
        if self.unit != "record":
            params["data.sizes_count"] = "units"
        return params


def release_sizes(cfg: DataConfig, membership: str, private_dir: str | Path, exact: dict[str, int],
                  canaries_planted: int = 0, draw: bool = True) -> ReleasedSizes | None:
    """The released sizes of the partition whose SOURCE records per split have the keyed key
    ``membership`` (:func:`membership_key`), drawn once from secret randomness and kept under
    ``private/released-sizes/`` so that ``plan`` and every run on those splits use (and publish)
    the same draw: a fresh draw per run would be a fresh release each time, averaging the noise
    away. The draw is keyed by the splits' records, not by the config: an edit that leaves every
    split's records as they were (another ``data.name``, a tweaked ``data.size_noise_sigma``, a
    fraction that moves no record) finds the same draw — with its own σ, which the file keeps —
    so no config edit buys a fresh look at the same counts. Only the source's records are
    released by the mechanism; the canaries planted (a function of the logged seed, known to the
    audit) are added to the released training size afterwards. Created atomically; a concurrent
    creator's draw wins. ``draw`` False: None instead of a fresh draw (a preview that is no run)."""
    from privacy.mechanisms import release_counts
    from privacy.rng import secret_rng

    folder = Path(private_dir) / "released-sizes"
    path = folder / f"{membership}.json"
    if not path.is_file() and not draw:  # a preview that must not release anything: nothing drawn yet
        return None
    if not path.is_file():
        make_private_dir(folder)
        names = ("n_train", "n_holdout", "n_test")
        noisy = release_counts([int(exact[k]) for k in names], cfg.size_noise_sigma, secret_rng())
        data = {**dict(zip(names, noisy)), "sigma": float(cfg.size_noise_sigma), "unit": cfg.privacy_unit}
        fd, tmp = tempfile.mkstemp(prefix=".sizes-", dir=folder)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
            fh.flush()
            os.fsync(fh.fileno())  # complete on disk before it is linked in: a crash never leaves half a draw
        try:
            os.link(tmp, path)  # fails when another process released these splits' sizes first
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    drawn = json.loads(path.read_text())
    return ReleasedSizes(n_train=int(drawn["n_train"]) + int(canaries_planted), n_holdout=int(drawn["n_holdout"]),
                         n_test=int(drawn["n_test"]), sigma=float(drawn["sigma"]), unit=drawn.get("unit", "record"))


# ---- reading ---------------------------------------------------------------------------------

def find_split_file(folder: Path, split: str) -> Path:
    """The file of ``split`` in ``folder``: ``<split><suffix>`` of a registered file format
    (:mod:`tasks.sources`), the first present in their precedence order."""
    suffixes = sources.file_suffixes()
    for ext in suffixes:
        candidate = folder / f"{split}{ext}"
        if candidate.is_file():
            return candidate
    raise DataError(f"no '{split}' file ({'/'.join(suffixes)}) in data folder {folder}")


def _unit_id(row: dict, cfg: DataConfig, source: str, i: int) -> str:
    """The unit id of a record (the value of ``data.privacy_unit``'s field, or of ``data.person_field``
    for a record-level run on a dataset of people) as text; a missing or empty one is a one-line
    error naming the field, never a value."""
    field = cfg.unit_field
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, (str, int, np.integer)) or not str(value).strip():
        key = "data.privacy_unit" if cfg.user_unit else "data.person_field"
        raise DataError(f"{source} record {i}: the privacy unit field '{field}' ({key}) is "
                        "missing or empty: every record needs the id of the person it belongs to (or set "
                        f"data.privacy_unit: record{'' if cfg.user_unit else ' without data.person_field'})")
    return str(value).strip()


def _normalise(rows: list[dict], cfg: DataConfig, source: str) -> tuple[list[str], list[str], list[str] | None]:
    texts, labels, units = [], [], ([] if cfg.unit_field is not None else None)
    known = set(cfg.labels)
    for i, row in enumerate(rows, 1):
        if cfg.text_field not in row or cfg.label_field not in row:
            key, field = (("data.text_field", cfg.text_field) if cfg.text_field not in row
                          else ("data.label_field", cfg.label_field))
            names = [str(k) for k in row][:12]  # the file's column names, never a value
            raise DataError(f"{source} record {i}: missing field '{field}' (the column {key} names; this record "
                            f"has {', '.join(repr(n) for n in names) or 'no fields'}): set {key} to the "
                            f"column that holds the {key.split('.')[1].split('_')[0]}")
        text, raw = row[cfg.text_field], row[cfg.label_field]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{source} record {i}: field '{cfg.text_field}' must be non-empty text")
        label = cfg.label_map.get(str(raw), raw)
        if isinstance(label, (int, np.integer)) and not isinstance(label, bool) and 0 <= label < len(cfg.labels):
            label = cfg.labels[int(label)]
        if label not in known:  # never the value itself: a mis-set label_field would echo private text
            raise DataError(f"{source} record {i}: unknown label in field '{cfg.label_field}': its value (not "
                            f"shown: it may be private text) is not one of {cfg.labels} nor mapped by label_map")
        if units is not None:
            units.append(_unit_id(row, cfg, source, i))
        texts.append(text)
        labels.append(label)
    if not texts:
        raise DataError(f"{source} is empty")
    return texts, labels, units


def resolve_data_folder(cfg: DataConfig, data_root: str | None) -> Path:
    if cfg.path:
        return Path(cfg.path).expanduser()
    if data_root is None:
        raise DataError(f"no data root: set data.path, data_root or $PRIVPROMPT_DATA_ROOT for {cfg.name!r}")
    return Path(data_root) / cfg.name


def read_split(cfg: DataConfig, data_root: str | None, split: str) -> tuple[list[str], list[str]]:
    """(texts, labels) of one split of the source."""
    return read_split_units(cfg, data_root, split)[:2]


def read_split_units(cfg: DataConfig, data_root: str | None, split: str
                     ) -> tuple[list[str], list[str], list[str] | None]:
    """(texts, labels, unit ids) of one split; unit ids None without a field naming a person
    (``data.privacy_unit: record`` and no ``data.person_field``).
    The unit ids are private (they identify people): they never leave this module but as keyed
    digests (:func:`unit_digests`)."""
    named = sources.named_source(cfg)
    if named is not None:
        return _normalise(named.read_split(cfg, split), cfg, named.describe(cfg, split))
    folder = resolve_data_folder(cfg, data_root)
    if not folder.is_dir():
        raise DataError(f"data folder not found: {folder}")
    path = find_split_file(folder, split)
    try:  # keyed by the file's bytes (a rewrite within one mtime tick is still seen), its reader and the config
        key = (str(path.resolve()), hashlib.sha256(path.read_bytes()).digest(),
               type(sources.source_for_file(path)).__qualname__, cfg.model_dump_json())
    except OSError as err:
        raise DataError(f"cannot read {path}: {type(err).__name__}") from None
    with _READS_LOCK:
        hit = _READS.get(key)
    if hit is None:  # plan and a run's preflight read each split more than once (keys, sizes, notes)
        hit = _normalise(sources.read_file(path), cfg, str(path))
        with _READS_LOCK:
            while len(_READS) >= 4:
                _READS.pop(next(iter(_READS)), None)
            _READS[key] = hit
    texts, labels, units = hit
    return list(texts), list(labels), None if units is None else list(units)


_READS: dict = {}  # this process's last few reads of a split file (task threads share it: under the lock)
_READS_LOCK = threading.Lock()


def source_signature(cfg: DataConfig, data_root: str | None) -> str:
    """Identifies the input files (path, size, mtime) so that caches notice changed data."""
    named = sources.named_source(cfg)
    if named is not None:
        return named.signature(cfg)
    folder = resolve_data_folder(cfg, data_root)
    parts = []
    for split in (cfg.train_split, cfg.test_split):
        try:
            p = find_split_file(folder, split)
            st = p.stat()
            parts.append(f"{p.resolve()}:{st.st_size}:{int(st.st_mtime)}")
        except DataError:
            parts.append(f"{folder}/{split}:missing")
    return "|".join(parts)


# ---- partitioning ----------------------------------------------------------------------------

def fingerprint(texts: list[str], labels: list[str], key: bytes, salt: str = "") -> str:
    """HMAC-SHA256 (``key``: the installation secret) of ``salt`` and the ordered texts and labels:
    without the key, a published fingerprint confirms no guess about a record. A partition's is
    salted with its source's records key, so an exactly empty training split does not publish one
    constant of the installation (seen once, it read the 0-vs-1 bit off any run)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    if salt:
        h.update(salt.encode("utf-8") + b"\x1d")
    for t, y in zip(texts, labels):
        h.update(t.encode("utf-8"))
        h.update(b"\x1f")
        h.update(y.encode("utf-8"))
        h.update(b"\x1e")
    return h.hexdigest()


def make_canaries(n: int, labels: list[str], rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """Random canary sentences (random letter strings: never in real data) with random labels."""
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    texts = []
    for _ in range(n):
        words = ["".join(rng.choice(alphabet, size=rng.integers(4, 9))) for _ in range(8)]
        texts.append("canary " + " ".join(words))
    return texts, [labels[int(i)] for i in rng.integers(0, len(labels), size=n)]


def _write_table(path: Path, texts: list[str], labels: list[str], extra: dict | None = None) -> None:
    columns = {"text": texts, "label": labels}
    columns.update(extra or {})
    pq.write_table(pa.table(columns), path)


# ---- datasets known by their records -----------------------------------------------------------

RECORDS_FILE = "records.bin"
RECORD_DIGEST_BYTES = 16
_TAG_RECORD = b"privprompt/record\x00"
_TAG_DATASET = b"privprompt/dataset-records\x00"


@dataclass(frozen=True)
class SourceRecords:
    """A private source as the ledger knows it: its records key, its keyed record digests (sorted,
    16 bytes each, end to end) and its key before ledger schema 5. No text."""

    key: str
    digests: bytes
    legacy_key: str = ""

    def __len__(self) -> int:
        return len(self.digests) // RECORD_DIGEST_BYTES


def record_digests(key: bytes, texts: list[str]) -> bytes:
    """The keyed digests of a source's records, sorted and distinct, 16 bytes each end to end:
    HMAC-SHA256 (``key``: the installation or team secret) of the normalised text (HTML entities
    unescaped, Unicode NFKC, case-folded, whitespace collapsed), truncated to 128 bits. The TEXT is
    the record: format, order, field names and labels do not change a digest, so a re-export (JSONL
    → CSV / Parquet, reordered), a relabelled copy (another label_map or label set, a corrected
    label) or a text-normalised one (lower-cased, another Unicode form, HTML-escaped) holds the same
    records. Two texts that differ only so count as one record: the ledger then charges their
    sources together, never apart (it may over-count, never under-count). Without the key a digest
    confirms no guess about a text."""
    base = hmac.new(key, _TAG_RECORD, hashlib.sha256)
    out = set()
    for t in texts:
        h = base.copy()
        h.update(record_text(t).encode("utf-8"))
        out.add(h.digest()[:RECORD_DIGEST_BYTES])
    return b"".join(sorted(out))


def record_text(text: str) -> str:
    """A record's text as the ledger knows it (:func:`record_digests`): HTML entities unescaped,
    Unicode NFKC, case-folded, whitespace collapsed."""
    import html
    import unicodedata

    return " ".join(unicodedata.normalize("NFKC", html.unescape(text)).casefold().split())


def records_key(key: bytes, digests: bytes) -> str:
    """The key of a record set: HMAC-SHA256 (``key``) of its sorted distinct digests. The same
    records in any format or order give the same key."""
    return hmac.new(key, _TAG_DATASET + digests, hashlib.sha256).hexdigest()


def source_records(cfg: DataConfig, data_root: str | None, private_dir: str | Path, seed: int = 0) -> SourceRecords:
    """The private source's :class:`SourceRecords`: from its partition when one exists (written by
    :func:`partition_dataset`), else by reading its train and test splits (writing nothing)."""
    from .state import installation_secret

    manifest = Path(private_dir) / "partitions" / f"{cfg.name}-{partition_key(cfg, seed, data_root, private_dir)}" / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        if data.get("source_key") and (manifest.parent / RECORDS_FILE).is_file():
            return Partition(**data).source_records()
    secret = installation_secret(private_dir)
    texts = read_split(cfg, data_root, cfg.train_split)[0] + read_split(cfg, data_root, cfg.test_split)[0]
    digests = record_digests(secret, texts)
    return SourceRecords(records_key(secret, digests), digests, legacy_dataset_key(cfg, data_root, private_dir))


def dataset_key(cfg: DataConfig, data_root: str | None, private_dir: str | Path) -> str:
    """The private source's own records key (:func:`records_key` of its train and test records):
    the ledger's key of the dataset when the source is registered as itself. Every run drawing
    from it — any seed, subsample, holdout or canaries — composes against one budget; a source
    sharing records with a registered dataset is charged to that one (:func:`source_records`,
    ``Ledger.register_source``)."""
    return source_records(cfg, data_root, private_dir).key


def legacy_dataset_key(cfg: DataConfig, data_root: str | None, private_dir: str | Path) -> str:
    """The ledger's key of a source before schema 5: an HMAC (installation secret) of the bytes
    of its train and test split files, or of the hub id, config and revision. Kept only to find a
    dataset registered then, which gets its record digests at its next run."""
    from .state import installation_secret

    h = hmac.new(installation_secret(private_dir), digestmod=hashlib.sha256)
    if cfg.hub:
        h.update(json.dumps({"hub": cfg.hub, "config": cfg.hub_config, "revision": cfg.hub_revision}).encode())
        return h.hexdigest()
    folder = resolve_data_folder(cfg, data_root)
    for split in (cfg.train_split, cfg.test_split):
        path = find_split_file(folder, split)
        h.update(f"\x1e{split}\x1f".encode())
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# Domain tags of the keyed per-record hashes: independent draws for the train / holdout split,
# the test subsample and the order of rows in a partition file.
_TAG_SPLIT = b"privprompt/split/train-holdout\x00"
_TAG_TEST = b"privprompt/split/test\x00"
_TAG_ORDER = b"privprompt/order\x00"


def record_uniforms(key: bytes, tag: bytes, texts: list[str], labels: list[str]) -> np.ndarray:
    """u in [0, 1) per record: HMAC-SHA256 (``key``: the installation secret) of ``tag``, the
    whitespace-normalised text (as ``_text_digest``) and the label. A record's u depends on that
    record alone, so a split or subsample by u is neighbour-stable: adding or removing one source
    record changes no other record's assignment. Without the key, u is unpredictable (a PRF), so
    a split by u is as good as secret randomness, fixed per installation. Duplicated records (same
    text and label) get the same u and land together."""
    out = np.empty(len(texts), dtype=np.float64)
    base = hmac.new(key, tag, hashlib.sha256)
    for i, (t, y) in enumerate(zip(texts, labels)):
        h = base.copy()
        h.update(" ".join(t.split()).encode("utf-8"))
        h.update(b"\x1f")
        h.update(y.encode("utf-8"))
        out[i] = (int.from_bytes(h.digest()[:8], "big") >> 11) / float(1 << 53)  # 53 bits: exact in a double
    return out


def assign_splits(cfg: DataConfig, key: bytes, texts: list[str], labels: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(train mask, holdout mask) over the source's training records: holdout when
    u < holdout_fraction, training when holdout_fraction ≤ u < holdout_fraction + train rate,
    otherwise unused. Disjoint by construction; each record by its own u."""
    u = record_uniforms(key, _TAG_SPLIT, texts, labels)
    holdout = u < cfg.holdout_fraction
    train = (u >= cfg.holdout_fraction) & (u < cfg.holdout_fraction + cfg.train_rate)
    return train, holdout


def assign_test(cfg: DataConfig, key: bytes, texts: list[str], labels: list[str]) -> np.ndarray:
    """Mask of the test records kept: u (another tag: independent of the train split) < test_fraction."""
    if cfg.test_fraction >= 1.0:
        return np.ones(len(texts), dtype=bool)
    return record_uniforms(key, _TAG_TEST, texts, labels) < cfg.test_fraction


_TAG_SIZES = b"privprompt/released-sizes\x00"


def membership_key(key: bytes, splits: list[tuple[list[str], list[str]]]) -> str:
    """Keyed key of which source records (text and label) lie in each of ``splits`` (train,
    holdout, test): the released sizes' draw is kept under it (:func:`release_sizes`). Keyed with
    the installation or team secret, so it confirms no guess about a record."""
    h = hmac.new(key, _TAG_SIZES, hashlib.sha256)
    for texts, labels in splits:
        u = np.sort(record_uniforms(key, _TAG_SIZES, texts, labels))
        h.update(len(u).to_bytes(8, "big"))
        h.update(u.tobytes())
    return h.hexdigest()[:32]


def _keyed_order(key: bytes, texts: list[str], labels: list[str]) -> list[int]:
    """Row order of a partition file: by a keyed per-row hash (no seeded permutation; reveals
    nothing without the key, and never mixes in other records' positions)."""
    return [int(i) for i in np.argsort(record_uniforms(key, _TAG_ORDER, texts, labels), kind="stable")]


# ---- user units (data.privacy_unit: a field naming a person) ------------------------------------

_TAG_UNIT = b"privprompt/unit\x00"
_TAG_SPLIT_UNIT = b"privprompt/split/unit-train-holdout\x00"
_TAG_TEST_UNIT = b"privprompt/split/unit-test\x00"
_TAG_CAP = b"privprompt/unit-cap\x00"
UNIT_DIGEST_HEX = 32


def unit_digests(key: bytes, units: list[str]) -> list[str]:
    """Keyed digests of unit ids (HMAC-SHA256 with ``key``, the installation secret, 128 bits in
    hex): how a partition file names a record's unit. Without the key a digest confirms no guess
    about a person; the ids themselves are never written."""
    base = hmac.new(key, _TAG_UNIT, hashlib.sha256)
    out = []
    for u in units:
        h = base.copy()
        h.update(u.encode("utf-8"))
        out.append(h.hexdigest()[:UNIT_DIGEST_HEX])
    return out


def _digest_uniforms(key: bytes, tag: bytes, digests: list[str]) -> np.ndarray:
    """u in [0, 1) per unit digest: a keyed hash of the unit alone (as :func:`record_uniforms` for records)."""
    out = np.empty(len(digests), dtype=np.float64)
    base = hmac.new(key, tag, hashlib.sha256)
    memo: dict[str, float] = {}
    for i, d in enumerate(digests):
        if d not in memo:
            h = base.copy()
            h.update(d.encode("ascii"))
            memo[d] = (int.from_bytes(h.digest()[:8], "big") >> 11) / float(1 << 53)
        out[i] = memo[d]
    return out


def cap_per_unit(key: bytes, texts: list[str], labels: list[str], units: list[str], cap: int) -> np.ndarray:
    """Mask of the records kept under a contribution bound of ``cap`` records per unit: within each
    unit, the ``cap`` records of smallest keyed hash (:func:`record_uniforms`, its own tag). Which of
    a unit's records are kept depends on that unit's records alone, never on the seed nor on other
    units (neighbour-stable at the unit level)."""
    r = record_uniforms(key, _TAG_CAP, texts, labels)
    keep = np.zeros(len(texts), dtype=bool)
    taken: dict[str, int] = {}
    for i in np.lexsort((r, np.array(units, dtype=object).astype(str))):
        u = units[int(i)]
        if taken.get(u, 0) < cap:
            taken[u] = taken.get(u, 0) + 1
            keep[int(i)] = True
    return keep


@dataclass
class SourceSplit:
    """Which source records go where: masks over the train split's records (``train``,
    ``holdout``) and the test split's (``test``); with a user unit, the keyed unit digests of both
    splits' records (None with ``record``)."""

    train: np.ndarray
    holdout: np.ndarray
    test: np.ndarray
    units: list[str] | None = None
    test_units: list[str] | None = None
    dropped_by_cap: int = 0  # records of the source a unit's cap left out (train side and test)

    def unit_counts(self, planted_canaries: int = 0) -> dict[str, int]:
        """Distinct units per split (plus ``planted_canaries`` planted canary units in training):
        what a user-unit partition releases (one unit moves one of these counts by at most one)."""
        pick = lambda mask, us: {u for u, m in zip(us, mask) if m}  # noqa: E731
        return {"n_train": len(pick(self.train, self.units)) + planted_canaries,
                "n_holdout": len(pick(self.holdout, self.units)),
                "n_test": len(pick(self.test, self.test_units))}


def split_source(cfg: DataConfig, key: bytes, train: tuple, test: tuple) -> SourceSplit:
    """The split rule of a partition. ``train`` / ``test``: (texts, labels, unit ids or None) of
    the source's two splits. With ``data.privacy_unit: record`` each record by its own keyed hash
    (:func:`assign_splits`, :func:`assign_test`). With a user unit, WHOLE units by a keyed hash of
    the unit id: a unit is held out when its u < holdout_fraction, trains when holdout_fraction ≤
    u < holdout_fraction + train rate; the test split keeps a unit's records when the unit's own
    test hash < test_fraction and the unit has no record on the training side (train or holdout) —
    so a person is never in both; ``data.max_records_per_unit`` then keeps at most that many of each
    unit's records (:func:`cap_per_unit`) in every split, the test split included (RAPT privatizes
    and releases it, and states η·T·k per unit). Every decision depends on one unit's records alone.
    A record-level run on a dataset of people (``data.person_field``) is split and capped the same
    way, by that field: its charge per person is for at most k records."""
    texts, labels, units = train
    test_texts, test_labels, test_units = test
    if cfg.unit_field is None:
        tr, ho = assign_splits(cfg, key, texts, labels)
        return SourceSplit(tr, ho, assign_test(cfg, key, test_texts, test_labels))
    ud, tud = unit_digests(key, units), unit_digests(key, test_units)
    u = _digest_uniforms(key, _TAG_SPLIT_UNIT, ud)
    holdout = u < cfg.holdout_fraction
    side = u < cfg.holdout_fraction + cfg.train_rate
    tr = side & ~holdout
    dropped = 0
    if cfg.max_records_per_unit is not None:
        kept = cap_per_unit(key, texts, labels, ud, cfg.max_records_per_unit)
        dropped += int(((tr | holdout) & ~kept).sum())
        tr, holdout = tr & kept, holdout & kept
    training_side = {d for d, m in zip(ud, side) if m}
    test_mask = np.array([d not in training_side for d in tud], dtype=bool)
    if cfg.test_fraction < 1.0:
        test_mask &= _digest_uniforms(key, _TAG_TEST_UNIT, tud) < cfg.test_fraction
    if cfg.max_records_per_unit is not None:  # the test split is released too (RAPT's privatized test draw)
        test_kept = cap_per_unit(key, test_texts, test_labels, tud, cfg.max_records_per_unit)
        dropped += int((test_mask & ~test_kept).sum())
        test_mask &= test_kept
    return SourceSplit(tr, holdout, test_mask, ud, tud, dropped)


def canary_unit_size(cfg: DataConfig) -> int:
    """Records per canary unit: ``data.canary_records_per_unit`` with a user unit, else 1."""
    return cfg.canary_records_per_unit if cfg.user_unit else 1


def draw_canaries(cfg: DataConfig, seed: int) -> tuple[list[str], list[str], np.ndarray]:
    """Canary texts, labels and which are planted (each with probability ½), from the seeded audit
    randomness: canaries are not source records, and the audit knows their draw. With a user unit,
    ``data.canaries`` canary UNITS of :func:`canary_unit_size` records each (record j in unit
    j // size), each unit planted with probability ½ (``planted`` per record: its unit's)."""
    if not cfg.canaries:
        return [], [], np.zeros(0, dtype=bool)
    rng = np.random.default_rng(seed)
    size = canary_unit_size(cfg)
    texts, labels = make_canaries(cfg.canaries * size, cfg.labels, rng)
    return texts, labels, np.repeat(rng.random(cfg.canaries) < 0.5, size)


def release_inputs(cfg: DataConfig, key: bytes, split: "SourceSplit", train: tuple, test: tuple,
                   planted_units: int) -> tuple[str, dict[str, int], int]:
    """What :func:`release_sizes` needs: the splits' :func:`membership_key` (over each split's
    records; with a user unit over each split's distinct keyed unit digests — what the counts
    count, so another ``data.max_records_per_unit`` that keeps every unit where it was finds the
    same draw), the exact SOURCE counts per split (records, or distinct units with a user unit:
    what is released) and the planted canary units."""
    texts, labels, _ = train
    test_texts, test_labels, _ = test

    def rows(mask, xs, ys, uds):
        if uds is not None and cfg.user_unit:  # the split's units, each once (a record-level run counts records)
            kept = sorted({d for d, m in zip(uds, mask) if m})
            return kept, [""] * len(kept)
        return [x for x, m in zip(xs, mask) if m], [y for y, m in zip(ys, mask) if m]

    membership = membership_key(key, [([cfg.privacy_unit], [""]),  # what the counts count
                                      rows(split.train, texts, labels, split.units),
                                      rows(split.holdout, texts, labels, split.units),
                                      rows(split.test, test_texts, test_labels, split.test_units)])
    if cfg.user_unit:
        exact = split.unit_counts(0)
    else:
        exact = {"n_train": int(split.train.sum()), "n_holdout": int(split.holdout.sum()),
                 "n_test": int(split.test.sum())}
    return membership, exact, int(planted_units)


def split_release_inputs(cfg: DataConfig, seed: int, private_dir: str | Path,
                         data_root: str | None) -> tuple[str, dict[str, int], int]:
    """:func:`release_inputs` of a partition of ``cfg``, computed as :func:`partition_dataset`
    does, writing nothing (reads the source and hashes its records)."""
    return split_facts(cfg, seed, private_dir, data_root)[:3]


def split_facts(cfg: DataConfig, seed: int, private_dir: str | Path, data_root: str | None
                ) -> tuple[str, dict[str, int], int, list[str]]:
    """:func:`split_release_inputs` and the partition's :func:`split_notes` (exact: for the
    operator's terminal alone), computed as :func:`partition_dataset` does, writing nothing."""
    from .state import installation_secret

    key = installation_secret(private_dir)
    train = read_split_units(cfg, data_root, cfg.train_split)
    test = read_split_units(cfg, data_root, cfg.test_split)
    split = split_source(cfg, key, train, test)
    planted = int(draw_canaries(cfg, seed)[2].sum()) // canary_unit_size(cfg)
    kept = int(split.train.sum() + split.holdout.sum() + split.test.sum())
    test_labels = [y for y, m in zip(test[1], split.test) if m]
    counts = {label: test_labels.count(label) for label in cfg.labels}
    _refuse_one_class(cfg, counts)  # as the partition would be: before anything is planned or spent
    notes = split_notes(cfg, split.dropped_by_cap, kept, counts)
    return (*release_inputs(cfg, key, split, train, test, planted), notes)


def split_sizes(cfg: DataConfig, seed: int, private_dir: str | Path, data_root: str | None) -> dict[str, int]:
    """The sizes a partition of ``cfg`` releases (train with planted canaries, holdout, test):
    records, or with a user unit distinct units; computed as :func:`partition_dataset` does,
    writing nothing."""
    _, exact, planted = split_release_inputs(cfg, seed, private_dir, data_root)
    return {**exact, "n_train": exact["n_train"] + planted}


UNIT_DEFAULTS = {"privacy_unit": "record", "max_records_per_unit": None, "canary_records_per_unit": 1,
                 "person_field": None}


def data_dump(cfg: DataConfig) -> dict:
    """``cfg`` as JSON without the unit settings at their defaults: a record-unit config hashes (its
    partition key, its config hash) as it did before ``data.privacy_unit`` existed, so its
    partition and its released sizes are reused, never drawn again."""
    data = cfg.model_dump(mode="json")
    for k, v in UNIT_DEFAULTS.items():
        if data.get(k) == v:
            data.pop(k)
    return data


def partition_key(cfg: DataConfig, seed: int, data_root: str | None, private_dir: str | Path) -> str:
    """Cache key of a partition: the data config and the source files' signature, the seed only
    where canaries are planted (the split itself is by keyed hash, not by seed), and the id of the
    key that split it and named its source (:func:`tasks.state.key_id`): a state folder that joins
    a team ledger (another key) partitions anew instead of charging under its old key's name."""
    from .state import key_id

    # a user unit's cap applies to the test split too: such partitions made before are not reused
    split = "keyed-hash-v1" + ("+test-cap" if cfg.unit_field is not None and cfg.max_records_per_unit is not None
                               else "")
    return digest_key({"data": data_dump(cfg), "split": split,
                       "seed": seed if cfg.canaries else None, "source": source_signature(cfg, data_root),
                       "key": key_id(private_dir)})


def partition_dataset(cfg: DataConfig, seed: int, private_dir: str | Path, data_root: str | None) -> Partition:
    """Split into train / holdout / test by a keyed hash of each record (neighbour-stable: see
    :func:`record_uniforms`), plant canaries (seeded), written atomically."""
    from .state import installation_secret

    key = partition_key(cfg, seed, data_root, private_dir)
    out_dir = Path(private_dir) / "partitions" / f"{cfg.name}-{key}"
    reused = _reusable_partition(out_dir)
    if reused is not None:
        return reused
    secret = installation_secret(private_dir)
    train = read_split_units(cfg, data_root, cfg.train_split)
    test = read_split_units(cfg, data_root, cfg.test_split)
    split = split_source(cfg, secret, train, test)
    # an EXACTLY empty training or holdout split is partitioned like any other: refusing it here, on
    # exact counts, before any release, would be a 0-vs-1 test of one record outside ε;
    # the mechanisms run on empty splits (noise alone) and every decision after this reads released sizes
    rows = _partition_rows(cfg, seed, secret, split, train, test)
    make_private_dir(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))  # 0700
    try:
        part = _write_partition(tmp, out_dir, cfg, secret, rows, train, test, data_root, private_dir)
        part = replace(part, n_dropped_by_cap=split.dropped_by_cap,
                       test_label_counts={label: rows.test[1].count(label) for label in cfg.labels})
        _check_test_split(cfg, part)
        part = _with_released_sizes(cfg, private_dir, secret, split, rows, part, train, test)
        (tmp / "manifest.json").write_text(json.dumps(part.to_dict(), indent=1))
        owner_only_tree(tmp)  # its files 0600, whatever the umask they were written with
        try:
            os.replace(tmp, out_dir)  # atomic: a partition is complete or absent
        except OSError:
            if not (out_dir / "manifest.json").is_file():  # not a concurrent writer of the same partition
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Partition(**json.loads((out_dir / "manifest.json").read_text()))


def _reusable_partition(out_dir: Path) -> Partition | None:
    """The partition already written for the same data and config (and seed, with canaries); a
    folder written before datasets were known by their records is removed (partitioned again)."""
    manifest = out_dir / "manifest.json"
    if not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    if data.get("source_key") and data.get("released") and (out_dir / RECORDS_FILE).is_file():
        return Partition(**data)
    shutil.rmtree(out_dir)
    return None


@dataclass(frozen=True)
class _PartitionRows:
    """The rows of a partition's files in their keyed order ((texts, labels, units) per split; units
    None but with a user unit), and the canaries drawn (all of them, with which are planted)."""

    train: tuple
    holdout: tuple
    test: tuple
    canaries: tuple  # (texts, labels, planted)
    canary_size: int


def _partition_rows(cfg: DataConfig, seed: int, secret: bytes, split: "SourceSplit", train: tuple, test: tuple
                    ) -> _PartitionRows:
    texts, labels, _ = train
    test_texts, test_labels, _ = test
    pick = lambda mask, xs: [x for x, m in zip(xs, mask) if m]  # noqa: E731
    tr_texts, tr_labels = pick(split.train, texts), pick(split.train, labels)
    canary_texts, canary_labels, planted = draw_canaries(cfg, seed)
    tr_texts += pick(planted, canary_texts)
    tr_labels += pick(planted, canary_labels)
    # with a user unit, the rows' keyed unit digests (a planted canary is a unit of its own)
    size = canary_unit_size(cfg)
    tr_units = (pick(split.train, split.units) + [f"canary-{i // size:06d}" for i in np.flatnonzero(planted)]
                if cfg.user_unit else None)

    def ordered(xs, ys, us=None):
        order = _keyed_order(secret, xs, ys)
        return [xs[i] for i in order], [ys[i] for i in order], (None if us is None else [us[i] for i in order])

    return _PartitionRows(
        train=ordered(tr_texts, tr_labels, tr_units),
        holdout=ordered(pick(split.holdout, texts), pick(split.holdout, labels),
                        pick(split.holdout, split.units) if cfg.user_unit else None),
        test=ordered(pick(split.test, test_texts), pick(split.test, test_labels)),
        canaries=(canary_texts, canary_labels, planted), canary_size=size)


def _write_partition(tmp: Path, out_dir: Path, cfg: DataConfig, secret: bytes, rows: _PartitionRows,
                     train: tuple, test: tuple, data_root: str | None, private_dir: str | Path) -> Partition:
    """The partition's files and the source's record digests written under ``tmp``; its manifest
    (without the released sizes)."""
    unit_col = lambda us: None if us is None else {"unit": us}  # noqa: E731
    (tr_texts, tr_labels, tr_units), (ho_texts, ho_labels, ho_units) = rows.train, rows.holdout
    te_texts, te_labels, _ = rows.test
    canary_texts, canary_labels, planted = rows.canaries
    _write_table(tmp / "train.parquet", tr_texts, tr_labels, unit_col(tr_units))
    _write_table(tmp / "holdout.parquet", ho_texts, ho_labels, unit_col(ho_units))
    _write_table(tmp / "test.parquet", te_texts, te_labels)
    if cfg.canaries:
        _write_table(tmp / "canaries.parquet", canary_texts, canary_labels, {
            "planted": planted.tolist(),
            **({"unit": [j // rows.canary_size for j in range(len(canary_texts))]} if cfg.user_unit else {})})
    digests = record_digests(secret, train[0] + test[0])  # the source's records (canaries are none of them)
    (tmp / RECORDS_FILE).write_bytes(digests)
    source_key = records_key(secret, digests)
    return Partition(dataset=cfg.name, directory=str(out_dir.resolve()),
                     fingerprint=fingerprint(tr_texts, tr_labels, secret, salt=source_key),
                     labels=list(cfg.labels), n_train=len(tr_texts), n_holdout=len(ho_texts),
                     n_test=len(te_texts), n_canaries_planted=int(planted.sum()),
                     dataset_key=source_key, source_key=source_key,
                     legacy_key=legacy_dataset_key(cfg, data_root, private_dir), unit=cfg.privacy_unit,
                     person_field=cfg.person_field or "", group_size=cfg.group_size or 0)


def _check_test_split(cfg: DataConfig, part: Partition) -> None:
    """An empty test split, or one of a single class (its accuracy is that class's recall, and a
    prompt that labels everything with it scores 1), is refused before anything is released: the
    test split is evaluation data, outside ε (its exact accuracies are published)."""
    if part.n_test == 0:
        raise DataError(f"dataset {cfg.name!r}: the test split is empty" +
                        ("; raise data.test_fraction" if cfg.test_fraction < 1 else "") +
                        (f" (with the privacy unit field {cfg.unit_field}, a test record is kept only when its "
                         "person has no record in training or holdout)" if cfg.unit_field is not None else ""))
    _refuse_one_class(cfg, part.test_label_counts)


def _refuse_one_class(cfg: DataConfig, test_label_counts: dict) -> None:
    if sum(1 for n in test_label_counts.values() if n) == 1:  # (which label: not said, the line may reach Prefect)
        raise DataError(f"dataset {cfg.name!r}: every test record has the same label (data.test_split "
                        f"{cfg.test_split!r}), so its accuracy would be the recall of one class; give the test split "
                        f"records of every label ({', '.join(map(repr, cfg.labels))})")


MINORITY_SHARE = 0.05  # a test class below this share of the split is flagged


def partition_notes(cfg: DataConfig, part: Partition) -> list[str]:
    """:func:`split_notes` of a written partition."""
    kept = part.n_train + part.n_holdout + part.n_test - part.n_canaries_planted
    return split_notes(cfg, part.n_dropped_by_cap, kept, part.test_label_counts)


def split_notes(cfg: DataConfig, dropped: int, kept: int, test_label_counts: dict) -> list[str]:
    """Lines for the operator's terminal alone (exact statistics of the private partition): the
    ``dropped`` records ``data.max_records_per_unit`` left out (``kept``: the records the splits
    hold), and a test class below 5 % of the test split."""
    notes = []
    if dropped:
        total = kept + dropped
        notes.append(f"data.max_records_per_unit = {cfg.max_records_per_unit} left out {dropped:,} of "
                     f"the {total:,} records the splits would hold ({dropped / total:.0%}): the runs "
                     "train, compare and test without them; raise it to keep more (the charge per person grows)")
    n = sum(test_label_counts.values())
    rare = [f"{label!r} {count} of {n}" for label, count in test_label_counts.items()
            if n and 0 < count < MINORITY_SHARE * n]
    if rare:
        notes.append(f"the test split holds few records of {', '.join(rare)} (below {MINORITY_SHARE:.0%}): its "
                     "accuracy is mostly the other classes'; read the balanced accuracy and per-class recall")
    return notes


def _with_released_sizes(cfg: DataConfig, private_dir: str | Path, secret: bytes, split: "SourceSplit",
                         rows: _PartitionRows, part: Partition, train: tuple, test: tuple) -> Partition:
    """``part`` with its unit counts (a user unit) and its released sizes, drawn once (:func:`release_sizes`)."""
    planted = rows.canaries[2]
    membership, exact, planted_units = release_inputs(cfg, secret, split, train, test,
                                                      int(planted.sum()) // rows.canary_size)
    if cfg.user_unit:  # released (and planned with): counts of units, sensitivity 1 per unit
        part = replace(part, **{f"{k}_units": v for k, v in split.unit_counts(planted_units).items()},
                       n_canary_units_planted=planted_units)
    sizes = release_sizes(cfg, membership, private_dir, exact, planted_units)
    return replace(part, released=asdict(sizes))


def read_partition_split(path: str) -> tuple[list[str], list[str]]:
    table = pq.read_table(path)
    return table.column("text").to_pylist(), table.column("label").to_pylist()


def read_partition_units(path: str) -> list[str] | None:
    """The keyed unit digests of a partition file's rows (None: a record-unit partition)."""
    table = pq.read_table(path)
    return table.column("unit").to_pylist() if "unit" in table.column_names else None


def read_public_texts(name: str, path: str | None, split: str, text_field: str, data_root: str | None,
                      private_dir: str | Path, size: int | None = None, seed: int = 0,
                      private_source: tuple[DataConfig, str | None] | None = None) -> list[str]:
    """Texts of a *public* dataset (distillation, prompt transfer). Refuses anything under the
    private folder, so a public-data stage can never read a private partition, and — given
    ``private_source`` (the private DataConfig and its data root) — a file that the config itself
    declares private (:func:`assert_not_the_private_source`: by path, never by content). Whether a
    public text also occurs in the private source is not looked at here: any answer a run gave would
    be a membership oracle (:func:`public_overlap` answers it on the operator's terminal)."""
    file = public_split_file(name, path, split, data_root)
    assert_public(file, private_dir)
    if private_source is not None:
        assert_not_the_private_source(file, private_source[0], private_source[1])
    rows = sources.read_file(file)
    texts = [r.get(text_field) for r in rows]
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise DataError(f"public dataset {file} has no '{text_field}' texts")
    if size is not None and size < len(texts):
        idx = np.random.default_rng(seed).choice(len(texts), size=size, replace=False)
        texts = [texts[i] for i in sorted(idx)]
    return texts


def public_split_file(name: str, path: str | None, split: str, data_root: str | None) -> Path:
    """The file of a public dataset's ``split``: in ``path``, else in ``<data_root>/<name>``."""
    folder = Path(path).expanduser() if path else (Path(data_root) / name if data_root else None)
    if folder is None or not folder.is_dir():
        raise DataError(f"public data folder not found: {folder}")
    return find_split_file(folder, split)


def public_texts(cfg, private_dir) -> list[str]:
    """The config's public texts (``public:``; POST's distillation and transfer, RAPT's vocabulary,
    Privacy-Flat's public sharpness data); refused when the config declares them private."""
    from .state import default_data_root

    p, root = cfg.public, default_data_root(cfg.data_root)
    return read_public_texts(p.name, p.path, p.split, p.text_field, root, private_dir, p.size, cfg.seed,
                             private_source=(cfg.data, root))


_PUBLIC: dict = {}


def cached_public_texts(cfg, paths) -> list[str]:
    """Public texts read once per process (audit shadows on one worker share them)."""
    key = (str(paths.root), json.dumps(cfg.public.model_dump(), sort_keys=True), cfg.seed)
    if key not in _PUBLIC:
        _PUBLIC[key] = public_texts(cfg, paths.private)
    return _PUBLIC[key]


def assert_not_the_private_source(public_file: Path, private: DataConfig, data_root: str | None) -> None:
    """Refuse public data that the config itself names as the private source: the same resolved file
    as one of its splits, or a file in its data folder. A function of the config's paths alone, never
    of what the files hold, so its answer is the same for neighbouring private datasets."""
    public_file = Path(public_file).resolve()
    if private.hub:
        return
    folder = resolve_data_folder(private, data_root)
    splits = [find_split_file(folder, s) for s in (private.train_split, private.test_split) if any(folder.glob(f"{s}.*"))]
    if public_file.parent == folder.resolve() or any(f.resolve() == public_file for f in splits):  # a split may be a link
        raise DataError(f"public data {public_file} is in the private dataset {private.name!r}'s folder "
                        f"({folder}): public-data stages may not read private records")


def public_overlap(cfg) -> tuple[int, int]:
    """(public texts, of them also a train or test record of the private source, as the ledger knows a
    record: :func:`record_text`): a fact about private data, for the operator's terminal only
    (``privprompt plan``). Runs
    never compute it: a DP guarantee holds for public data chosen without looking at the private
    source, whatever the two share (docs/privacy-claims.md)."""
    from .state import default_data_root

    p, root = cfg.public, default_data_root(cfg.data_root)
    rows = sources.read_file(public_split_file(p.name, p.path, p.split, root))
    texts = [r.get(p.text_field) for r in rows]
    public = [record_text(t) for t in texts if isinstance(t, str) and t.strip()]
    private: set[str] = set()
    for split in (cfg.data.train_split, cfg.data.test_split):
        try:
            private.update(record_text(t) for t in read_split(cfg.data, root, split)[0])
        except DataError:
            continue
    return len(public), sum(t in private for t in public)


def assert_public(path: str | Path, private_dir: str | Path) -> None:
    p, private = Path(path).resolve(), Path(private_dir).resolve()
    if p == private or private in p.parents:
        raise DataError(f"{p} is private working data; public-data stages may not read it")
