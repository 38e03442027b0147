"""Private selection under a person privacy unit (issue 35, defects 1 and 2).

* (a) the count vectors the selection releases (before noise), on a holdout and on the same holdout
  with one person (or, with a record unit, one record) removed and added, through the real
  ``train_selection`` in both modes and for both metrics: their L2 change is at most the
  sensitivity the charged event declares (σ of the released noise over σ of the charged score
  Gaussian: 1 per record, 1 per person — each person one vote —, k per person for a record-level run
  charged per person, whose score Gaussians the group rule divides by k);
* the candidates train on rows that keep their units (a unit-level training without them refuses:
  "the private rows carry no units");
* (c) the plan's charged event (``tasks.run_plan.plan_for``) holds its score Gaussians at that sensitivity,
  checked against dp-accounting's own accountants, and covers the measured worst change;
* (b) a user-level selection run end to end on tiny-bert, users of 1–20 records: every candidate
  trains (none fails) and a trained prompt is published;
* random stopping on a record-level run charged per person is refused at config time in one line.

The method's training and predictions are stand-ins in (a) and (c) (a real unit-level check on the
rows, deterministic predictions per row): the counts, the weights, the noise and the events are the
selection's own.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

from privacy import accountant as acct
from privacy import events as ev
from privacy import selection as psel
from tasks import selection as tsel
from tasks.methodkit import holdout
from tasks.methods import get_method
from tasks.methods.base import MethodContext, MethodPlan, PrivateRows, Trained

DELTA = 1e-5
K = 5  # records kept per person where a cap is set
SIZES = [1, 2, 3, 5, 8, 13, 20, 1, 4, 7, 11, 2, 1, 17, 6, 3, 9, 1, 2, 15]  # holdout rows per person: 1–20
LABELS = ["negative", "positive"]
CANDIDATES = [{"lr": 0.05}, {"lr": 0.2}]

# unit setting → the data block's unit keys
UNITS = {
    "record": {},
    "person": {"privacy_unit": "author"},
    "person_capped": {"privacy_unit": "author", "max_records_per_unit": K},
    "record_charged_per_person": {"person_field": "author", "max_records_per_unit": K},
}


def _raw(tmp_path, unit: str, mode: str, metric: str) -> dict:
    from tests.pipeline.test_flow import _config

    raw = _config(tmp_path / "data", tmp_path / "state")
    raw["data"].update(UNITS[unit])
    raw["methods"] = {"prompt_dpsgd": {"n_tokens": 2, "epochs": 1, "batch_size": 8}}
    raw["selection"] = {"enabled": True, "candidates": CANDIDATES, "mode": mode, "metric": metric,
                        "accept_timing_channel": mode == "random_stopping",
                        "expected_trials": 3.0}
    return raw


def _cfg(tmp_path, unit: str, mode: str, metric: str):
    from tasks.config import parse_config

    return parse_config(_raw(tmp_path, unit, mode, metric))


def _person_rows(u: int, n: int) -> list[tuple[str, str, str]]:
    return [(f"person {u} wrote note {j}", LABELS[(u * 7 + j * 3) % 2], f"author-{u}") for j in range(n)]


def _holdout(unit: str, drop: int | None = None, add: int = 0) -> PrivateRows:
    """The holdout of ``SIZES`` people (capped at K per person where the setting caps), without
    person ``drop``, with a new person of ``add`` rows (capped too). With a record unit ``drop``
    removes ONE row of that person and ``add`` adds one row. Rows carry their person only where the
    unit is a person (a record-level run's rows carry no units)."""
    cap = UNITS[unit].get("max_records_per_unit")
    rows = []
    for u, n in enumerate(SIZES):
        mine = _person_rows(u, n)[:cap]
        if u == drop:
            mine = mine[1:] if unit == "record" else []
        rows += mine
    if add:
        rows += _person_rows(len(SIZES), 1 if unit == "record" else add)[:cap]
    texts, labels, people = (list(x) for x in zip(*rows))
    return PrivateRows(texts, labels, units=people if unit.startswith("person") else None)


def _prediction(text: str, prompt) -> int:
    """A deterministic prediction of one row under ``prompt`` (a function of that row alone)."""
    return hashlib.sha256(f"{prompt}|{text}".encode()).digest()[0] % 2


@pytest.fixture
def stand_in(monkeypatch):
    """prompt_dpsgd with a stand-in plan (a fixed DP-SGD event per candidate), training (the real
    check that a unit-level step gets its rows' units, then a prompt naming the candidate) and
    predictions (:func:`_prediction`). Records the rows each training got."""
    from tasks.methodkit.training import unit_tensor

    method_cls = type(get_method("prompt_dpsgd").mechanism)
    trained_rows = []

    def plan(self, cfg, n_train, delta, epsilon=None):
        return MethodPlan(self.spec.name, "dp", n_train, delta, event=ev.dpsgd_event(0.05, 1.5, 40))

    def train(self, mctx, plan, rows, progress=None):
        unit_tensor(mctx.cfg, rows)  # refuses rows without units under a person unit, as the real step does
        trained_rows.append(rows)
        return Trained(f"lr={mctx.cfg.methods.prompt_dpsgd.lr}", plan.event, 1)

    def holdout_predictions(self, mctx, prompt, rows):
        return np.array([_prediction(t, prompt) for t in rows.texts])

    monkeypatch.setattr(method_cls, "plan", plan)
    monkeypatch.setattr(method_cls, "train", train)
    monkeypatch.setattr(holdout, "holdout_predictions", holdout_predictions)
    return trained_rows


@pytest.fixture
def released(monkeypatch):
    """Every count vector the selection releases, before its noise, with its σ."""
    seen = []
    real = psel.release_holdout_count_vector

    def spy(counts, noise_multiplier, rng):
        seen.append((np.asarray(counts, dtype=float).copy(), float(noise_multiplier)))
        return real(counts, noise_multiplier, rng)

    monkeypatch.setattr(psel, "release_holdout_count_vector", spy)
    return seen


def _selection_plan(cfg, sigma: float = 5.0) -> MethodPlan:
    candidates = tsel.candidates_of(cfg, get_method(cfg.method))
    settings = {"selection": {"trial_target": 1.0, "delta": DELTA, "score_noise_multiplier": sigma,
                              "candidates": [{"name": c.name, "settings": c.config, "zero_shot": c.zero_shot}
                                             for c in candidates]}}
    return MethodPlan("prompt_dpsgd", "dp", 400, DELTA, event=ev.GaussianEvent(1.0), settings=settings)


def _select(cfg, plan, holdout: PrivateRows, log, seed: int = 3) -> Trained:
    """The real ``train_selection`` on ``holdout``, its selection stream seeded (the same K and the
    same trials on neighbouring holdouts: the counts do not move the generator)."""
    from tasks.randomness import DpRandomness

    train = PrivateRows([f"train row {i}" for i in range(40)], [LABELS[i % 2] for i in range(40)],
                        units=[f"trainer-{i // 3}" for i in range(40)] if cfg.data.user_unit else None)
    train.validation = holdout
    mctx = MethodContext(cfg, None, {}, DpRandomness(seeded=True, seed=seed), 0)
    return tsel.train_selection(get_method("prompt_dpsgd"), mctx, plan, train, log)


def _score_gaussians(event) -> list[ev.GaussianEvent]:
    """The Gaussian events of the released counts in a selection's (charged) event, by its shape:
    every candidate once — (trainings ∥ n scores), by the group rule (trainings ∘ n scores); random
    stopping — best-of-K of (training ∥ score) trials, then the no-prompt reference. The sizes'
    release, where composed in front (``with_size_release``), is skipped."""
    def strip(e):
        return e.then if isinstance(e, ev.AdaptiveEvent) else e

    e = strip(event)
    if isinstance(e, ev.ComposedEvent) and isinstance(e.events[0], ev.RepeatAndSelectEvent):
        select, reference = e.events
        assert isinstance(reference, ev.GaussianEvent)
        return [reference] + [t.events[1] if isinstance(t, ev.ParallelEvent) else t for t in select.trials]
    assert isinstance(e, (ev.ParallelEvent, ev.ComposedEvent)) and len(e.events) == 2, e
    scores = strip(e.events[1])
    assert isinstance(scores, ev.SelfComposedEvent), e
    return [scores.event] * scores.count


def _declared_sensitivity(cfg, event, sigma: float) -> float:
    """The L2 sensitivity per unit that the charged event states for the released counts: the σ of
    the noise actually added over the σ of the charged score Gaussian (one Gaussian of σ' at
    sensitivity 1 is the mechanism of σ at sensitivity σ/σ')."""
    from privacy.plan import group_charge

    k = cfg.data.group_size
    charged = group_charge(event, k, "prompt_dpsgd", cfg.data.person_field) if k else event
    gaussians = _score_gaussians(charged)
    assert gaussians and all(isinstance(g, ev.GaussianEvent) for g in gaussians)
    noise = {g.noise_multiplier for g in gaussians}
    assert len(noise) == 1, noise
    return sigma / noise.pop()


def _biggest_holdout_person(unit: str) -> int:
    cap = UNITS[unit].get("max_records_per_unit") or max(SIZES)
    return int(np.argmax([min(n, cap) for n in SIZES]))


def _measured(cfg, unit, plan, released, tmp_path) -> tuple[float, float, Trained, list]:
    """(the largest L2 change of a released vector between the holdout and its neighbours, σ of
    the released noise, the base run's Trained, the base run's released vectors)."""
    base = _select(cfg, plan, _holdout(unit), tmp_path / "base.log")
    runs = [list(released)]
    for i, neighbour in enumerate((_holdout(unit, drop=_biggest_holdout_person(unit)), _holdout(unit, add=max(SIZES)))):
        released.clear()
        _select(cfg, plan, neighbour, tmp_path / f"n{i}.log")
        runs.append(list(released))
    sigmas = {s for run in runs for _, s in run}
    assert len(sigmas) == 1
    worst = 0.0
    for other in runs[1:]:
        assert len(other) == len(runs[0]) >= 2  # the same trials (and reference) on neighbouring holdouts
        for (a, _), (b, _) in zip(runs[0], other):
            worst = max(worst, float(np.linalg.norm(a - b)))
    return worst, sigmas.pop(), base, [a for a, _ in runs[0]]


MODES = ["every_candidate", "random_stopping"]
METRICS = ["accuracy", "balanced_accuracy"]


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unit", list(UNITS))
def test_released_counts_move_by_at_most_the_declared_sensitivity(unit, mode, metric, tmp_path, stand_in, released):
    from tasks.errors import ConfigError

    if unit == "record_charged_per_person" and mode == "random_stopping":
        with pytest.raises(ConfigError) as err:  # no group rule for best-of-K: refused at config time
            _cfg(tmp_path, unit, mode, metric)
        msg = str(err.value)
        assert "\n" not in msg and "random_stopping" in msg and "RepeatAndSelectEvent" in msg
        assert "every_candidate" in msg and "data.privacy_unit: author" in msg
        return
    cfg = _cfg(tmp_path, unit, mode, metric)
    plan = _selection_plan(cfg)
    worst, sigma, base, vectors = _measured(cfg, unit, plan, released, tmp_path)
    declared = _declared_sensitivity(cfg, base.event, sigma)
    expected = K if unit == "record_charged_per_person" else 1.0
    assert declared == pytest.approx(expected, rel=1e-12)
    assert 0.0 < worst <= declared * (1 + 1e-9), (worst, declared)
    # the candidates trained (none failed) on rows that kept their units
    assert stand_in and all((r.units is not None) == cfg.data.user_unit for r in stand_in)
    log = (tmp_path / "base.log").read_text()
    assert "FAILED" not in log
    # what a released vector holds: whole counts of rows, or one vote per person in all
    counts = vectors[0]
    holdout = _holdout(unit)
    if cfg.data.user_unit:
        assert math.fsum(counts) == pytest.approx(len(set(holdout.units)), rel=1e-12)
    else:
        assert math.fsum(counts) == len(holdout) and np.all(counts == np.round(counts))


def test_one_vote_weights_sum_to_one_per_person_and_the_scores_read_them():
    w = psel.one_vote_weights([0, 1, 1, 2, 2, 2, 1])
    np.testing.assert_allclose(w, [1, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert len(psel.one_vote_weights([])) == 0
    with pytest.raises(ValueError, match="unit_index"):
        psel.one_vote_weights([-1, 0])
    # person 0: 1 row, right; person 1: 3 rows (2 right of class 0, 1 wrong of class 1); person 2: 2 rows wrong
    labels = np.array([0, 0, 0, 1, 1, 1])
    predicted = np.array([0, 0, 0, 0, 0, 0])
    weights = psel.one_vote_weights([0, 1, 1, 1, 2, 2])
    cells = tsel.per_class_counts(predicted, labels, 2, weights)
    np.testing.assert_allclose(cells, [1 + 2 / 3, 0, 0, 1 / 3 + 1])
    # the released scores of weighted counts: the accuracy is the mean over people of each one's accuracy
    assert tsel.released_score([cells[0] + cells[2], cells[1] + cells[3]], "accuracy") == pytest.approx(
        (1 + 2 / 3 + 0) / 3)
    assert tsel.released_score(cells, "balanced_accuracy") == pytest.approx((1.0 + 0.0) / 2)
    # weighted counts are released like whole ones (non-negative numbers), negative ones are refused
    from privacy.rng import seeded_rng

    assert psel.release_holdout_count_vector(cells, 5.0, seeded_rng(0)).shape == (4,)
    with pytest.raises(ValueError, match="counts must be finite numbers >= 0"):
        psel.release_holdout_count_vector([0.5, -0.1], 5.0, seeded_rng(0))


def test_a_person_units_holdout_without_units_is_refused(tmp_path, stand_in):
    cfg = _cfg(tmp_path, "person", "every_candidate", "accuracy")
    rows = _holdout("person")
    with pytest.raises(RuntimeError, match="holdout rows carry no units"):
        _select(cfg, _selection_plan(cfg), PrivateRows(rows.texts, rows.labels), tmp_path / "x.log")
    assert stand_in == []  # refused before any candidate trained


# ---- (c) the plan's charged event, against dp-accounting ----------------------------------------

def _gaussian_rdp_by_dp_accounting(sigma: float, orders) -> np.ndarray:
    from dp_accounting import dp_event as dpe
    from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

    accountant = dpa_rdp.RdpAccountant(list(orders))
    accountant.compose(dpe.GaussianDpEvent(sigma))
    return np.asarray(accountant._rdp)


@pytest.mark.parametrize("unit,mode", [(u, m) for u in UNITS for m in MODES
                                       if not (u == "record_charged_per_person" and m == "random_stopping")])
def test_the_plans_charged_scores_hold_the_units_sensitivity_by_dp_accounting(unit, mode, tmp_path, stand_in,
                                                                               released):
    from dp_accounting import dp_event as dpe
    from dp_accounting.pld import pld_privacy_accountant as dpa_pld

    from privacy import rdp as rdp_lib
    from tasks.data import ReleasedSizes
    from tasks.run_plan import plan_for

    cfg = _cfg(tmp_path, unit, mode, "balanced_accuracy")
    sizes = ReleasedSizes(n_train=400, n_holdout=120, n_test=40, sigma=5.0)
    plan = plan_for(cfg, "prompt_dpsgd", sizes, DELTA)
    run_cfg = cfg
    sigma = float(plan.params["selection.score_noise_multiplier"])
    sensitivity = K if unit == "record_charged_per_person" else 1.0  # a person's rows: one vote, or ≤ K rows
    scores = _score_gaussians(plan.event)
    stated = {"person": "one vote per author (sensitivity 1 per author)",
              "person_capped": "one vote per author (sensitivity 1 per author)",
              "record_charged_per_person": f"rows, at most {K} per author (charged at sensitivity {K} per author)"}
    assert plan.params.get("selection.score_counts") == stated.get(unit)  # the run record says it (none per record)
    assert [g.noise_multiplier for g in scores] == pytest.approx([sigma / sensitivity] * len(scores), rel=1e-12)
    # the score part's ε by dp-accounting's own accountants, for the Gaussian of σ at that sensitivity
    orders = [o for o in rdp_lib.DEFAULT_ORDERS if float(o).is_integer()]
    for g in scores:
        np.testing.assert_allclose(rdp_lib.rdp_of_event(g, tuple(orders))[0],
                                   _gaussian_rdp_by_dp_accounting(sigma / sensitivity, orders), rtol=1e-9)
    if mode == "every_candidate":
        pld = dpa_pld.PLDAccountant(value_discretization_interval=1e-4)
        pld.compose(dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(sigma / sensitivity), len(scores)))
        ours = acct.spend(ev.SelfComposedEvent(scores[0], len(scores)), DELTA).epsilon
        assert ours == pytest.approx(pld.get_epsilon(DELTA), rel=5e-3)
    # the run charges what the plan reserved (the lifecycle: the sizes' release, then the group rule)
    trained = _select(run_cfg, plan, _holdout(unit), tmp_path / "run.log")
    assert plan.charged(trained.event)[0] == plan.event
    # and the charged score Gaussian covers the worst change measured on neighbouring holdouts: the
    # Gaussian mechanism of σ at the measured shift, by dp-accounting, costs no more than it at every order
    released.clear()
    worst, released_sigma, _, _ = _measured(run_cfg, unit, plan, released, tmp_path)
    assert released_sigma == pytest.approx(sigma)
    measured = _gaussian_rdp_by_dp_accounting(sigma / worst, orders)
    charged = rdp_lib.rdp_of_event(scores[0], tuple(orders))[0]
    assert np.all(measured <= charged * (1 + 1e-9))


# ---- (b) a user-level selection end to end on tiny-bert ---------------------------------------------

def _user_source(folder, sst2_dir):
    """SST-2 sentences as the records of 40 people of 1–20 records each (the sentence's own label)."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = SIZES * 2
    lines = [json.loads(x) for x in (sst2_dir / "train.jsonl").open().readlines()[:sum(sizes)]]
    rows, i = [], 0
    for u, n in enumerate(sizes):
        for _ in range(n):
            rows.append({**lines[i % len(lines)], "author": f"person-{u}"})
            i += 1
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    test = [json.loads(x) for x in (sst2_dir / "test.jsonl").open().readlines()[:20]]
    (folder / "test.jsonl").write_text("".join(json.dumps({**r, "author": f"t-{j}"}) + "\n"
                                               for j, r in enumerate(test)))


def test_a_user_level_selection_trains_its_candidates_and_publishes_one(tmp_path, sst2_dir, monkeypatch):
    """``data.privacy_unit: author`` with ``selection.enabled`` on tiny-bert: each candidate's
    DP-SGD step samples and clips people (its rows keep their units: none fails), the holdout counts
    count one vote per person, and a trained prompt is published (the holdout predictions are
    stand-ins — trained prompts right, no prompt wrong — so that a trained one wins; the real
    row-by-row scorer is tested in test_selection_every_candidate.py)."""
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.lifecycle import run_method
    from tasks.methodkit.classifiers import label_indices
    from tasks.pipeline import plan_run
    from tasks.record import RunRecord, client, ensure_experiment
    from tasks.stages import StageContext
    from tasks.state import SECRET_NAME, state_paths
    from tests.pipeline.test_flow import _config
    from tests.claims.test_release_once import _dp_entries, _published_prompts

    # DP-SGD's σ at a fixed value (its calibration is tested in test_accountant.py): the trials' ε, the
    # selection's and the ledger's are still the accountant's, and the plan still checks them
    monkeypatch.setattr(acct, "calibrate_noise_multiplier", lambda *a, **k: 3.0)
    _user_source(tmp_path / "data", sst2_dir)
    state = tmp_path / "state"
    (state / "secrets").mkdir(parents=True)
    (state / "secrets" / SECRET_NAME).write_bytes(bytes(range(32)))  # fixed key: a reproducible split of people
    raw = _config(tmp_path / "data", state)
    # a holdout of ~24 people: the trained prompts (all right) beat no prompt (all wrong) far beyond the noise
    raw["data"].update({"privacy_unit": "author", "holdout_fraction": 0.6, "size_noise_sigma": 4.0})
    raw["methods"] = {"prompt_dpsgd": {"n_tokens": 3, "epochs": 1, "batch_size": 8}}
    raw["selection"] = {"enabled": True, "candidates": CANDIDATES}
    raw["privacy"]["target_epsilon"] = 8.0
    cfg = parse_config(raw)
    paths = state_paths(str(state)).create()
    part = partition_dataset(cfg.data, cfg.seed, paths.private, None)
    assert part.n_holdout_units >= 5 and part.n_holdout > part.n_holdout_units  # people of several records held out
    mlflow = client(paths)
    parent = RunRecord.create(mlflow, ensure_experiment(mlflow, cfg.experiment, paths), "parent", {})
    ctx = StageContext(cfg=cfg, state_dir=str(state), partition=part.to_dict(),
                       parent_run_id=parent.run_id, flow_run_id="flow-run-1")

    method_cls = type(get_method("prompt_dpsgd").mechanism)
    real_train = method_cls.train
    trained, scored = [], []

    def train(self, mctx, plan, rows, progress=None):
        out = real_train(self, mctx, plan, rows, progress)
        trained.append((mctx.cfg.methods.prompt_dpsgd.lr, rows.units is not None))
        return out

    def holdout_predictions(self, mctx, prompt, rows):
        scored.append(rows.units is not None)
        y = label_indices(rows.labels, mctx.cfg.data.labels).cpu().numpy()
        return y if prompt is not None else 1 - y  # trained prompts right, no prompt wrong: one of them wins

    monkeypatch.setattr(method_cls, "train", train)
    monkeypatch.setattr(holdout, "holdout_predictions", holdout_predictions)
    plan_run(ctx, ctx.parent)
    out = run_method(ctx, "prompt_dpsgd", {})

    assert sorted(trained) == [(0.05, True), (0.2, True)]  # every candidate trained, on rows with their units
    log = (ctx.private_run_dir / "selection.log").read_text()
    assert "FAILED" not in log and "carry no units" not in log
    assert "selection.fallback_to_no_prompt" not in out.train_metrics
    assert out.params["selection.winner"] in ("lr=0.05", "lr=0.2")
    assert out.train_metrics["selection.winner.holdout_score"] > out.train_metrics["selection.no_prompt.holdout_score"]
    assert scored == [True] * 3 and out.published  # two candidates and no prompt, on the holdout's people
    files, artifacts = _published_prompts(ctx)
    assert files == ["prompt_dpsgd.safetensors"] and artifacts == ["prompt/prompt_dpsgd.safetensors"]
    (entry,) = _dp_entries(ctx)
    assert entry["status"] == "committed" and entry["epsilon"] <= cfg.privacy.target_epsilon
    assert out.spend["epsilon"] == pytest.approx(entry["epsilon"], rel=1e-9)
