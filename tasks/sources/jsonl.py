"""JSON lines (``.jsonl``, or ``.json`` holding one object per line)."""

from __future__ import annotations

import json

from ..errors import DataError
from . import DataSource, register_source


@register_source
class JsonLines(DataSource):
    name = "jsonl"
    suffixes = (".jsonl", ".json")
    precedence = 0

    def read_file(self, path):
        rows = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"malformed JSON in {path} line {lineno}: {err.msg}") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path} line {lineno}: expected a JSON object per line")
                rows.append(row)
        return rows
