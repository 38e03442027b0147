"""The config reference, generated from the pydantic schema (``tasks/config.py`` + ``tasks/schema.py``
+ each method's block): ``privprompt config --schema`` prints it as Markdown, ``docs/config.md``
is this text committed (``tests/test_config_reference.py`` regenerates and compares), and the
"did you mean" hints of unknown config keys come from the same walk over the schema."""

from __future__ import annotations

import difflib
import json
import types
import typing
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """# Config reference

Generated from the pydantic schema by `privprompt config --schema` (do not edit by hand:
`tests/test_config_reference.py` fails when this file and the schema disagree; regenerate with
`.venv/bin/privprompt config --schema > docs/config.md`). Unknown keys are errors, with a
"did you mean" hint. Every key can be set on the command line: `--set dotted.key=value`.
For your own data see the README's "Bring your own data".
"""


def _schema_root() -> type[BaseModel]:
    from . import config

    return config.PrivPromptConfig


def _block_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The config block inside an annotation (``X``, ``X | None``, ``list[X]``) and whether it is a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        blocks = [b for b in (_block_of(a) for a in args if a is not type(None)) if b[0] is not None]
        return blocks[0] if len(blocks) == 1 else (None, False)
    if origin is list and args:
        inner, _ = _block_of(args[0])
        return inner, inner is not None
    return None, False


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


def _fields(block: type[BaseModel]) -> list[tuple[str, Any]]:
    """A block's fields in schema order; the ``methods:`` block's entries (one per registered
    method, validated against its block at parse time) by name: the registry's order may change."""
    from .config import MethodsConfig, method_blocks

    if block is MethodsConfig:
        from pydantic import Field
        from pydantic.fields import FieldInfo

        return sorted((name, FieldInfo.from_annotated_attribute(cls, Field(default_factory=cls)))
                      for name, cls in method_blocks().items())
    return list(block.model_fields.items())


def walk(model: type[BaseModel] | None = None, prefix: str = "") -> Iterator[tuple[str, Any, type[BaseModel] | None]]:
    """Every key of the schema, depth first: (dotted key, field, the block it opens or None).
    A list of blocks (``models.endpoints``) appears as ``key[]`` with its block's keys under it."""
    model = model or _schema_root()
    for name, field in _fields(model):
        key = f"{prefix}{name}"
        block, is_list = _block_of(field.annotation)
        yield key, field, block
        if block is not None:
            yield from walk(block, f"{key}[]." if is_list else f"{key}.")


def _doc(block: type[BaseModel]) -> str:
    doc = (block.__doc__ or "").strip()
    if not doc or doc.startswith(("Base of every", "A base class")) or block.__module__.startswith("pydantic"):
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown() -> str:
    """The reference: one table per block (top level first), a row per key."""
    root = _schema_root()
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


def all_keys() -> list[str]:
    """Every dotted key of the schema (list items as ``key[]``)."""
    return [key for key, _, _ in walk()]


def _block_at(loc: tuple) -> type[BaseModel] | None:
    """The block a validation error location's last element was looked up in."""
    block = _schema_root()
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = dict(_fields(block)).get(part)
        if field is None:
            return None
        block, _ = _block_of(field.annotation)
        if block is None:
            return None
    return block


def did_you_mean(loc: tuple) -> str:
    """A hint for an unknown key at ``loc`` (a pydantic error location): the closest keys of the
    same block (difflib), else a block elsewhere that has a key of that name. '' when none."""
    if not loc or not isinstance(loc[-1], str):
        return ""
    name = loc[-1]
    prefix = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
    block = _block_at(loc)
    if block is not None:
        close = difflib.get_close_matches(name, [key for key, _ in _fields(block)], n=2, cutoff=0.6)
        if close:
            return "did you mean " + " or ".join(f"'{prefix + '.' if prefix else ''}{c}'" for c in close) + "?"
    elsewhere = [k.replace("[]", "") for k in all_keys() if k.rsplit(".", 1)[-1] == name]
    if elsewhere:
        return "did you mean " + " or ".join(f"'{k}'" for k in elsewhere[:3]) + " (a key of another block)?"
    leaves = {k.rsplit(".", 1)[-1]: k.replace("[]", "") for k in all_keys()}
    close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.75)
    return f"did you mean '{leaves[close[0]]}'?" if close else ""
