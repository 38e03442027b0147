"""Review 6, F5: a run whose EXACT training or holdout split is empty used to be refused at the
partition, before any release — for a dataset D with an empty holdout the flow failed, for D plus
one record that hashes into the holdout it ran and published a DP prompt: a 0-vs-1 test of that
record which ε does not cover. Now such a split is partitioned like any other and the mechanisms
run on it (noise alone): the run finishes and publishes its ε; every decision after the partition
reads released sizes only."""

import json

import numpy as np
import pytest

from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset


@pytest.fixture(scope="module")
def toy(sst2_dir, tmp_path_factory):
    return _toy_dataset(tmp_path_factory.mktemp("empty") / "data", sst2_dir, n_train=120, n_test=40)


@pytest.mark.parametrize("split", ["holdout", pytest.param("train", marks=pytest.mark.slow)])  # suite time: the
# contract's test_a_private_method_trains_on_an_exactly_empty_split trains every method on an empty set
def test_a_dp_run_on_an_exactly_empty_split_finishes_and_publishes_its_epsilon(split, toy, prefect_harness,
                                                                               tmp_path):
    from flows.method_flow import method_flow
    from tasks.data import Partition

    state = tmp_path / "state"
    # 120 records at rate 1e-6: the split is empty (P(not) ≈ 1e-4); the comparison with no prompt, which
    # reads the holdout, runs (fallback on)
    cfg = _config(toy, state, **{f"data.{split}_fraction": 1e-6, "fallback": {"enabled": True}})
    cfg["methods"]["zero_shot"]["enabled"] = False
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    cfg["mia"]["max_examples"] = 20  # the default loss MIA stays on: with a split of no row it does not run
    # (an audit statistic), never failing the flow that publishes the run's DP output (review 8, H1)
    summary = method_flow(cfg)
    run = _mlflow(state).get_run(summary["mlflow_run_id"])
    assert 0 < run.data.metrics["privacy.epsilon"] <= 4.0 + 1e-6 and run.data.tags["privacy.guarantee"] == "dp"
    (manifest,) = (state / "private" / "partitions").glob("*/manifest.json")
    part = Partition(**json.loads(manifest.read_text()))
    assert getattr(part, f"n_{split}") == 0 and getattr(part.sizes, f"n_{split}") >= 1  # exact 0, released noise
    assert run.data.params[f"data.n_{split}"] == str(getattr(part.sizes, f"n_{split}"))  # what is published
    assert not [k for k in run.data.metrics if k.startswith("mia.")]
    mias = _mlflow(state).search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}' "
                                      "and tags.attack = 'loss'")
    if run.data.metrics.get("no_prompt.fallback"):  # (an empty holdout's comparison is noise alone: no prompt half
        assert not mias                               # the time, and then nothing to attack)
    else:
        (mia,) = mias
        assert mia.data.tags["audit.not_run"] == "a split holds no row"


@pytest.mark.parametrize("metric,weights", [("accuracy", None), ("balanced_accuracy", None),
                                            ("accuracy", []), ("balanced_accuracy", [])])
def test_the_selection_scores_an_exactly_empty_holdout_as_zero_counts(metric, weights, monkeypatch):
    """The selection's counts on an empty holdout are all 0 (the noise is then the whole release),
    whatever the metric and unit: no method is asked to predict zero rows."""
    from types import SimpleNamespace

    from tasks.methodkit import holdout
    from tasks.methods import PrivateRows
    from tasks.selection import holdout_counts

    def never_called(*a):
        raise AssertionError("scored an empty holdout")

    monkeypatch.setattr(holdout, "holdout_predictions", never_called)

    cfg = SimpleNamespace(selection=SimpleNamespace(metric=metric), data=SimpleNamespace(labels=["neg", "pos"]))
    counts = holdout_counts(object(), SimpleNamespace(cfg=cfg), None, PrivateRows([], [], units=None),
                            None if weights is None else np.array(weights, dtype=float))
    assert list(np.asarray(counts, dtype=float)) == [0.0] * (2 if metric == "accuracy" else 4)


def test_the_audit_sees_an_empty_side_and_does_not_run(toy, tmp_path):
    """``audit.enabled``: the shadow audit's pool has no member (training rows that are no canary) or
    no non-member (holdout rows) on an exactly empty split — the flow then logs that it did not run
    (an audit statistic) instead of failing at the pool draw (review 8, H1)."""
    from tasks.audit import has_empty_side
    from tasks.config import DataConfig
    from tasks.data import partition_dataset

    def part(**kw):
        return partition_dataset(DataConfig(name="toy", path=str(toy), labels=["negative", "positive"], **kw), 0,
                                 tmp_path / "p", None)
    assert has_empty_side(part(holdout_fraction=1e-6)) and has_empty_side(part(train_fraction=1e-6))
    assert not has_empty_side(part(holdout_fraction=0.3))


def test_exactly_empty_training_splits_of_two_sources_publish_different_fingerprints(toy, tmp_path):
    """Review 8, H6: the partition's fingerprint (``data.partition``, in Prefect's log and the budget
    record) was an HMAC of the training rows alone — for an empty training split one constant of
    the installation, which, seen once, read the 0-vs-1 bit off any run. It is salted with the
    source's records key."""
    import shutil

    from tasks.config import DataConfig
    from tasks.data import partition_dataset

    other = tmp_path / "other"
    shutil.copytree(toy, other)
    (other / "train.jsonl").write_text((toy / "train.jsonl").read_text().split("\n", 1)[1])  # one record fewer
    a, b = (partition_dataset(DataConfig(name=f"d{i}", path=str(folder), labels=["negative", "positive"],
                                         train_fraction=1e-6), 0, tmp_path / "p", None)
            for i, folder in enumerate((toy, other)))
    assert a.n_train == b.n_train == 0 and a.fingerprint != b.fingerprint
