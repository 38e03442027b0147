"""SHA-256 of a local model folder, computed once per version of its files.

A published prompt names its backbone; a local folder is named by path and by a SHA-256 over its
model files, so that a changed folder is noticed when the prompt is used later
(:mod:`models.backbone_ref`). Hashing a 7B model's 13.5 GB of weights takes 10-15 s, which a run paid
again in every process, after training (bench/RESULTS.md: the first 7B flow runs on a GPU). Two things
take it off the run's path:

* a persistent cache (``$PRIVPROMPT_HASH_CACHE``, default ``~/.cache/privprompt/folder_sha256.json``,
  0600) keyed by the folder and every file's (name, size, mtime, ctime, inode): git's index trick; a
  file rewritten in place changes its ctime, which no user can set back, so a changed file is hashed
  again;
* :func:`prefetch`, called when a local folder's model is loaded, hashes it in a background thread
  while the run trains; :func:`folder_sha256` joins that thread instead of hashing twice.

Model folders are not private data: their paths and digests are what a published prompt records.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import Future
from pathlib import Path

HASHED_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".gguf")
_LOCK = threading.Lock()
_MEMO: dict[tuple, str] = {}
_PENDING: dict[str, Future] = {}


def cache_file() -> Path:
    return Path(os.environ.get("PRIVPROMPT_HASH_CACHE") or Path.home() / ".cache" / "privprompt" / "folder_sha256.json")


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in HASHED_SUFFIXES)


def signature(root: Path) -> tuple:
    """What identifies this version of the folder's files without reading them."""
    sig = []
    for p in _files(root):
        st = p.stat()
        sig.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return (str(root), tuple(sig))


def _digest(root: Path, files) -> str:
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0")
        with open(root / rel, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def _sig_key(sig: tuple) -> str:
    return hashlib.sha256(json.dumps(sig).encode()).hexdigest()


def _read_cache() -> dict:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, digest: str) -> None:
    """Add one entry (best effort: a cache that cannot be written costs only time)."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = _read_cache()
        data[key] = digest
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _compute(root: Path, sig: tuple) -> str:
    key = _sig_key(sig)
    digest = _read_cache().get(key)
    if not isinstance(digest, str):
        digest = _digest(root, [rel for rel, *_ in sig[1]])
        if signature(root) != sig:  # the files changed while they were read: not a version to remember
            raise RuntimeError(f"the model files in {root} changed while they were hashed")
        _write_cache(key, digest)
    return digest


def folder_sha256(path: str | Path) -> str:
    """SHA-256 over the model files of a folder (names and contents, sorted; subfolders too)."""
    root = Path(path).resolve()
    sig = signature(root)
    with _LOCK:
        if sig in _MEMO:
            return _MEMO[sig]
        pending = _PENDING.get(str(root))
    if pending is not None:
        try:
            pending.result()
        except Exception:  # noqa: BLE001 - the prefetch failed: hash here, and raise here if it fails again
            pass
        with _LOCK:
            if sig in _MEMO:
                return _MEMO[sig]
    digest = _compute(root, sig)
    with _LOCK:
        _MEMO[sig] = digest
    return digest


def prefetch(path: str | Path) -> Future | None:
    """Start hashing ``path`` in a background thread (no-op if it is known or already being hashed)."""
    root = Path(path).resolve()
    if not root.is_dir():
        return None
    sig = signature(root)
    with _LOCK:
        if sig in _MEMO or str(root) in _PENDING:
            return _PENDING.get(str(root))
        fut: Future = Future()
        _PENDING[str(root)] = fut

    def work() -> None:
        try:
            digest = _compute(root, sig)
            with _LOCK:
                _MEMO[sig] = digest
            fut.set_result(digest)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            fut.set_exception(e)
        finally:
            with _LOCK:
                _PENDING.pop(str(root), None)

    threading.Thread(target=work, name=f"sha256:{root.name}", daemon=True).start()
    return fut


def clear_memo() -> None:
    """Forget the in-process digests (tests); the persistent cache stays."""
    with _LOCK:
        _MEMO.clear()
