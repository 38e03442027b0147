"""Review of the released split sizes (issue 24): functions of the EXACT sizes that still left
private/, and released sizes published with no charge.

* the partition task's result, which Prefect persists under its home (outside private/), held the
  exact n_train / n_holdout / n_test;
* the audit's pool refusal printed min(n_train, n_holdout) exactly (CLI, Prefect flow state),
  before any charge and without an audit label;
* a non-private baseline (prompt_sgd, prefix_nonprivate) trained ceil(epochs·ceil(n/B)) steps on
  the EXACT n and published them (``train.steps``, Prefect's "step k/total"): with batch_size 1,
  n_train itself;
* a dp run refused before its reservation (here: the audit's pool check) had already logged the
  released sizes and the q = B/ñ they imply on its MLflow parent, with nothing charged; a fresh draw
  is made for any change of a data-config field (e.g. data.size_noise_sigma by 1e-6), so such runs
  publish independent uncharged draws whose mean converges on the exact n.
"""

from __future__ import annotations

import re

import pytest


def _toy(folder, n=300, n_test=40):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"review text number {i} , a film", "label": "pos" if i % 3 else "neg"} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:n_test]), folder / "test.parquet")
    return folder


def _numbers(text: str) -> set[int]:
    return {int(x) for x in re.findall(r"(?<![0-9a-f.])\d+(?![0-9a-f.])", text)}


def test_the_persisted_partition_result_holds_no_exact_size(tmp_path, monkeypatch):
    from tasks import prefect_tasks
    from tasks.config import DataConfig
    from tasks.data import split_sizes

    cfg = DataConfig(name="toy", path=str(_toy(tmp_path / "d")), labels=["neg", "pos"])
    monkeypatch.setattr(prefect_tasks, "get_run_logger", lambda: type("L", (), {"info": lambda *a: None})())
    private = tmp_path / "private"
    out = prefect_tasks.partition_task.fn(cfg.model_dump(), 0, str(private), None)
    exact = split_sizes(cfg, 0, private, None)
    assert exact["n_train"] > 0 and exact["n_holdout"] > 0
    # what Prefect pickles to <state>/prefect/storage (persist_result=True)
    assert not {"n_train", "n_holdout", "n_test", "released"} & set(out)
    assert set(out) == {"dataset", "directory", "fingerprint", "source_key"}


def test_the_audit_pool_refusal_names_no_exact_size(tmp_path):
    from tasks.audit import AuditError, check_pool_size
    from tasks.data import Partition
    from tasks.schema import AuditConfig

    part = Partition(dataset="toy", directory=str(tmp_path), fingerprint="f", labels=["a", "b"], n_train=286,
                     n_holdout=54, n_test=208, n_canaries_planted=0,
                     released={"n_train": 301, "n_holdout": 49, "n_test": 190, "sigma": 50.0})
    with pytest.raises(AuditError) as err:
        check_pool_size(part, AuditConfig(enabled=True, fprs=[0.01, 0.001]))
    assert "needs at least 1000" in str(err.value)
    assert not _numbers(str(err.value)) & {286, 54, 208}


def test_a_nonprivate_baseline_steps_by_the_released_n(tmp_path):
    """train.steps (published) and the progress total follow the plan's n (released), not len(rows)."""
    from tasks.config import parse_config
    from tasks.methods import MethodContext, PrivateRows, get_method
    from tasks.randomness import DpRandomness
    from tasks.state import state_paths

    cfg = parse_config({"method": "prompt_dpsgd", "seed": 0, "state_dir": str(tmp_path / "state"),
                        "allow_nonprivate_baselines": True,
                        "data": {"name": "toy", "path": str(tmp_path), "labels": ["neg", "pos"]},
                        "models": {"local": "tiny-bert", "max_length": 16},
                        "methods": {"prompt_sgd": {"enabled": True, "n_tokens": 2, "batch_size": 1, "epochs": 1}}})
    rows = PrivateRows([f"text {i}" for i in range(5)], ["neg", "pos", "neg", "pos", "neg"])
    method = get_method("prompt_sgd")
    plan = method.mechanism.plan(cfg, 7, 1e-5)  # 7: the released size the run plans with (exact: 5)
    totals = []
    mctx = MethodContext(cfg, state_paths(cfg.state_dir).create(), {}, DpRandomness(), 0)
    trained = method.mechanism.train(mctx, plan, rows, progress=lambda step, total, *_: totals.append(total))
    assert trained.metrics["train.steps"] == 7 != len(rows)
    assert set(totals) == {7}


def test_a_run_refused_before_its_charge_publishes_no_released_size(tmp_path):
    """plan_run logs on the MLflow parent before the run's checks and its reservation: a run refused
    there (audit pool, preflight, budget) has published data.n_* and dpsgd.sample_rate = B/ñ with
    nothing charged. Published sizes must come with a charge that covers their draw."""
    from privacy.ledger import Ledger
    from tasks.audit import AuditError
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.pipeline import plan_run
    from tasks.stages import StageContext
    from tasks.state import state_paths

    cfg = parse_config({"method": "prompt_dpsgd", "seed": 0, "state_dir": str(tmp_path / "state"),
                        "data": {"name": "toy", "path": str(_toy(tmp_path / "d")), "labels": ["neg", "pos"]},
                        "models": {"local": "tiny-bert"}, "privacy": {"target_epsilon": 8.0},
                        "methods": {"prompt_dpsgd": {"batch_size": 8}},
                        "audit": {"enabled": True}})  # default FPRs need 1000 non-members: refused
    paths = state_paths(cfg.state_dir).create()
    part = partition_dataset(cfg.data, cfg.seed, paths.private, None)
    ctx = StageContext.for_run(cfg, paths, part.to_dict(), "parent", "flow")
    logged: dict = {}

    class Parent:
        def set_tags(self, tags):
            logged.update(tags)

        def log_params(self, params):
            logged.update(params)

    with pytest.raises(AuditError):
        plan_run(ctx, Parent())
    sized = {k for k in logged if k.startswith("data.n_") or k in ("dpsgd.sample_rate", "dpsgd.steps")}
    try:
        charged = Ledger(paths.ledger).counted_events(part.dataset_key)
    except Exception:  # noqa: BLE001 - an unregistered dataset: nothing charged
        charged = []
    assert not sized or charged, f"published {sorted(sized)} with nothing charged"


def test_a_config_edit_that_moves_no_record_gets_no_fresh_draw(tmp_path, monkeypatch):
    """The averaging attack of the review: fresh draws of the same counts, one per tweak of
    data.size_noise_sigma or data.name, would average the noise away. The draw is keyed by the
    splits' records: such an edit finds the same draw (with its own σ); an edit that moves records
    (another holdout fraction) is a draw of other counts; canaries are added after the draw."""
    from privacy import rng as prng
    from tasks.config import DataConfig
    from tasks.data import partition_dataset

    calls = []
    real = prng.secret_rng
    monkeypatch.setattr(prng, "secret_rng", lambda: calls.append(1) or real())
    folder = _toy(tmp_path / "d")
    private = tmp_path / "private"
    base = dict(path=str(folder), labels=["neg", "pos"], size_noise_sigma=50.0)
    first = partition_dataset(DataConfig(name="toy", **base), 0, private, None).sizes
    for i, edit in enumerate([{"size_noise_sigma": 50.000001}, {"size_noise_sigma": 50.000002}, {"name": "toy2"}]):
        again = partition_dataset(DataConfig(**{"name": "toy", **base, **edit}), 0, private, None).sizes
        assert again == first, edit  # the same released numbers and the first draw's σ
    assert calls == [1]
    partition_dataset(DataConfig(name="toy", **{**base, "holdout_fraction": 0.5}), 0, private, None)
    assert calls == [1, 1]  # other records in the splits: another release
    with_canaries = partition_dataset(DataConfig(name="toy", canaries=8, **base), 3, private, None)
    assert len(calls) == 2  # the same source records per split: the same draw ...
    assert with_canaries.sizes.n_train == first.n_train + with_canaries.n_canaries_planted  # ... plus the canaries


def test_pool_indices_draw_a_public_size_from_any_split():
    """Without replacement when the split holds enough rows (today's draw, unchanged); with fewer,
    every row ⌊m/n⌋ times and m mod n distinct rows once more."""
    import numpy as np

    from tasks.stages import pool_indices

    rng = np.random.default_rng(3)
    assert pool_indices(10, 4, rng).tolist() == np.random.default_rng(3).choice(10, size=4, replace=False).tolist()
    assert pool_indices(5, 5, rng).tolist() == [0, 1, 2, 3, 4]
    for n, m in ((7, 17), (3, 3 * 4), (10, 11)):
        idx = pool_indices(n, m, rng)
        counts = np.bincount(idx, minlength=n)
        assert len(idx) == m and set(counts.tolist()) <= {m // n, m // n + 1} and counts.sum() == m
    with pytest.raises(ValueError, match="empty split"):
        pool_indices(0, 3, rng)


@pytest.mark.parametrize("shift", [-7, 0, 9])  # released below, at and above the exact sizes
def test_audit_and_loss_attack_pools_are_the_released_sizes(tmp_path, monkeypatch, shift):
    """The audit pool and the in-flow loss attack's pools count what was released (issue 35,
    defect 6): a published n_members / n_nonmembers / base rate tells no exact size. Above the exact
    size the pool holds copies of rows, each copy in its row's shadows."""
    from dataclasses import replace
    from types import SimpleNamespace

    import numpy as np
    import pyarrow.parquet as pq

    from tasks import audit
    from tasks.audit import build_pool, check_pool_size
    from tasks.config import DataConfig
    from tasks.data import partition_dataset, read_partition_split
    from tasks.schema import AuditConfig
    from tasks.stages import mia_pool_sizes

    cfg = DataConfig(name="toy", path=str(_toy(tmp_path / "d", n=120)), labels=["neg", "pos"], canaries=6,
                     holdout_fraction=0.3)
    part = partition_dataset(cfg, 0, tmp_path / "private", None)
    source_train = part.n_train - part.n_canaries_planted
    part = replace(part, released={**part.released, "n_train": part.n_train + shift,
                                   "n_holdout": part.n_holdout + shift})
    assert mia_pool_sizes(part, 1000) == (part.n_train + shift, part.n_holdout + shift)
    assert mia_pool_sizes(part, 5) == (5, 5)
    acfg = AuditConfig(enabled=True, shadows=4, fprs=[0.5])
    sizes = check_pool_size(part, acfg)
    half = min(source_train, part.n_holdout) + shift
    assert sizes == {"n_members": half, "n_nonmembers": half}
    monkeypatch.setattr(audit, "check_audit", lambda target, a: check_pool_size(target.part, a))
    pool = build_pool(SimpleNamespace(part=part), acfg, tmp_path, 0)
    table = pq.read_table(pool["pool_path"])
    member = np.array(table.column("member").to_pylist())
    copy_of = np.array(table.column("copy_of").to_pylist())
    mask = np.load(pool["mask_path"])
    assert pool["n_pool"] == 2 * half and member.sum() == half
    assert (mask.sum(axis=0) == 2).all() and (mask == mask[:, copy_of]).all()  # a copy: its row's shadows
    texts = table.column("text").to_pylist()
    exact_in, exact_out = source_train, part.n_holdout
    assert len({t for t, m in zip(texts, member) if m}) == min(half, exact_in)
    assert len({t for t, m in zip(texts, member) if not m}) == min(half, exact_out)
    assert (copy_of != np.arange(len(texts))).any() == (half > min(exact_in, exact_out))
    assert not set(texts) & set(pq.read_table(part.canaries_path).column("text").to_pylist())
    assert set(texts) <= set(read_partition_split(part.train_path)[0]) | set(read_partition_split(part.holdout_path)[0])
