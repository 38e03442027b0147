"""Saving and loading published / private prompts of every kind through one door, so evaluation,
MIA and the audit take any kind (soft prompt tensors, prefixes, text prompts)."""

from __future__ import annotations

from pathlib import Path


def prompt_suffix(prompt) -> str:
    kind = getattr(prompt, "kind", "soft")
    return ".json" if kind == "text" else ".safetensors"


def save_prompt_file(directory: Path, stem: str, prompt, metadata: dict) -> Path:
    """Write ``prompt`` as ``<directory>/<stem>.<ext>`` (the extension follows the kind)."""
    from models.prompts import save_prompt_artifact

    return save_prompt_artifact(Path(directory) / f"{stem}{prompt_suffix(prompt)}", prompt, metadata)


def load_prompt_file(path: str | None):
    """The prompt stored at ``path`` (None: no prompt)."""
    if path is None:
        return None
    from models.prompts import load_prompt_artifact

    return load_prompt_artifact(path)[0]
