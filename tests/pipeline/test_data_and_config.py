"""Partitioning (determinism, disjointness, bad input) and the config schema's errors."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.config import DataConfig, apply_overrides, load_config, parse_config
from tasks.data import partition_dataset, read_partition_split
from tasks.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]


def _write_jsonl(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def toy(tmp_path):
    folder = tmp_path / "toy"
    _write_jsonl(folder / "train.jsonl", [{"text": f"train example {i}", "label": ["neg", "pos"][i % 2]}
                                          for i in range(200)])
    _write_jsonl(folder / "test.jsonl", [{"text": f"test example {i}", "label": ["neg", "pos"][i % 2]}
                                         for i in range(40)])
    return folder


def _cfg(folder, **kw):
    return DataConfig(name="toy", path=str(folder), labels=["neg", "pos"], **kw)


def test_partition_is_deterministic_keyed_and_disjoint(toy, tmp_path):
    # p1, p2, p3 are private folders of one installation (one state folder: one secret)
    a = partition_dataset(_cfg(toy, train_fraction=0.6), 3, tmp_path / "p1", None)
    b = partition_dataset(_cfg(toy, train_fraction=0.6), 3, tmp_path / "p2", None)
    c = partition_dataset(_cfg(toy, train_fraction=0.6), 4, tmp_path / "p3", None)
    # the split is by keyed hash, not by seed: another seed gives the same partition
    assert a.fingerprint == b.fingerprint == c.fingerprint
    # the ledger's key is the SOURCE dataset's: the same for every seed and subsample
    assert a.dataset_key == b.dataset_key == c.dataset_key
    # another installation (another secret): other fingerprints for the same data
    other = partition_dataset(_cfg(toy, train_fraction=0.6), 3, tmp_path / "elsewhere" / "private", None)
    assert other.fingerprint != a.fingerprint and other.dataset_key != a.dataset_key
    train, _ = read_partition_split(a.train_path)
    hold, _ = read_partition_split(a.holdout_path)
    test, _ = read_partition_split(a.test_path)
    # expected 120 train (0.6 × 200, sd 6.9) and 20 holdout (0.1 × 200, sd 4.2): binomial, within 4.3 sd
    assert len(train) == a.n_train and 90 <= a.n_train <= 150
    assert len(hold) == a.n_holdout and 2 <= a.n_holdout <= 38 and len(test) == a.n_test == 40
    assert not set(train) & set(hold)
    assert not (set(train) | set(hold)) & set(test)
    assert read_partition_split(b.train_path) == (train, read_partition_split(a.train_path)[1])
    # without train_fraction every record not held out trains
    full = partition_dataset(_cfg(toy), 0, tmp_path / "p1", None)
    assert full.n_train + full.n_holdout == 200 and set(hold) == set(read_partition_split(full.holdout_path)[0])


def test_partition_reuses_existing_and_writes_atomically(toy, tmp_path):
    a = partition_dataset(_cfg(toy), 0, tmp_path / "p", None)
    stamp = Path(a.directory, "manifest.json").stat().st_mtime_ns
    again = partition_dataset(_cfg(toy), 0, tmp_path / "p", None)
    assert again == a and Path(a.directory, "manifest.json").stat().st_mtime_ns == stamp
    leftovers = [p for p in (tmp_path / "p" / "partitions").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_canaries_planted_with_probability_half(toy, tmp_path):
    part = partition_dataset(_cfg(toy, canaries=400), 0, tmp_path / "p", None)
    canaries = pq.read_table(part.canaries_path).to_pylist()
    planted = [c["text"] for c in canaries if c["planted"]]
    assert 150 < len(planted) < 250 and part.n_canaries_planted == len(planted)
    train, _ = read_partition_split(part.train_path)
    assert set(planted) <= set(train)
    assert not {c["text"] for c in canaries if not c["planted"]} & set(train)


def test_real_sst2_partition(sst2_dir, tmp_path):
    # SST-2 has 67,349 training and 1,821 test records (this fixture may be a smaller sample)
    cfg = DataConfig(name="sst2", path=str(sst2_dir), labels=["negative", "positive"], train_fraction=0.5,
                     holdout_fraction=0.05, test_fraction=0.5)
    part = partition_dataset(cfg, 0, tmp_path / "private", None)
    n = sum(1 for line in (sst2_dir / "train.jsonl").open() if line.strip())
    n_test = sum(1 for line in (sst2_dir / "test.jsonl").open() if line.strip())
    for size, rate, total in ((part.n_train, 0.5, n), (part.n_holdout, 0.05, n), (part.n_test, 0.5, n_test)):
        sd = (rate * (1 - rate) * total) ** 0.5
        assert abs(size - rate * total) <= 5 * sd + 1, (size, rate, total)
    _, labels = read_partition_split(part.train_path)
    assert set(labels) == {"negative", "positive"}


@pytest.mark.parametrize("content,needle", [
    ('{"text": "a", "label": "neg"}\n{"text": "b", "label": \n', "malformed JSON in .*line 2"),
    ('{"text": "a", "label": "neutral"}\n', "record 1: unknown label in field 'label'"),
    ('', "is empty"),
    ('{"text": "a"}\n', "missing field 'label'"),
])
def test_bad_training_file(tmp_path, content, needle):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "train.jsonl").write_text(content)
    _write_jsonl(folder / "test.jsonl", [{"text": "t", "label": "neg"}])
    with pytest.raises(DataError, match=needle):
        partition_dataset(_cfg(folder), 0, tmp_path / "p", None)
    assert not (tmp_path / "p" / "partitions").exists() or not any((tmp_path / "p" / "partitions").iterdir())


def test_missing_folder_and_file(tmp_path, toy):
    with pytest.raises(DataError, match="data folder not found"):
        partition_dataset(_cfg(tmp_path / "nope"), 0, tmp_path / "p", None)
    (toy / "test.jsonl").unlink()
    with pytest.raises(DataError, match="no 'test' file"):
        partition_dataset(_cfg(toy), 0, tmp_path / "p", None)


def test_exactly_empty_training_or_holdout_splits_are_partitioned_test_split_refused(toy, tmp_path):
    """200 records at rate 1e-6: an EXACTLY empty training or holdout split is partitioned like any
    other (its released size is noise, floored at 1): refusing it on the exact count, before any
    release, was a 0-vs-1 test of one record outside ε (review 6, F5). The test split is evaluation
    data outside ε: an empty one is still refused, and nothing is half-written."""
    hold = partition_dataset(_cfg(toy, holdout_fraction=1e-6), 0, tmp_path / "p", None)
    assert hold.n_holdout == 0 and read_partition_split(hold.holdout_path) == ([], [])
    assert hold.sizes.n_holdout >= 1 and hold.n_train == 200
    train = partition_dataset(_cfg(toy, train_fraction=1e-6), 0, tmp_path / "p", None)
    assert train.n_train == 0 and read_partition_split(train.train_path) == ([], []) and train.sizes.n_train >= 1
    before = set((tmp_path / "p" / "partitions").iterdir())
    with pytest.raises(DataError, match="test split is empty; raise data.test_fraction"):
        partition_dataset(_cfg(toy, test_fraction=1e-6), 0, tmp_path / "p", None)
    assert set((tmp_path / "p" / "partitions").iterdir()) == before  # nothing half-written


@pytest.mark.parametrize("kw,needle", [
    ({"train_size": 120}, "data.train_size is no longer accepted.*Use data.train_fraction"),
    ({"test_size": 100}, "data.test_size is no longer accepted.*Use data.test_fraction"),
    ({"train_fraction": 0.95}, r"holdout_fraction \(0.1\) \+ data.train_fraction \(0.95\) exceed 1"),
    ({"train_fraction": 0}, "train_fraction"),
    ({"test_fraction": 1.5}, "test_fraction"),
])
def test_split_settings_errors(kw, needle):
    raw = {"method": "prompt_dpsgd", "data": {"name": "toy", "labels": ["neg", "pos"], **kw},
           "models": {"local": "tiny-gpt2"}}
    with pytest.raises(ConfigError, match=needle):
        parse_config(raw)


def test_csv_and_parquet_inputs(tmp_path):
    import pyarrow as pa

    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "train.csv").write_text("text,label\n" + "".join(f"row {i},{['neg', 'pos'][i % 2]}\n" for i in range(30)))
    pq.write_table(pa.table({"text": ["t1", "t2"], "label": ["neg", "pos"]}), folder / "test.parquet")
    # 30 records: at holdout_fraction 0.5 an empty split has probability 2 × 0.5^30 (0.1 would give 4%)
    part = partition_dataset(_cfg(folder, holdout_fraction=0.5), 0, tmp_path / "p", None)
    assert part.n_train + part.n_holdout == 30 and part.n_test == 2


# ---- config ----------------------------------------------------------------------------------

def test_shipped_configs_validate():
    for name in ("quickstart.yaml", "smoke.yaml"):
        cfg = load_config(REPO / "configs" / name)
        assert cfg.method == "prompt_dpsgd" and cfg.privacy.target_epsilon == 8.0


def test_overrides_reach_the_documented_keys():
    raw = {"data": {"name": "sst2", "labels": ["a", "b"]}, "models": {"local": "minilm"}}
    cfg = parse_config(apply_overrides(raw, [
        "privacy.target_epsilon=2.5", "privacy.target_delta=1e-6", "privacy.dataset_epsilon_cap=9",
        "models.local=tiny-bert", "models.target=tiny-bert", "seed=7"]))
    assert (cfg.privacy.target_epsilon, cfg.privacy.target_delta, cfg.privacy.dataset_epsilon_cap) == (2.5, 1e-6, 9)
    assert (cfg.models.local, cfg.models.target_name, cfg.seed) == ("tiny-bert", "tiny-bert", 7)


BASE = {"data": {"name": "sst2", "labels": ["a", "b"]}, "models": {"local": "minilm"}}


@pytest.mark.parametrize("override,needle", [
    ("privacy.target_epsilon=0", "privacy.target_epsilon: .*must be > 0"),
    ("privacy.target_epsilon=-1", "privacy.target_epsilon"),
    ("privacy.target_delta=1.5", "privacy.target_delta: .*must lie in \\(0, 1\\)"),
    ("privacy.target_delta=0", "privacy.target_delta"),
    ("privacy.epsilon=3", "privacy.epsilon: unknown config key"),
    ("models.bogus=1", "models.bogus: unknown config key"),
    ("methods.prompt_sgd.enabled=true", "allow_nonprivate_baselines"),
])
def test_config_errors_name_the_key(override, needle):
    import copy

    with pytest.raises(ConfigError, match=needle):
        parse_config(apply_overrides(copy.deepcopy(BASE), [override]))


def test_missing_required_key_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="models: required key is missing"):
        parse_config({"data": BASE["data"]})
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["novalue"])


def test_sweep_variants_are_validated_up_front():
    from tasks.config import sweep_variants
    from tasks.method_checks import guarantee_of

    raw = {"data": {"name": "sst2", "labels": ["a", "b"]}, "models": {"local": "minilm"},
           "allow_nonprivate_baselines": True,
           "sweep": [{"method": "prompt_sgd"}, {"privacy.target_epsilon": 1.0, "seed": 3}]}
    (l1, v1), (l2, v2) = sweep_variants(parse_config(raw))
    assert (v1.method, guarantee_of(v1)) == ("prompt_sgd", "none")
    assert (v2.method, v2.privacy.target_epsilon, v2.seed) == ("prompt_dpsgd", 1.0, 3)
    assert l2 == "privacy.target_epsilon=1.0,seed=3" and not v1.sweep
    raw["sweep"].append({"privacy.target_epsilon": -2})
    with pytest.raises(ConfigError, match=r"sweep\.2 .*privacy.target_epsilon"):
        sweep_variants(parse_config(raw))


def test_seeds_cross_every_variant_and_group_by_variant():
    from tasks.config import sweep_variants, variant_group

    raw = {"data": {"name": "sst2", "labels": ["a", "b"]}, "models": {"local": "minilm"},
           "seeds": [0, 1, 2]}
    out = sweep_variants(parse_config(raw))
    assert [l for l, _ in out] == ["seed=0", "seed=1", "seed=2"]
    assert [v.seed for _, v in out] == [0, 1, 2] and not any(v.seeds or v.sweep for _, v in out)
    assert {variant_group(l) for l, _ in out} == {"base"}
    raw["sweep"] = [{"privacy.target_epsilon": 1.0}, {"privacy.target_epsilon": 8.0}]
    out = sweep_variants(parse_config(raw))
    assert len(out) == 6 and out[1][0] == "privacy.target_epsilon=1.0,seed=1"
    assert (out[4][1].privacy.target_epsilon, out[4][1].seed) == (8.0, 1)
    assert variant_group(out[4][0]) == "privacy.target_epsilon=8.0"
    raw["sweep"].append({"seed": 5})
    with pytest.raises(ConfigError, match=r"sweep\.2 sets seed"):
        sweep_variants(parse_config(raw))
    with pytest.raises(ConfigError, match="seeds must be distinct"):
        parse_config({**raw, "sweep": [], "seeds": [1, 1]})


@pytest.mark.slow  # suite time: runs with -m slow
def test_seed_groups_mean_and_sample_std():
    from flows.sweep import seed_groups, summary_table

    rows = [{"variant": f"privacy.target_epsilon=8.0,seed={s}", "mlflow_run_id": f"run{s}xxxxx", "seed": s,
             "test.accuracy": a, "test.accuracy.direct_transfer": d, "privacy.epsilon": 8.0}
            for s, a, d in [(0, 0.70, 0.60), (1, 0.72, None), (2, 0.74, 0.64)]]
    rows.append({"variant": "privacy.target_epsilon=1.0,seed=0", "mlflow_run_id": "other123", "seed": 0,
                 "test.accuracy": 0.5, "privacy.epsilon": 1.0})
    (g8, g1) = seed_groups(rows)
    assert g8["group"] == "privacy.target_epsilon=8.0" and g8["n"] == 3 and g8["seeds"] == [0, 1, 2]
    assert g8["test.accuracy"]["mean"] == pytest.approx(0.72)
    assert g8["test.accuracy"]["std"] == pytest.approx(0.02)  # sample std of 0.70, 0.72, 0.74
    assert g8["test.accuracy.direct_transfer"] == {"mean": pytest.approx(0.62), "std": pytest.approx(0.0282843, abs=1e-6), "n": 2}
    assert g8["mia.lira.auc"] == {"mean": None, "std": None, "n": 0}
    assert g1["n"] == 1 and g1["test.accuracy"]["std"] == 0.0
    table = summary_table(rows, [g8, g1])
    assert "| privacy.target_epsilon=8.0 | 3 | 8.0000 ± 0.0000 | 0.7200 ± 0.0200 |" in table
    assert "mia.lira.auc" not in table  # columns no run has are left out


def test_digest_key_is_the_sorted_json_sha256_prefix():
    """One helper keys every made-once result (partitions, RAPT draws, students, cached prompts,
    config hashes); its value must not move, or existing state folders lose their results."""
    import hashlib

    from tasks.config import config_hash
    from tasks.state import digest_key

    fields = {"seed": 3, "data": {"name": "sst2", "labels": ["negative", "positive"]}, "eta": 100.0}
    expected = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    assert digest_key(fields) == expected[:16]
    assert digest_key(fields, length=20) == expected[:20]
    assert digest_key(dict(reversed(list(fields.items())))) == digest_key(fields)  # key order is irrelevant
    assert digest_key({**fields, "seed": 4}) != digest_key(fields)
    assert digest_key({"path": Path("/x")}) == digest_key({"path": "/x"})  # non-JSON values by their str
    cfg = load_config(REPO / "configs" / "rapt.yaml")
    assert config_hash(cfg) == config_hash(load_config(REPO / "configs" / "rapt.yaml", ["state_dir=/elsewhere"]))
    assert config_hash(cfg) != config_hash(load_config(REPO / "configs" / "rapt.yaml", ["seed=5"]))
    assert len(config_hash(cfg)) == 20


def test_old_configs_with_the_flow_key_still_validate_and_hash_the_same():
    """``flow: prompt_tuning`` (a key no code read) is dropped: old configs validate, and a config's
    hash is what it was, so resumable sweeps find their stored runs; any other value is an unknown key."""
    from tasks.config import config_hash, parse_config
    from tasks.state import digest_key

    raw = {"method": "prompt_dpsgd", "data": {"name": "sst2", "labels": ["a", "b"]}, "models": {"local": "tiny-bert"}}
    new, old = parse_config(raw), parse_config({"flow": "prompt_tuning", **raw})
    assert "flow" not in new.model_dump() and new == old
    # the hash as computed before the key was removed: its dump carried flow: prompt_tuning
    before = {"flow": "prompt_tuning", **new.model_dump(mode="json")}
    for key in ("state_dir", "ledger", "sweep", "grid", "seeds", "sweep_dask"):
        before.pop(key, None)
    for key in ("privacy_unit", "max_records_per_unit", "canary_records_per_unit", "person_field"):  # issue 28: absent at defaults
        before["data"].pop(key)
    before.pop("selection")  # nor did it carry the selection block, added later (its defaults hash as before)
    before.pop("dp_icl"), before.pop("fallback")  # nor these, added later still (issues 38, 39, 41)
    before["models"].pop("placement"), before["models"].pop("placement_for"), before["audit"]["dask"].pop("devices")
    assert config_hash(new) == config_hash(old) == digest_key(before, length=20)
    with pytest.raises(ConfigError, match="flow: unknown config key"):
        parse_config({"flow": "sweep", **raw})
