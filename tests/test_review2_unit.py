"""Review 2 of user-level DP (issue 28): the contribution bound ``data.max_records_per_unit`` holds
in every split a run releases from. RAPT privatizes the TEST split too (its test draw is written to
the run's outputs: a release) and publishes ``rapt.ldp_eta_tokens_per_unit`` = η·T·k for any unit
of at most k records — so a test person must keep at most k records as well."""

import numpy as np

from tasks.config import DataConfig
from tasks.data import split_source, release_inputs

KEY = bytes(range(32))


def _cfg(**kw) -> DataConfig:
    return DataConfig(name="toy", labels=["neg", "pos"], privacy_unit="author",
                      **{"holdout_fraction": 0.01, "train_fraction": 0.01, "max_records_per_unit": 2, **kw})


def test_cap_bounds_a_test_persons_records():
    train = (["a review"], ["neg"], ["someone else"])
    test = ([f"test review {j}" for j in range(7)], ["pos"] * 7, ["big user"] * 7)
    split = split_source(_cfg(), KEY, train, test)
    assert split.test.sum() == 2  # at most k = 2 of the person's 7 test records (all 7 were kept)
    # the person still counts once among the released test units; which records are kept is
    # a keyed hash of each record, the same on every call
    assert release_inputs(_cfg(), KEY, split, train, test, 0)[1]["n_test"] == 1
    assert np.array_equal(split_source(_cfg(), KEY, train, test).test, split.test)


def test_no_cap_keeps_every_test_record():
    train = (["a review"], ["neg"], ["someone else"])
    test = ([f"test review {j}" for j in range(7)], ["pos"] * 7, ["big user"] * 7)
    assert split_source(_cfg(max_records_per_unit=None), KEY, train, test).test.sum() == 7
