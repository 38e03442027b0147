"""Model checks that passed, remembered per machine: a plan need not load a model (seconds) to
learn again what the same files, settings and code answered before.

A check of a model's classifier (``methods.base.check_classifier``) is a function of the model's
files, the config's labels, label descriptions, template, placement and seed, and this code and its
libraries. Its answer on success — the model's positions, the one number the later check of
``models.max_length`` needs — is kept in ``<state folder>/cache/checks.json`` (beside the probe
cache, while ``privprompt plan`` or a run has enabled it) under a key of all of these: the files by
path, size and modification time, the code by the digest of the ``models/`` package and the modules
that build and check a classifier. A model known by a hub id only (no local folder to stat) is
checked every time. A failed check is never remembered: it fails again with its own message.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "peft")


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "models").rglob("*.py")) + [root / "tasks" / "methods" / "base.py",
                                                      root / "tasks" / "methodkit" / "classifiers.py",
                                                      Path(__file__).resolve()]
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    for name in _LIBRARIES:
        try:
            digest.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}=-".encode())
    return digest.hexdigest()


def _files(folder: Path) -> list | None:
    try:
        return sorted([str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns]
                      for p in folder.rglob("*") if p.is_file())
    except OSError:
        return None


def _model_files(model_name: str) -> list | None:
    """The files a model loads from (path, size, mtime), [] for a model built from code, None for
    one known by a hub id only (or SmolLM2, converted on its first use)."""
    from models.backbones import MINILM, SMOLLM2, TINY_MODELS, minilm_path

    if model_name in TINY_MODELS:
        return []
    if model_name == SMOLLM2:  # converted from its GGUF file on first use: the check does that
        return None
    try:
        folder = minilm_path() if model_name == MINILM else Path(model_name).expanduser()
    except Exception:  # noqa: BLE001 - not installed: the check itself says so
        return None
    if not folder.is_dir():
        return None
    files = _files(folder)
    return None if not files else [str(folder.resolve()), *files]


def key(cfg, model_name: str) -> str | None:
    """The key of ``model_name``'s classifier check under ``cfg`` (None: never remembered)."""
    files = _model_files(model_name)
    if files is None:
        return None
    placement = cfg.models.placement_of(model_name)
    return hashlib.sha256(json.dumps(
        [model_name, files, list(cfg.data.labels), cfg.models.label_descriptions, cfg.models.template, cfg.seed,
         str(placement.key() if placement else None), _code_digest()], sort_keys=True, default=str).encode()
    ).hexdigest()


def _path() -> Path | None:
    from .estimate import CACHE_ENV

    probe_cache = os.environ.get(CACHE_ENV)
    return Path(probe_cache).with_name("checks.json") if probe_cache else None


def passed(check_key: str | None) -> dict | None:
    """What a passed check with this key answered, or None."""
    from .estimate import read_cache

    path = _path()
    if check_key is None or path is None:
        return None
    hit = read_cache(path).get(check_key)
    return hit if isinstance(hit, dict) and "max_positions" in hit else None


def remember(check_key: str | None, answer: dict) -> None:
    """Keep a passed check's answer (beside the probe cache, written as it is)."""
    from .estimate import update_cache

    path = _path()
    if check_key is not None and path is not None:
        update_cache(path, check_key, answer)
