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


@pytest.mark.parametrize("split", ["holdout", "train"])
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
    cfg["mia"]["enabled"] = False
    summary = method_flow(cfg)
    run = _mlflow(state).get_run(summary["mlflow_run_id"])
    assert 0 < run.data.metrics["privacy.epsilon"] <= 4.0 + 1e-6 and run.data.tags["privacy.guarantee"] == "dp"
    (manifest,) = (state / "private" / "partitions").glob("*/manifest.json")
    part = Partition(**json.loads(manifest.read_text()))
    assert getattr(part, f"n_{split}") == 0 and getattr(part.sizes, f"n_{split}") >= 1  # exact 0, released noise
    assert run.data.params[f"data.n_{split}"] == str(getattr(part.sizes, f"n_{split}"))  # what is published


@pytest.mark.parametrize("metric,weights", [("accuracy", None), ("balanced_accuracy", None),
                                            ("accuracy", []), ("balanced_accuracy", [])])
def test_the_selection_scores_an_exactly_empty_holdout_as_zero_counts(metric, weights):
    """The selection's counts on an empty holdout are all 0 (the noise is then the whole release),
    whatever the metric and unit: no method is asked to predict zero rows."""
    from types import SimpleNamespace

    from tasks.methods import PrivateRows
    from tasks.selection import holdout_counts

    class NeverCalled:
        def holdout_correct(self, *a):
            raise AssertionError("scored an empty holdout")

        holdout_predictions = holdout_correct

    cfg = SimpleNamespace(selection=SimpleNamespace(metric=metric), data=SimpleNamespace(labels=["neg", "pos"]))
    counts = holdout_counts(NeverCalled(), SimpleNamespace(cfg=cfg), None, PrivateRows([], [], units=None),
                            None if weights is None else np.array(weights, dtype=float))
    assert list(np.asarray(counts, dtype=float)) == [0.0] * (2 if metric == "accuracy" else 4)
