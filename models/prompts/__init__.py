"""Prompt kinds and their one save/load door (the kind is recorded in the file's metadata).

* ``soft``: a (n_tokens, embed_dim) tensor prepended to the input embeddings (``models.soft_prompt``);
* ``prefix``: (layers, 2, n_tokens, d_kv) keys and values for every attention layer (``models.prompts.prefix``);
* ``text``: a discrete instruction placed before the input by the template (DP-OPT's output);
* ``lora``: low-rank updates of the frozen model's linear layers (``models.prompts.lora``).
"""

from __future__ import annotations

import json
from pathlib import Path

from models.prompts.text import TextPrompt

KINDS = ("soft", "prefix", "text", "lora")


def prompt_kind(prompt) -> str:
    from models.prompts.prefix import is_prefix

    return "prefix" if is_prefix(prompt) else getattr(prompt, "kind", "soft")


def save_prompt_artifact(path: str | Path, prompt, metadata: dict | None = None) -> Path:
    """Write ``prompt`` with ``kind`` in its metadata: text prompts as JSON, tensors as safetensors."""
    path = Path(path)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta["kind"] = prompt_kind(prompt)
    if meta["kind"] == "text":
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"kind": "text", "instruction": prompt.instruction, "metadata": meta}, indent=1))
        tmp.replace(path)
        return path
    if meta["kind"] == "lora":
        from models.prompts.lora import save_lora

        path.parent.mkdir(parents=True, exist_ok=True)
        save_lora(path, prompt, meta)
        return path
    from models.soft_prompt import save_prompt

    return save_prompt(path, prompt, meta)


def load_prompt_artifact(path: str | Path):
    """(prompt, metadata) of a file written by :func:`save_prompt_artifact`; a safetensors file
    without ``kind`` (written before kinds existed) is a soft prompt."""
    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if data.get("kind") != "text" or not isinstance(data.get("instruction"), str):
            raise ValueError(f"{path} is not a text prompt artifact")
        return TextPrompt(data["instruction"]), data.get("metadata", {})
    from models.soft_prompt import load_prompt

    tensor, meta = load_prompt(path)
    kind = meta.get("kind", "soft")
    if kind == "lora":
        from models.prompts.lora import from_file

        return from_file(tensor, meta), meta
    expected_dims = {"soft": 2, "prefix": 4}
    if kind not in expected_dims:
        raise ValueError(f"{path}: prompt kind {kind!r} is not supported here (known: {KINDS})")
    if tensor.dim() != expected_dims[kind]:
        raise ValueError(f"{path}: a {kind} prompt of shape {tuple(tensor.shape)}")
    return tensor, meta
