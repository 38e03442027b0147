"""Attacks on the data layer: keyed fingerprints, a public-data guard that answers from declared
paths alone (never a membership oracle), and errors that never echo a record."""

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


def test_public_guard_refuses_by_declared_path_never_by_content(tmp_path):
    """The run's guard refuses public data the config itself names as private (the file, or its
    folder): a function of paths. What a public file holds never changes a run's outcome: a public
    file with one private record, or a copy of the private file elsewhere, is read like any other
    (a refusal there answered "is this sentence in the private source?" with certainty)."""
    from tasks.config import parse_config
    from tasks.data import public_overlap

    private_dir = tmp_path / "state" / "private"
    data = _write(tmp_path / "sst2", _rows())
    cfg = DataConfig(name="sst2", path=str(data), labels=["neg", "pos"])
    with pytest.raises(DataError, match="private dataset 'sst2'"):  # the file itself, named as public
        read_public_texts("sst2", None, "train", "text", str(tmp_path), private_dir, private_source=(cfg, None))
    (data / "validation.jsonl").write_text(json.dumps({"text": "in the private folder"}) + "\n")
    with pytest.raises(DataError, match="in the private dataset 'sst2'.s folder"):
        read_public_texts("sst2", None, "validation", "text", str(tmp_path), private_dir, private_source=(cfg, None))
    copy = tmp_path / "definitely_public"
    copy.mkdir()
    shutil.copy(data / "train.jsonl", copy / "validation.jsonl")
    member, outsider = "  review number 3 was   great", "review number 3 was greet"
    outcomes = []
    for name, rows in (("member", [{"text": "an unrelated public tweet"}, {"text": member}]),
                       ("outsider", [{"text": "an unrelated public tweet"}, {"text": outsider}])):
        folder = _write(tmp_path / name, rows)
        outcomes.append(read_public_texts(name, str(folder), "train", "text", None, private_dir,
                                          private_source=(cfg, None)))
    assert outcomes == [["an unrelated public tweet", member], ["an unrelated public tweet", outsider]]
    assert len(read_public_texts("definitely_public", None, "validation", "text", str(tmp_path), private_dir,
                                 private_source=(cfg, None))) == 40
    # the operator's own check (privprompt check-public) counts what the run does not look at
    raw = {"method": "prompt_dpsgd", "data": {"name": "sst2", "path": str(data), "labels": ["neg", "pos"]},
           "models": {"local": "tiny-bert"}}
    assert public_overlap(parse_config({**raw, "public": {"name": "member", "path": str(tmp_path / "member"),
                                                          "split": "train"}})) == (2, 1)
    assert public_overlap(parse_config({**raw, "public": {"name": "outsider", "path": str(tmp_path / "outsider"),
                                                          "split": "train"}})) == (2, 0)


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
