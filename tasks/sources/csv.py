"""Comma-separated values with a header row (``.csv``)."""

from __future__ import annotations

import csv

from . import DataSource, malformed, register_source


@register_source
class Csv(DataSource):
    name = "csv"
    suffixes = (".csv",)
    precedence = 1

    def read_file(self, path):
        try:
            with path.open(encoding="utf-8", newline="") as fh:
                return list(csv.DictReader(fh))
        except csv.Error as err:  # its message may quote the file's content
            raise malformed(path, err) from None
