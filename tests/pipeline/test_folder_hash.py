"""A local model folder's SHA-256: the same digest as before the cache, computed once per version of
its files (persistent cache, background prefetch), and computed again when a file changes."""

from __future__ import annotations

import hashlib
import os

import pytest

from models import folder_hash
from models.backbone_ref import folder_sha256


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVPROMPT_HASH_CACHE", str(tmp_path / "cache" / "sha.json"))
    folder_hash.clear_memo()
    root = tmp_path / "model"
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "model.safetensors").write_bytes(os.urandom(3000))
    (root / "sub" / "tokenizer.json").write_text("{}")
    (root / "README.md").write_text("not hashed")
    yield root
    folder_hash.clear_memo()


def independent_digest(root) -> str:
    """The format published references carry: sorted model files, each name, NUL, then its bytes."""
    h = hashlib.sha256()
    for p in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".safetensors")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def test_digest_is_the_published_format_and_is_cached_on_disk_0600(folder, monkeypatch):
    digest = folder_sha256(folder)
    assert digest == independent_digest(folder)
    cache = folder_hash.cache_file()
    assert cache.exists() and (cache.stat().st_mode & 0o777) == 0o600
    folder_hash.clear_memo()  # a new process: the digest comes from the cache, no file is read
    monkeypatch.setattr(folder_hash, "_digest", lambda *a: pytest.fail("hashed again"))
    assert folder_sha256(folder) == digest


def test_a_changed_file_is_hashed_again_even_with_its_size_and_mtime_kept(folder):
    before = folder_sha256(folder)
    weights = folder / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(os.urandom(st.st_size))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the ctime still moved
    folder_hash.clear_memo()
    after = folder_sha256(folder)
    assert after != before and after == independent_digest(folder)


def test_prefetch_hashes_once_in_the_background(folder, monkeypatch):
    calls = []
    real = folder_hash._digest
    monkeypatch.setattr(folder_hash, "_digest", lambda *a: calls.append(1) or real(*a))
    fut = folder_hash.prefetch(folder)
    assert fut is not None
    assert folder_sha256(folder) == independent_digest(folder) == fut.result(timeout=30)
    assert folder_hash.prefetch(folder) is None  # known now: nothing to start
    assert len(calls) == 1


def test_a_failed_prefetch_does_not_hide_the_error_of_a_folder_that_cannot_be_read(folder, monkeypatch):
    def boom(*a):
        raise OSError("unreadable weights")

    monkeypatch.setattr(folder_hash, "_digest", boom)
    fut = folder_hash.prefetch(folder)
    with pytest.raises(OSError, match="unreadable weights"):
        fut.result(timeout=30)
    with pytest.raises(OSError, match="unreadable weights"):
        folder_sha256(folder)
