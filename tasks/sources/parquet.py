"""Apache Parquet (``.parquet``)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from . import DataSource, malformed, register_source


@register_source
class Parquet(DataSource):
    name = "parquet"
    suffixes = (".parquet",)
    precedence = 2

    def read_file(self, path):
        try:
            return pq.read_table(path).to_pylist()
        except OSError:  # cannot be read at all: the registry's line (tasks.sources.read_file)
            raise
        except pa.ArrowException as err:  # its message may quote the file's content
            raise malformed(path, err) from None
