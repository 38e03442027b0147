"""Issue 24's last item: a run publishes and plans with split sizes released by a Gaussian count
(never the exact ones), and its ε covers that release together with its method.

* the mechanism against its distribution (mean, spread, a KS test), floored and rounded;
* the accountant's ε of the release against the exact Gaussian curve (Balle & Wang 2018,
  computed here independently with scipy);
* one source record added or removed moves the vector of split sizes by at most one in one
  coordinate (L2 sensitivity 1);
* a dp plan composes the release with the method and stays within the target (DP-SGD, DPZero and
  DP-OPT's parallel branches), the method itself calibrated to the remainder;
* plan and run share one draw, and an exact size is never what the partition logs or publishes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats


def test_released_counts_follow_the_gaussian_mechanism():
    from privacy.mechanisms import release_counts
    from privacy.rng import seeded_rng

    rng = seeded_rng(7)
    counts = [5000, 3000, 400]
    draws = np.array([release_counts(counts, 10.0, rng) for _ in range(6000)], dtype=float)
    noise = draws - np.array(counts)
    assert np.all(noise == np.round(noise))  # released as whole records
    assert np.abs(noise.mean(axis=0)).max() < 0.5  # unbiased: 5 standard errors of 10/√6000 ≈ 0.13
    # rounding adds a uniform ±½: variance σ² + 1/12
    assert np.allclose(noise.std(axis=0), math.sqrt(100 + 1 / 12), rtol=0.04)
    jittered = noise[:, 0] + rng.uniform(-0.5, 0.5, size=len(noise))  # undo the rounding's lattice
    assert stats.kstest(jittered, stats.norm(scale=math.sqrt(100 + 1 / 12)).cdf).pvalue > 1e-3
    assert np.corrcoef(noise.T)[0, 1] == pytest.approx(0.0, abs=0.05)  # independent coordinates
    assert min(release_counts([0, 1, 2], 10.0, rng) for _ in range(200))[0] >= 1  # floored at 1
    for bad in ([], [-1], [1.5], [[1, 2]]):
        with pytest.raises(ValueError, match="non-negative integers"):
            release_counts(bad, 10.0, rng)


def _exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """ε at δ of the Gaussian mechanism with sensitivity 1 and noise σ, from its exact privacy
    profile δ(ε) = Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ) (Balle & Wang 2018, Thm. 8), by bisection."""
    def profile(eps):
        return stats.norm.cdf(0.5 / sigma - eps * sigma) - math.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)

    lo, hi = 0.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if profile(mid) <= delta else (mid, hi)
    return hi


@pytest.mark.parametrize("sigma", [2.0, 10.0, 30.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-7])
def test_the_release_is_accounted_as_the_exact_gaussian(sigma, delta):
    from privacy import accountant as acct
    from privacy.mechanisms import count_release_event

    exact = _exact_gaussian_epsilon(sigma, delta)
    spend = acct.spend(count_release_event(sigma), delta)
    assert exact - 1e-9 <= spend.epsilon <= exact * 1.01 + 1e-4  # never below the truth, and tight
    assert spend.epsilon_rdp >= exact - 1e-9  # the RDP cross-check is an upper bound too


def test_one_source_record_moves_one_size_by_at_most_one(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.config import DataConfig
    from tasks.data import split_sizes

    rng = np.random.default_rng(0)
    train = [{"text": f"review number {i} {rng.integers(10**9)}", "label": int(i % 2)} for i in range(600)]
    test = [{"text": f"test review {i}", "label": int(i % 2)} for i in range(200)]

    def sizes(train_rows, test_rows, name):
        folder = tmp_path / name
        folder.mkdir()
        pq.write_table(pa.Table.from_pylist(train_rows), folder / "train.parquet")
        pq.write_table(pa.Table.from_pylist(test_rows), folder / "test.parquet")
        cfg = DataConfig(name="toy", path=str(folder), labels=["neg", "pos"], train_fraction=0.5,
                         holdout_fraction=0.2, test_fraction=0.5, label_map={"0": "neg", "1": "pos"})
        s = split_sizes(cfg, 0, tmp_path / "private", None)
        return np.array([s["n_train"], s["n_holdout"], s["n_test"]])

    base = sizes(train, test, "base")
    neighbours = [sizes(train[:i] + train[i + 1:], test, f"rm{i}") for i in range(0, 600, 60)]
    neighbours += [sizes(train, test[:i] + test[i + 1:], f"rmt{i}") for i in range(0, 200, 50)]
    neighbours += [sizes(train + [{"text": f"added {j}", "label": 1}], test, f"add{j}") for j in range(8)]
    moved = [int(np.abs(n - base).sum()) for n in neighbours]
    assert max(moved) <= 1  # L1 (hence L2) distance ≤ 1: the Gaussian's sensitivity
    assert sum(moved) > 0  # and some neighbours do move a size (the test has teeth)


def _cfg(tmp_path, method="prompt_dpsgd", **methods):
    from tasks.config import parse_config

    raw = {"method": method, "seed": 0, "state_dir": str(tmp_path / "state"),
           "data": {"name": "toy", "path": str(tmp_path), "labels": ["neg", "pos"]},
           "models": {"local": "tiny-bert"}, "privacy": {"target_epsilon": 2.0},
           "methods": {method: {"batch_size": 16, "epochs": 2, **methods}}}
    return parse_config(raw)


@pytest.mark.parametrize("method", ["prompt_dpsgd", "dpzero"])
def test_a_dp_plan_composes_the_release_within_the_target(tmp_path, method):
    """Basic composition (valid although the method's parameters are chosen from ñ): the release
    at δ/10 plus the method and the comparison with no prompt, composed at 9δ/10, within 0.5 % below
    the target; the accountant's answer for the run's event (what the ledger holds) is that sum."""
    from privacy import accountant as acct
    from privacy import events as ev
    from tasks.data import ReleasedSizes
    from tasks.methods import get_method
    from tasks.run_plan import plan_for

    cfg = _cfg(tmp_path, method)
    sizes = ReleasedSizes(n_train=480, n_holdout=60, n_test=200, sigma=50.0)
    delta = 1e-5
    before = cfg.model_dump()
    plan = plan_for(cfg, method, sizes, delta)
    assert cfg.model_dump() == before  # the budget travels in the plan, never written into the config
    assert isinstance(plan.event, ev.AdaptiveEvent) and plan.event.first == ev.GaussianEvent(50.0)
    assert plan.event.first_delta_share == 0.1 and isinstance(plan.event.then, ev.ComposedEvent)
    eps_sizes = acct.spend(ev.GaussianEvent(50.0), delta / 10).epsilon
    assert plan.params["privacy.size_epsilon"] == eps_sizes and 0.05 < eps_sizes < 0.08
    share = plan.method_epsilon
    # the comparison with no prompt (fallback.epsilon_share of the target, at δ/10) comes out of it too
    eps_np = plan.no_prompt.epsilon
    assert plan.no_prompt.delta == delta / 10 and eps_np == pytest.approx(2.0 * cfg.fallback.epsilon_share, rel=1e-6)
    assert plan.event.then.events[1] == plan.no_prompt.event
    # the method's share starts additive and is raised until it and the comparison, composed at 9δ/10,
    # spend what the sizes leave
    assert share == plan.params["privacy.method_epsilon"] > 2.0 - eps_sizes - eps_np
    # the method alone, calibrated to its share at 8δ/10 on the released n
    assert plan.release("method").delta == pytest.approx(delta * 0.8)
    alone = get_method(method).mechanism.plan(cfg, 480, plan.release("method").delta, epsilon=share)
    assert alone.event == plan.event.then.events[0]
    method_eps = acct.spend(alone.event, delta * 0.8).epsilon
    assert share * 0.99 < method_eps <= share * (1 + 1e-6)
    rest = acct.spend(ev.ComposedEvent((alone.event, plan.no_prompt.event)), delta * 0.9).epsilon
    guarantee = eps_sizes + rest  # the run's (target, δ) by basic composition of the sizes with the rest
    assert guarantee == pytest.approx(plan.guarantee_epsilon) and 2.0 * 0.995 <= guarantee <= 2.0 * (1 + 1e-6)
    assert acct.spend(plan.event, delta).epsilon == pytest.approx(guarantee, rel=1e-12)  # the ledger's: the same
    assert plan.delta == delta and alone.settings["sample_rate"] == pytest.approx(16 / 480)
    assert alone.settings["expected_batch"] == pytest.approx(16.0)  # gradients scaled by the released n
    # a noisier release costs less of the target
    quieter = plan_for(cfg, method, ReleasedSizes(480, 60, 200, sigma=200.0), delta)
    assert share < quieter.method_epsilon < 2.0
    with pytest.raises(Exception, match="leaves nothing for the method"):
        plan_for(cfg, method, ReleasedSizes(480, 60, 200, sigma=0.5), delta)


def test_dp_opt_composes_the_release_with_its_parallel_branches_by_basic_composition():
    """The release is adaptive (the branches' parameters come from ñ): it is charged at δ/10 beside
    the worse branch at 9δ/10, which bounds each branch with the release (a record lies in one)."""
    from privacy import accountant as acct
    from privacy import events as ev
    from tasks.data import ReleasedSizes
    from tasks.run_plan import with_size_release

    sizes = ReleasedSizes(1000, 100, 100, sigma=10.0)
    gen = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.0)), 100)
    sel = ev.ExponentialEvent(1.0)
    composed = with_size_release(ev.ParallelEvent((gen, sel)), sizes)
    assert composed == ev.AdaptiveEvent(sizes.event, ev.ParallelEvent((gen, sel)), 0.1)
    delta = 1e-5
    worst = max(acct.spend(e, delta * 0.9).epsilon for e in (gen, sel))
    assert acct.spend(composed, delta).epsilon == pytest.approx(acct.spend(sizes.event, delta / 10).epsilon + worst)
    # never below the PLD of the release inside each branch at the whole δ (what was counted before)
    inside = max(acct.spend(ev.ComposedEvent((sizes.event, e)), delta).epsilon for e in (gen, sel))
    assert acct.spend(composed, delta).epsilon >= inside


def test_delta_is_ruled_by_an_upper_bound_on_n():
    from tasks.data import ReleasedSizes

    s = ReleasedSizes(100, 10, 10, sigma=10.0)
    assert s.n_for_delta == 130  # released + 3σ: δ ≤ 1/(10 n) errs towards a smaller δ
    from tasks.config import DataConfig

    assert DataConfig(name="x", labels=["a", "b"]).size_noise_sigma == 50.0  # the default
    assert s.params() == {"data.n_train": 100, "data.n_holdout": 10, "data.n_test": 10, "data.size_noise_sigma": 10.0}


def test_plan_and_partition_share_one_secret_draw(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.config import DataConfig
    from tasks.data import partition_dataset, release_sizes, split_sizes

    folder = tmp_path / "d"
    folder.mkdir()
    rows = [{"text": f"text {i}", "label": "pos" if i % 3 else "neg"} for i in range(400)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:50]), folder / "test.parquet")
    cfg = DataConfig(name="toy", path=str(folder), labels=["neg", "pos"], size_noise_sigma=25.0)
    private = tmp_path / "private"
    # the logged seed plays no part: the draw comes from the secret stream (two installations'
    # releases of the same data differ; replaying the seed does not reproduce one)
    from privacy import rng as prng

    calls = []
    real = prng.secret_rng
    monkeypatch.setattr(prng, "secret_rng", lambda: calls.append(1) or real())
    part = partition_dataset(cfg, 0, private, None)
    again = partition_dataset(cfg, 0, private, None)
    assert calls == [1] and part.sizes == again.sizes  # drawn once, kept
    exact = split_sizes(cfg, 0, private, None)
    assert exact == {"n_train": part.n_train, "n_holdout": part.n_holdout, "n_test": part.n_test}
    from tasks.data import split_release_inputs

    membership, source, planted = split_release_inputs(cfg, 0, private, None)
    assert release_sizes(cfg, membership, private, source, planted) == part.sizes
    partition_dataset(cfg, 0, tmp_path / "other-private", None)  # another installation: its own draw
    assert len(calls) == 2
    manifest = json.loads((next((private / "partitions").glob("*/manifest.json"))).read_text())
    assert manifest["released"]["sigma"] == 25.0


def test_the_partition_log_line_shows_no_sizes(tmp_path, monkeypatch):
    """Prefect's logs reach its server: the partition task logs no size, exact or released."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks import prefect_tasks
    from tasks.config import DataConfig

    folder = tmp_path / "d"
    folder.mkdir()
    rows = [{"text": f"text {i}", "label": "pos" if i % 3 else "neg"} for i in range(300)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:40]), folder / "test.parquet")
    cfg = DataConfig(name="toy", path=str(folder), labels=["neg", "pos"])
    lines = []

    class Logger:
        def info(self, msg, *args):
            lines.append(msg % args)

    monkeypatch.setattr(prefect_tasks, "get_run_logger", Logger)
    out = prefect_tasks.partition_task.fn(cfg.model_dump(), 0, str(tmp_path / "private"), None)
    (line,) = lines
    numbers = {int(x) for x in __import__("re").findall(r"(?<![0-9a-f])\d+(?![0-9a-f])", line)}
    part = json.loads((Path(out["directory"]) / "manifest.json").read_text())  # the task's result holds no size
    sizes = {part[k] for k in ("n_train", "n_holdout", "n_test")} | {part["released"][k] for k in ("n_train", "n_holdout", "n_test")}
    assert not numbers & sizes and "train" not in line
