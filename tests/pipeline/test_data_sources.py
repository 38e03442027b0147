"""Data sources are a registry, like the methods (issue 36: tasks/sources/, one module per file
format or source): a toy file format registered here, in tests/ (no project file edited), is read and
partitioned by the data loading exactly as the same records in a built-in format; the built-ins keep
which file is a split; unknown names and formats are one line listing the registered ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks import sources
from tasks.config import DataConfig
from tasks.data import find_split_file, partition_dataset, read_split
from tasks.errors import DataError

LABELS = ["neg", "pos"]


def _rows(tag: str, n: int) -> list[dict]:
    return [{"text": f"{tag} example {i}: a {('dull', 'bright', 'odd')[i % 3]} film", "label": LABELS[i % 2]}
            for i in range(n)]


class ToyTsv(sources.DataSource):
    """Tab-separated values with a header row: the format a test adds."""

    name = "toy_tsv"
    suffixes = (".tsv",)

    def read_file(self, path):
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line]
        if not lines:
            return []
        head = lines[0].split("\t")
        return [dict(zip(head, line.split("\t"))) for line in lines[1:]]


@pytest.fixture
def toy_tsv():
    sources.register_source(ToyTsv)
    yield ToyTsv
    sources.unregister_source("toy_tsv")


def _write_tsv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("text\tlabel\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in rows), encoding="utf-8")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _cfg(folder: Path, **kw) -> DataConfig:
    return DataConfig(name="toy", path=str(folder), labels=LABELS, **kw)


# ---- data sources ---------------------------------------------------------------------------------

def test_the_built_in_sources_are_registered_in_their_modules():
    assert {"jsonl", "csv", "parquet", "hub"} <= set(sources.registered_sources())
    # the order that decides which file is a split when a folder holds it in two formats, as always
    assert sources.file_suffixes()[:4] == (".jsonl", ".json", ".csv", ".parquet")
    assert sources.get_source("hub").suffixes == () and sources.get_source("csv").suffixes == (".csv",)


def test_a_file_format_registered_by_a_test_is_read_and_partitioned(toy_tsv, tmp_path):
    tsv, jsonl = tmp_path / "tsv", tmp_path / "jsonl"
    train, test = _rows("train", 120), _rows("test", 30)
    _write_tsv(tsv / "train.tsv", train)
    _write_tsv(tsv / "test.tsv", test)
    _write_jsonl(jsonl / "train.jsonl", train)
    _write_jsonl(jsonl / "test.jsonl", test)
    assert find_split_file(tsv, "train") == tsv / "train.tsv"
    texts, labels = read_split(_cfg(tsv), None, "train")
    assert texts == [r["text"] for r in train] and labels == [r["label"] for r in train]
    a = partition_dataset(_cfg(tsv), 0, tmp_path / "private", None)
    b = partition_dataset(_cfg(jsonl), 0, tmp_path / "private", None)
    assert a.directory != b.directory  # another source file: another partition folder
    # the same records in another format: the same dataset for the ledger, split the same way
    assert a.source_key == b.source_key and a.fingerprint == b.fingerprint
    assert (a.n_train, a.n_holdout, a.n_test) == (b.n_train, b.n_holdout, b.n_test) and a.n_test > 0


def test_a_registered_format_does_not_change_which_file_is_the_split(toy_tsv, tmp_path):
    folder = tmp_path / "both"
    _write_jsonl(folder / "train.jsonl", _rows("jsonl", 4))
    _write_tsv(folder / "train.tsv", _rows("tsv", 4))
    (folder / "train.csv").write_text("text,label\nx,neg\n")
    assert find_split_file(folder, "train") == folder / "train.jsonl"  # precedence: the built-ins first


def test_unknown_sources_and_formats_are_one_line_listing_the_registered_ones(toy_tsv, tmp_path):
    with pytest.raises(KeyError) as err:
        sources.get_source("xlsx")
    message = err.value.args[0]
    assert "\n" not in message and message.startswith("unknown data source 'xlsx'; registered data sources:")
    assert all(name in message for name in ("jsonl", "csv", "parquet", "hub", "toy_tsv"))
    with pytest.raises(DataError, match=r"^unsupported data file format '\.xlsx' .*; use \.jsonl, \.json, \.csv, "
                                        r"\.parquet, \.tsv$"):
        sources.read_file(tmp_path / "train.xlsx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^no 'train' file \(\.jsonl/\.json/\.csv/\.parquet/\.tsv\) in data folder"):
        find_split_file(tmp_path / "empty", "train")


def test_a_bad_registration_is_refused(toy_tsv):
    class Clash(sources.DataSource):
        name = "other_tsv"
        suffixes = (".tsv",)

    with pytest.raises(ValueError, match="file suffix '.tsv' is already read by data source 'toy_tsv'"):
        sources.register_source(Clash)

    class Named(sources.DataSource):
        name = "csv"

    with pytest.raises(ValueError, match="data source 'csv' is already registered"):
        sources.register_source(Named)
    assert "other_tsv" not in sources.registered_sources()


def test_a_format_that_cannot_parse_a_file_says_so_without_its_content(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "train.parquet").write_bytes(b"secret text, not parquet")
    with pytest.raises(DataError) as err:
        sources.read_file(folder / "train.parquet")
    assert str(err.value) == f"cannot read {folder / 'train.parquet'}: malformed parquet (ArrowInvalid)"
