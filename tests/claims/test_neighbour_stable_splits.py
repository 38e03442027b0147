"""Splits are neighbour-stable (issue 24, item 3): every record's train / holdout / test assignment
and subsample membership comes from a keyed hash of that record alone, so adding or removing one
SOURCE record changes only that record's assignment, and the ε a run states for its partition
holds for neighbouring source datasets."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.config import DataConfig, parse_config
from tasks.data import partition_dataset, read_partition_split, read_public_texts


def _rows(prefix: str, n: int) -> list[dict]:
    return [{"text": f"{prefix} record {i} about item {i * 7 % 13}", "label": ["neg", "pos"][i % 2]} for i in range(n)]


def _write(folder: Path, train: list[dict], test: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    return folder


def _cfg(folder: Path, **kw) -> DataConfig:
    kw = {"train_fraction": 0.5, "holdout_fraction": 0.2, "test_fraction": 0.5, **kw}
    return DataConfig(name="toy", path=str(folder), labels=["neg", "pos"], **kw)


def _assignment(part, source_train: list[dict], source_test: list[dict]) -> dict[tuple[str, str], str]:
    """(split, text) -> where it went: train / holdout / unused (not subsampled), test / dropped."""
    train = set(read_partition_split(part.train_path)[0])
    hold = set(read_partition_split(part.holdout_path)[0])
    test = set(read_partition_split(part.test_path)[0])
    out = {}
    for r in source_train:
        t = r["text"]
        assert not (t in train and t in hold)
        out[("train", t)] = "train" if t in train else "holdout" if t in hold else "unused"
    for r in source_test:
        out[("test", r["text"])] = "test" if r["text"] in test else "dropped"
    return out


@pytest.fixture
def source():
    return _rows("train", 300), _rows("test", 80)


def test_adding_or_removing_one_record_changes_only_its_own_assignment(tmp_path, source):
    train, test = source
    private = tmp_path / "state" / "private"  # one installation: one secret for every partition below
    base = _write(tmp_path / "base", train, test)
    a = partition_dataset(_cfg(base), 0, private, None)
    before = _assignment(a, train, test)
    # every kind of assignment occurs, so the comparison below covers all of them
    assert set(before.values()) == {"train", "holdout", "unused", "test", "dropped"}

    # one record added to the train file (in the middle, shifting every later index) and one to the test file
    added = {"text": "a new record nobody has seen", "label": "pos"}
    added_test = {"text": "a new test record", "label": "neg"}
    grown = _write(tmp_path / "grown", train[:150] + [added] + train[150:], [added_test] + test)
    b = partition_dataset(_cfg(grown), 0, private, None)
    assert b.directory != a.directory  # another source: another partition, not the cached one
    after = _assignment(b, train + [added], test + [added_test])
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) == {("train", added["text"]), ("test", added_test["text"])}
    # the partitions differ by the added record alone
    n_new_train = after[("train", added["text"])] == "train"
    assert b.n_train == a.n_train + n_new_train
    assert b.n_holdout == a.n_holdout + (after[("train", added["text"])] == "holdout")
    assert b.n_test == a.n_test + (after[("test", added_test["text"])] == "test")

    # one record removed (the first training record, and the first test record kept)
    gone = train[0]
    shrunk = _write(tmp_path / "shrunk", train[1:], test[1:])
    c = partition_dataset(_cfg(shrunk), 0, private, None)
    after = _assignment(c, train[1:], test[1:])
    assert after == {k: v for k, v in before.items() if k not in {("train", gone["text"]), ("test", test[0]["text"])}}
    assert c.n_train == a.n_train - (before[("train", gone["text"])] == "train")


def test_same_folder_with_a_changed_source_repartitions_neighbour_stably(tmp_path, source):
    train, test = source
    folder = _write(tmp_path / "data", train, test)
    private = tmp_path / "state" / "private"
    a = partition_dataset(_cfg(folder), 0, private, None)
    before = _assignment(a, train, test)
    _write(folder, train + [{"text": "appended later", "label": "neg"}], test)  # the same file, changed
    b = partition_dataset(_cfg(folder), 0, private, None)
    assert b.directory != a.directory  # the cache key follows the source's signature
    after = _assignment(b, train, test)
    assert after == before


def test_the_row_order_is_keyed_not_seeded_and_stable_under_neighbours(tmp_path, source):
    train, test = source
    private = tmp_path / "state" / "private"
    base = _write(tmp_path / "base", train, test)
    a = partition_dataset(_cfg(base), 0, private, None)
    b = partition_dataset(_cfg(base), 7, private, None)  # another seed: the very same partition
    assert b.directory == a.directory and a.fingerprint == b.fingerprint
    rows = read_partition_split(a.train_path)[0]
    assert rows != sorted(rows) and rows != [r["text"] for r in train if r["text"] in set(rows)]  # not source order
    grown = _write(tmp_path / "grown", [{"text": "one more", "label": "neg"}] + train, test)
    rows_grown = [t for t in read_partition_split(partition_dataset(_cfg(grown), 0, private, None).train_path)[0]
                  if t != "one more"]
    assert rows_grown == rows  # the others keep their relative order


def test_assignment_is_keyed_by_the_installation_secret(tmp_path, source):
    train, test = source
    base = _write(tmp_path / "base", train, test)
    a = partition_dataset(_cfg(base), 0, tmp_path / "install-a" / "private", None)
    b = partition_dataset(_cfg(base), 0, tmp_path / "install-b" / "private", None)
    one, other = _assignment(a, train, test), _assignment(b, train, test)
    differ = sum(one[k] != other[k] for k in one)
    assert differ > len(one) // 4  # independent draws: about half of them differ
    # the same secret in a fresh state folder gives the same assignment
    fresh = tmp_path / "install-c"
    (fresh / "secrets").mkdir(parents=True)
    (fresh / "secrets" / "installation.key").write_bytes((tmp_path / "install-a" / "secrets" / "installation.key").read_bytes())
    c = partition_dataset(_cfg(base), 0, fresh / "private", None)
    assert _assignment(c, train, test) == one and c.fingerprint == a.fingerprint


def test_duplicates_land_together_and_whitespace_does_not_matter(tmp_path):
    train = _rows("train", 200)
    dup = {"text": "the very same review", "label": "pos"}
    spaced = {"text": "  the very   same review ", "label": "pos"}
    relabelled = {"text": "the very same review", "label": "neg"}
    folder = _write(tmp_path / "d", train + [dup, dup, spaced, relabelled], _rows("test", 20))
    part = partition_dataset(_cfg(folder, test_fraction=1.0), 0, tmp_path / "private", None)
    texts, labels = read_partition_split(part.train_path)
    hold_texts, hold_labels = read_partition_split(part.holdout_path)
    where = lambda text, label: ("train" if (text, label) in set(zip(texts, labels))  # noqa: E731
                                 else "holdout" if (text, label) in set(zip(hold_texts, hold_labels)) else "unused")
    assert where(dup["text"], "pos") == where(spaced["text"], "pos")  # normalised like the overlap guard
    pairs = list(zip(texts + hold_texts, labels + hold_labels))
    assert pairs.count((dup["text"], "pos")) in (0, 2)  # both copies in one split, or neither
    assert pairs.count((spaced["text"], "pos")) == (2 if pairs.count((dup["text"], "pos")) else 0) // 2
    assert part.n_test == 20


def test_fractions_hit_their_expected_sizes(tmp_path):
    train, test = _rows("train", 4000), _rows("test", 1000)
    folder = _write(tmp_path / "d", train, test)
    part = partition_dataset(_cfg(folder, train_fraction=0.3, holdout_fraction=0.1, test_fraction=0.25), 0,
                             tmp_path / "private", None)
    for size, rate, n in ((part.n_train, 0.3, 4000), (part.n_holdout, 0.1, 4000), (part.n_test, 0.25, 1000)):
        assert abs(size - rate * n) <= 5 * (rate * (1 - rate) * n) ** 0.5, (size, rate, n)  # p < 1e-6


def test_canaries_do_not_move_source_records_and_the_plan_predicts_n_train(tmp_path, source):
    from tasks.planning import released_sizes

    train, test = source
    folder = _write(tmp_path / "d", train, test)
    private = tmp_path / "state" / "private"
    raw = {"method": "prompt_dpsgd", "seed": 3, "models": {"local": "tiny-gpt2"},
           "data": {"name": "toy", "path": str(folder), "labels": ["neg", "pos"], "train_fraction": 0.5,
                    "holdout_fraction": 0.2, "canaries": 40}}
    cfg = parse_config(raw)
    planned = released_sizes(cfg, private)  # before any partition exists: computed, only the release written
    assert not (private / "partitions").exists() and len(list((private / "released-sizes").iterdir())) == 1
    part = partition_dataset(cfg.data, cfg.seed, private, None)
    assert planned == part.sizes == released_sizes(cfg, private)  # one draw: the plan's is the run's
    assert abs(part.sizes.n_train - part.n_train) <= 6 * part.sizes.sigma
    plain = partition_dataset(_cfg(folder, test_fraction=1.0), cfg.seed, private, None)
    canaries = pq.read_table(part.canaries_path).to_pylist()
    planted = {c["text"] for c in canaries if c["planted"]}
    assert 0 < len(planted) < 40 and part.n_canaries_planted == len(planted)
    with_canaries = set(read_partition_split(part.train_path)[0])
    assert with_canaries - planted == set(read_partition_split(plain.train_path)[0])
    # another seed draws other canaries (its own partition) but the same source records
    other = partition_dataset(parse_config({**raw, "seed": 4}).data, 4, private, None)
    assert other.directory != part.directory
    other_planted = {c["text"] for c in pq.read_table(other.canaries_path).to_pylist() if c["planted"]}
    assert set(read_partition_split(other.train_path)[0]) - other_planted == with_canaries - planted


def test_public_data_sharing_private_records_is_read_as_any_other(tmp_path, source):
    """A run's outcome never depends on which public texts are private records: no refusal, no count."""
    train, test = source
    private_src = _write(tmp_path / "private_src", train, test)
    cfg = DataConfig(name="toy", path=str(private_src), labels=["neg", "pos"])
    public = tmp_path / "public"
    public.mkdir()
    texts = ["an unrelated public text"] * 4 + [r["text"] for r in train[:3]]  # 3 of 7 are private records
    (public / "validation.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert read_public_texts("public", str(public), "validation", "text", None, tmp_path / "state" / "private",
                             private_source=(cfg, None)) == texts


def test_a_state_folder_that_joins_a_team_ledger_partitions_anew_under_the_team_key(tmp_path, source, monkeypatch):
    """A cached partition is keyed by the key that split it: a machine that partitioned a dataset
    under its own key and then joins a team ledger must name the dataset as every team machine
    does (a review charged one dataset twice, under the old and the team key, at 2 × the cap)."""
    train, test = source
    base = _write(tmp_path / "base", train, test)
    monkeypatch.delenv("PRIVPROMPT_LEDGER_URL", raising=False)
    alone = partition_dataset(_cfg(base), 0, tmp_path / "a" / "private", None)
    monkeypatch.setenv("PRIVPROMPT_LEDGER_URL", f"sqlite:///{tmp_path / 'team.sqlite'}")
    joined = partition_dataset(_cfg(base), 0, tmp_path / "a" / "private", None)
    # the team key is a's key file (never in the ledger): b joins the team by importing it
    from tasks.state import export_key, import_key, state_paths

    monkeypatch.delenv("PRIVPROMPT_TEAM_KEY_FILE", raising=False)
    export_key(state_paths(str(tmp_path / "a")), tmp_path / "team.key")
    import_key(state_paths(str(tmp_path / "b")), tmp_path / "team.key")
    fresh = partition_dataset(_cfg(base), 0, tmp_path / "b" / "private", None)
    assert joined.directory != alone.directory and joined.source_key != alone.source_key
    assert (joined.source_key, joined.fingerprint) == (fresh.source_key, fresh.fingerprint)
    assert _assignment(joined, train, test) == _assignment(fresh, train, test)
