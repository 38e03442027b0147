"""The config reference, generated from the pydantic schema (``tasks/config.py`` + ``tasks/schema.py``
+ each method's block): ``privprompt config --schema`` prints it as Markdown, ``docs/config.md``
is this text committed (``tests/pipeline/test_config_reference.py`` regenerates and compares), and the
"did you mean" hints of unknown config keys come from the same walk over the schema."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .config import (PrivPromptConfig, _block_of, _fields, all_keys,  # noqa: F401  (the schema's keys)
                     did_you_mean, walk)

HEADER = """# Config reference

Generated from the pydantic schema by `privprompt config --schema` (do not edit by hand:
`tests/pipeline/test_config_reference.py` fails when this file and the schema disagree; regenerate with
`.venv/bin/privprompt config --schema > docs/config.md`). Unknown keys are errors, with a
"did you mean" hint. Every key can be set on the command line: `--set dotted.key=value`.
For your own data see docs/own-data.md (the README's first screen has a 5-step example).
"""


def type_name(annotation: Any) -> str:
    """A short, readable type: ``float | null``, ``list[str]``, ``one of 'loss', 'lira'``."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return "block" if issubclass(annotation, BaseModel) else annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict, tuple, set):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


def _constraints(field) -> str:
    names = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "at least", "max_length": "at most"}
    out = []
    for meta in field.metadata:
        for attr, sign in names.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sign} {value}" + (" items" if "length" in attr else ""))
    return ", ".join(out)


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that needs the validated data
            return "computed"
    else:
        value = field.default
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "(block)"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _doc(block: type[BaseModel]) -> str:
    doc = (block.__doc__ or "").strip()
    if not doc or doc.startswith(("Base of every", "A base class")) or block.__module__.startswith("pydantic"):
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown() -> str:
    """The reference: one table per block (top level first), a row per key."""
    root = PrivPromptConfig
    sections: list[tuple[str, type[BaseModel], str]] = [("", root, "Top-level keys.")]
    for key, field, block in walk(root):
        if block is not None:
            sections.append((key + ("[]" if _block_of(field.annotation)[1] else ""), block,
                             _cell(field.description or _doc(block))))
    out = [HEADER]
    for key, block, about in sections:
        title = f"`{key}`" if key else "top level"
        out.append(f"\n## {title}\n")
        if about:
            out.append(f"{about}\n")
        if key.startswith("methods.") and key.count(".") == 1:
            out.append(f"Settings of method `{key.split('.', 1)[1]}` (used when it is `method:` or enabled as a "
                       "baseline).\n")
        out.append("\n| key | type | default | constraints | description |\n|---|---|---|---|---|\n")
        for name, field in _fields(block):
            sub, is_list = _block_of(field.annotation)
            dotted = f"{key}.{name}" if key else name
            desc = field.description or ""
            if sub is not None:
                desc = (desc + " " if desc else "") + f"(see `{dotted}{'[]' if is_list else ''}`)"
            out.append(f"| `{dotted}` | {_cell(type_name(field.annotation))} | {_default(field)} | "
                       f"{_cell(_constraints(field))} | {_cell(desc)} |\n")
    return "".join(out)
