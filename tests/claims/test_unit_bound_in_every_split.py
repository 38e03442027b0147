"""Review 2 of user-level DP (issue 28): the contribution bound ``data.max_records_per_unit`` holds
in every split a run releases from. RAPT privatizes the TEST split too (its test draw is written to
the run's outputs: a release) and publishes ``rapt.ldp_eta_tokens_per_unit`` = η·T·k for any unit
of at most k records — so a test person must keep at most k records as well."""

import numpy as np
import pytest

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


@pytest.mark.slow  # ~20 s: the plan's preflight builds tiny-bert
def test_a_plan_refuses_two_units_on_one_dataset_as_the_runs_would(tmp_path):
    """Variants of one plan on a source no ledger has seen yet, one at `record` and one at a user
    unit: the first run registers the dataset with its unit and the second is refused at run time
    (``Ledger.require_unit``) after the first has spent — so the plan refuses it too, as it does a
    second δ (the README: `privprompt plan` and `run` alike)."""
    import json as _json

    from privacy.ledger import UnitMismatchError
    from tasks.config import parse_config
    from tasks.planning import plan_runs
    from tasks.state import state_paths
    from tests.pipeline.test_flow import _config

    data = tmp_path / "people"
    data.mkdir()
    for split, n in (("train", 120), ("test", 40)):
        rows = [{"text": f"{split} review {i} of item {i % 7}: {'good' if i % 2 else 'bad'} stuff",
                 "label": ["negative", "positive"][i % 2], "author": f"user-{i % 30}"} for i in range(n)]
        (data / f"{split}.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in rows))
    state = tmp_path / "state"

    def variant(**extra):
        cfg = _config(data, state, **{"privacy.target_delta": 1e-4, **extra})
        for m in ("zero_shot", "prompt_sgd"):
            cfg["methods"][m]["enabled"] = False
        cfg["mia"]["enabled"] = False
        return parse_config(cfg)

    variants = [("records", variant()), ("people", variant(**{"data.privacy_unit": "author"}))]
    with pytest.raises((UnitMismatchError, ValueError), match="privacy unit") as info:
        plan_runs(variants, state_paths(str(state)))
    assert "\n" not in str(info.value)
    assert not state_paths(str(state)).ledger_exists()  # a plan writes nothing
