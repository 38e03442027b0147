"""Attacks on the data layer (issue 14): keyed fingerprints, a public-data guard that the private
source cannot pass under any name, and errors that never echo a record."""

import json
import shutil
from pathlib import Path

import pytest

from tasks.config import DataConfig
from tasks.data import fingerprint, partition_dataset, read_public_texts
from tasks.errors import DataError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
SECRET_TEXT = "zqxv private review of the heliotrope wombat 4471"


def _write(folder: Path, rows: list[dict], test_rows: list[dict] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (test_rows or rows[:4])))
    return folder


def _rows(n=40):
    return [{"text": f"review number {i} was {'great' if i % 2 else 'awful'}", "label": "pos" if i % 2 else "neg"}
            for i in range(n)]


def test_fingerprint_is_keyed_a_known_record_guess_cannot_be_confirmed():
    texts, labels = ["a", "b"], ["neg", "pos"]
    k1, k2 = b"1" * 32, b"2" * 32
    assert fingerprint(texts, labels, k1) == fingerprint(texts, labels, k1) != fingerprint(texts, labels, k2)
    # without the key, recomputing the unkeyed hash of a guess matches nothing
    import hashlib

    plain = hashlib.sha256(b"a\x1fneg\x1eb\x1fpos\x1e").hexdigest()
    assert plain != fingerprint(texts, labels, k1)


def test_two_installations_give_different_fingerprints(tmp_path):
    data = _write(tmp_path / "data", _rows())
    # 40 records split by a fresh secret: holdout_fraction 0.5 leaves no split empty but with p ~ 1e-12
    cfg = DataConfig(name="toy", path=str(data), labels=["neg", "pos"], holdout_fraction=0.5)
    a = partition_dataset(cfg, 0, tmp_path / "install-a" / "private", None)
    b = partition_dataset(cfg, 0, tmp_path / "install-b" / "private", None)
    assert a.fingerprint != b.fingerprint and a.dataset_key != b.dataset_key
    key = tmp_path / "install-a" / "secrets" / "installation.key"
    assert key.stat().st_mode & 0o077 == 0 and len(key.read_bytes()) == 32


def test_public_guard_refuses_the_private_source_under_any_name(tmp_path):
    private_dir = tmp_path / "state" / "private"
    data = _write(tmp_path / "sst2", _rows())
    cfg = DataConfig(name="sst2", path=str(data), labels=["neg", "pos"])
    # the same file under another folder name
    copy = tmp_path / "definitely_public"
    copy.mkdir()
    shutil.copy(data / "train.jsonl", copy / "validation.jsonl")
    with pytest.raises(DataError, match="is the private dataset 'sst2'"):
        read_public_texts("definitely_public", None, "validation", "text", str(tmp_path), private_dir,
                          private_source=(cfg, None))
    # the file itself, named as public
    with pytest.raises(DataError, match="private dataset 'sst2'"):
        read_public_texts("sst2", None, "train", "text", str(tmp_path), private_dir, private_source=(cfg, None))
    # a public set sharing a single private record (reformatted whitespace) is refused, with no text and
    # no count (a count would tell whoever writes the public file how many of its guesses are members)
    mixed = _write(tmp_path / "mixed", [{"text": "an unrelated public tweet"}, {"text": "  review number 3 was   great"}])
    with pytest.raises(DataError, match="some of its texts are private records") as err:
        read_public_texts("mixed", str(mixed), "train", "text", None, private_dir, private_source=(cfg, None))
    message = str(err.value).replace(str(tmp_path), "").replace("'sst2'", "")
    assert "review number" not in message and not any(ch.isdigit() for ch in message), message
    # disjoint public data passes
    clean = _write(tmp_path / "clean", [{"text": "an unrelated public tweet"}, {"text": "another one"}])
    assert read_public_texts("clean", str(clean), "train", "text", None, private_dir,
                             private_source=(cfg, None)) == ["an unrelated public tweet", "another one"]


@pytest.mark.skipif(not (SHARED / "sst2").is_dir(), reason="../shared/data is not available")
def test_public_guard_refuses_sst2_train_as_public(tmp_path):
    cfg = DataConfig(name="sst2", path=str(SHARED / "sst2"), labels=["negative", "positive"])
    with pytest.raises(DataError, match="private dataset 'sst2'"):
        read_public_texts("sst2", None, "train", "text", str(SHARED), tmp_path / "private",
                          private_source=(cfg, None))


def test_validation_errors_name_file_record_and_field_never_the_value(tmp_path):
    rows = [{"text": "fine", "label": "pos"}, {"text": "x", "label": SECRET_TEXT}]
    data = _write(tmp_path / "d", rows, [{"text": "t", "label": "neg"}])
    cfg = DataConfig(name="toy", path=str(data), labels=["neg", "pos"])
    with pytest.raises(DataError) as err:
        partition_dataset(cfg, 0, tmp_path / "private", None)
    message = str(err.value)
    assert "train.jsonl record 2" in message and "field 'label'" in message
    assert SECRET_TEXT not in message and "wombat" not in message
    # a mis-set label_field that points at the text column
    cfg = DataConfig(name="toy", path=str(data), labels=["neg", "pos"], label_field="text")
    with pytest.raises(DataError) as err:
        partition_dataset(cfg, 0, tmp_path / "private2", None)
    assert "record 1" in str(err.value) and "fine" not in str(err.value).replace(str(tmp_path), "")
