"""The neighbour harness (issue 37): for every registered method — the toy plugin of
tests/methods/test_toy_method.py too, registered from outside the project — × privacy unit (record; a
person field with and without ``data.max_records_per_unit``; record-level charged per person) ×
selection (off, every_candidate, random_stopping), the run's plan (``tasks.run_plan.plan_for``)
declares its releases, each with a sensitivity per unit and the names of its deterministic
pre-noise statistics (``Release.statistics``, computed by ``tasks/neighbours.py`` with the
project's own split, clipping and counting code). On a small source dataset of people D and its
neighbours D′ — one record (record unit) or one person added, one removed — each statistic must
move by at most the declared sensitivity (L2). No list of methods: the registry is iterated.

What it covers, exactly: the released sizes (every dp run), DP-SGD's clipped per-unit gradient sum
(soft prompt, prefix, Privacy-Flat, the toy plugin), DPZero's clipped per-unit difference sum, and
selection's holdout count vectors. A dp combination whose releases declare no statistic (DP-OPT's
votes, RAPT's token counts, POST's teacher) is reported as NOT covered; a combination the config or
planner refuses is counted as refused (its message one line)."""

import dataclasses
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tasks import neighbours
from tasks.neighbours import SourceData

LABELS = ["negative", "positive"]
WORDS = ["good", "bad", "fine", "dull", "great", "awful", "warm", "cold"]
SIZES = [1, 2, 3, 5, 1, 4, 2, 6, 1, 3, 2, 2, 5, 1, 3, 4, 1, 2, 3, 2] * 2  # records per person
KEY = bytes(range(32))
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
CAP = 2
UNITS = {
    "record": {},
    "person": {"privacy_unit": "author"},
    "person_capped": {"privacy_unit": "author", "max_records_per_unit": CAP},
    "record_charged_per_person": {"person_field": "author", "max_records_per_unit": CAP},
}
SELECTIONS = {
    "off": None,
    "every_candidate": {"enabled": True, "mode": "every_candidate"},
    "random_stopping": {"enabled": True, "mode": "random_stopping", "accept_timing_channel": True,
                        "expected_trials": 3.0},
}


def _person(u: int, k: int, tag: str = "") -> list[dict]:
    return [{"text": f"{WORDS[(u + j) % 8]} film {tag}{u} part {j} {WORDS[(3 * u + j) % 8]}",
             "label": LABELS[(u + j) % 2], "author": f"person-{tag}{u}"} for j in range(k)]


def _source(train: list[dict], test: list[dict]) -> SourceData:
    split = lambda rows: ([r["text"] for r in rows], [r["label"] for r in rows], [r["author"] for r in rows])  # noqa: E731
    return SourceData(split(train), split(test))


BASE_TRAIN = [r for u, k in enumerate(SIZES) for r in _person(u, k)]
BASE_TEST = [r for u in range(12) for r in _person(100 + u, 2, "t")]


def neighbours_of(unit: str) -> dict[str, SourceData]:
    """D′ for D: one record (record unit) or one person (every other unit) added, one removed. The
    added person has records in both source splits and more than the cap."""
    if unit == "record":
        out = {"add": _source(BASE_TRAIN + _person(999, 1, "new"), BASE_TEST),
               "add_test": _source(BASE_TRAIN, BASE_TEST + _person(998, 1, "new"))}
        for i in range(6):
            out[f"add_{i}"] = _source(BASE_TRAIN + _person(990 + i, 1, "new"), BASE_TEST)
            out[f"remove_{i}"] = _source(BASE_TRAIN[:7 * i] + BASE_TRAIN[7 * i + 1:], BASE_TEST)
        return out
    out = {"add": _source(BASE_TRAIN + _person(999, 5, "new"), BASE_TEST + _person(999, 2, "new"))}
    for i in range(6):  # more people, so that their keyed hashes put them in training, holdout and test alike
        out[f"add_{i}"] = _source(BASE_TRAIN + _person(990 + i, 4, "new"), BASE_TEST + _person(990 + i, 3, "new"))
    for u in sorted(range(len(SIZES)), key=lambda u: -SIZES[u])[:4]:
        out[f"remove_{u}"] = _source([r for r in BASE_TRAIN if r["author"] != f"person-{u}"], BASE_TEST)
    return out


@pytest.fixture(scope="module")
def toy_plugin(tmp_path_factory):
    """The toy method package of tests/methods/test_toy_method.py, written outside the project and imported."""
    from tests.methods.test_toy_method import NAME, PACKAGE

    from tasks.methods import unregister_method

    root = tmp_path_factory.mktemp("plugins")
    (root / NAME).mkdir()
    for file, text in PACKAGE.items():
        (root / NAME / file).write_text(textwrap.dedent(text).lstrip())
    sys.path.insert(0, str(root))
    __import__(NAME)
    yield NAME
    unregister_method(NAME)
    sys.path.remove(str(root))
    for module in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
        del sys.modules[module]


@pytest.fixture
def fast_calibration(monkeypatch):
    """DP-SGD's σ calibrated by a closed form instead of the PLD search: T Gaussian steps of noise σ
    (sensitivity 1) are T/(2σ²)-zCDP, hence (ρ + 2·sqrt(ρ·ln(1/δ)), δ)-DP (Bun & Steinke 2016,
    Prop. 1.3), subsampling only lowering it: a valid, conservative σ, and the planner still checks
    each plan's ε by the full accountant. The releases, sensitivities and statistics a plan declares
    do not depend on σ; the PLD search would take minutes over the matrix."""
    import math

    from privacy import accountant as acct

    def sigma(target_epsilon, delta, sample_rate, steps, tolerance=1e-3):
        log_inv = math.log(1.0 / delta)
        root_rho = math.sqrt(log_inv + target_epsilon) - math.sqrt(log_inv)
        return math.sqrt(steps / 2.0) / root_rho

    monkeypatch.setattr(acct, "calibrate_noise_multiplier", sigma)


def _config(tmp_path, method: str, unit: str, selection: str) -> dict:
    from tasks.methods import get_method, registered_methods

    cfg = {"method": method, "experiment": "harness", "seed": 0, "state_dir": str(tmp_path / "state"),
           "allow_nonprivate_baselines": True,
           "data": {"name": "people", "path": str(tmp_path), "labels": LABELS, "holdout_fraction": 0.25,
                    "train_fraction": 0.5,
                    "size_noise_sigma": 5.0, **UNITS[unit]},
           "models": {"local": "tiny-gpt2", "max_length": 24},
           "privacy": {"target_epsilon": 8.0, "target_delta": 1e-4, "dataset_epsilon_cap": 1000.0},
           "methods": {name: get_method(name).traits.test_settings for name in registered_methods()},
           "public": {"name": "tweet_sentiment", "path": str(SHARED / "tweet_sentiment"), "size": 40},
           "mia": {"enabled": False}}
    if SELECTIONS[selection] is not None:
        cfg["selection"] = SELECTIONS[selection]
    return cfg


def check_release(release, cfg, unit: str) -> list[str]:
    """Each declared statistic of ``release`` on D and on each neighbour D′: the violations (empty:
    every one moved by at most the declared sensitivity). Raises when a name is not registered."""
    base = _source(BASE_TRAIN, BASE_TEST)
    problems = []
    for name in release.statistics:
        fn = neighbours.statistic(name)
        assert fn is not None, f"release {release.name} declares the unregistered statistic {name!r}"
        here = fn(base, cfg, KEY)
        for how, other in neighbours_of(unit).items():
            moved = float(np.linalg.norm(fn(other, cfg, KEY) - here, ord=neighbours.norm_of(name)))
            if moved > release.sensitivity + 1e-9:
                problems.append(f"{release.name}/{name}, {how}: moved by {moved:g} > sensitivity {release.sensitivity:g}")
    return problems


def _plan(raw: dict, method: str):
    """(plan, cfg) or (None, the refusal's one line)."""
    from tasks.config import parse_config
    from tasks.data import ReleasedSizes
    from tasks.errors import ConfigError
    from tasks.run_plan import plan_for

    try:
        cfg = parse_config(raw)
        counts = neighbours.released_sizes(_source(BASE_TRAIN, BASE_TEST), cfg, KEY)
        sizes = ReleasedSizes(*(int(c) for c in counts), sigma=cfg.data.size_noise_sigma, unit=cfg.data.privacy_unit)
        return plan_for(cfg, method, sizes), cfg
    except (ConfigError, ValueError) as exc:
        return None, str(exc)


def test_the_added_people_land_in_every_split():
    """The neighbours exercise each branch of the split rule: some added person trains, some is held
    out, some is tested (the person unit's keyed hashes)."""
    from tasks.config import parse_config

    cfg = parse_config(_config_for_split("person"))
    base = neighbours.released_sizes(_source(BASE_TRAIN, BASE_TEST), cfg, KEY)
    moved = {int(np.flatnonzero(neighbours.released_sizes(d, cfg, KEY) - base)[0])
             for how, d in neighbours_of("person").items() if how.startswith("add")}
    assert moved == {0, 1, 2}


def test_splits_of_others_never_move_when_a_neighbour_is_added():
    """One record or person added cannot move another's records between splits (keyed hashes of
    each record, or of each person): asserted on every unit's split rule."""
    from tasks.config import parse_config

    for unit in UNITS:
        cfg = parse_config(_config_for_split(unit))
        before, _ = neighbours.split_rows(_source(BASE_TRAIN, BASE_TEST), cfg, KEY)
        after, _ = neighbours.split_rows(neighbours_of(unit)["add"], cfg, KEY)
        n = len(BASE_TRAIN)
        assert np.array_equal(before.train, after.train[:n]) and np.array_equal(before.holdout, after.holdout[:n])


def _config_for_split(unit: str) -> dict:
    return _config(Path("/nonexistent"), "prompt_dpsgd", unit, "off")


def _selection_method() -> str:
    """The method the default suite runs the selection modes with: the first registered one that
    declares statistics, trains per unit and can be selected (its training reads no holdout; no
    name written here). The selection's own statistic (its holdout counts) does not depend on the
    method; every method's training statistic is checked with selection off, and the full matrix
    runs with -m slow."""
    from tasks.methods import get_method, registered_methods

    return next(m for m in registered_methods() if get_method(m).traits.neighbour_statistics and get_method(m).traits.unit_level
                and not get_method(m).traits.uses_validation)


def _matrix(full: bool) -> list[tuple[str, str, str]]:
    from tasks.methods import registered_methods

    chosen = None if full else _selection_method()
    return [(m, u, s) for m in registered_methods() for u in UNITS for s in SELECTIONS
            if full or s == "off" or m == chosen]


def test_every_method_and_unit_and_the_selection_modes(tmp_path, toy_plugin, fast_calibration, capsys):
    _run_matrix(tmp_path, toy_plugin, capsys, full=False)


@pytest.mark.slow  # every method × unit × selection mode (≈ 2.5 min on 2 busy cores: 45 covered, 85 refused)
def test_the_whole_matrix(tmp_path, toy_plugin, fast_calibration, capsys):
    _run_matrix(tmp_path, toy_plugin, capsys, full=True)


def _run_matrix(tmp_path, toy_plugin, capsys, full: bool):
    from tasks.methods import get_method, registered_methods

    assert toy_plugin in registered_methods()
    covered, refused, uncovered, nondp, problems = [], [], [], [], []
    for method, unit, selection in _matrix(full):
        combo = f"{method} × {unit} × {selection}"
        plan, cfg = _plan(_config(tmp_path, method, unit, selection), method)
        if plan is None:
            assert "\n" not in cfg.strip(), combo  # refused in one line
            refused.append(combo)
            continue
        if plan.guarantee != "dp":
            nondp.append(combo)
            continue
        if not all(r.statistics for r in plan.releases):
            uncovered.append(combo)
            continue
        expected = float(cfg.data.group_size or 1)
        assert {r.sensitivity for r in plan.releases} == {expected}, combo
        for release in plan.releases:
            problems += [f"{combo}: {p}" for p in check_release(release, cfg, unit)]
        covered.append(combo)
    with capsys.disabled():
        print(f"\nneighbour harness ({'full matrix' if full else 'selection modes with ' + _selection_method()}): "
              f"{len(covered)} combinations covered, {len(refused)} refused, "
              f"{len(nondp)} without a dp release, {len(uncovered)} dp but NOT covered "
              f"({sorted({c.split(' × ')[0] for c in uncovered})})")
    assert not problems, problems
    assert covered and any(toy_plugin in c for c in covered)
    assert any("× person" in c and "× every_candidate" in c for c in covered)  # selection × person unit
    assert any("record_charged_per_person" in c for c in covered)
    # a method that declares statistics is covered in every combination it is not refused in
    for combo in uncovered:
        assert not get_method(combo.split(" × ")[0]).traits.neighbour_statistics, combo


def test_a_mechanism_counting_rows_instead_of_people_is_caught(tmp_path, fast_calibration):
    """A test double of DP-SGD's statistic that clips each ROW (ignoring the person unit the plan
    declares) moves by a person's row count: the harness reports it; the real one passes."""
    import torch

    from models.dp_prompt_training import _ClippedSum

    @neighbours.register_statistic("rows_not_people")
    def rows_not_people(source, cfg, key):
        rows = neighbours.training_rows(source, cfg, key)
        grads = torch.zeros((len(rows), 3), dtype=torch.float64)
        grads[:, 0] = 50.0
        out = _ClippedSum(torch.zeros(3, dtype=torch.float64))
        out.add_clipped(grads, 1.0)  # one clipped gradient per row: a person of n rows moves it by n
        return out.summed.numpy()

    try:
        plan, cfg = _plan(_config(tmp_path, "prompt_dpsgd", "person", "off"), "prompt_dpsgd")
        release = plan.release("method")
        assert release.statistics == ("clipped_gradient_sum",) and release.sensitivity == 1.0
        assert check_release(release, cfg, "person") == []
        broken = dataclasses.replace(release, statistics=("rows_not_people",))
        caught = check_release(broken, cfg, "person")
        assert caught and all("rows_not_people" in p for p in caught)
    finally:
        neighbours.unregister_statistic("rows_not_people")


def test_a_dp_release_without_a_checkable_statistic_is_refused(tmp_path, fast_calibration, monkeypatch):
    """A dp method whose release declares no pre-noise statistic (or one nobody registered) is
    refused by the planner — `plan` and `run` alike — in one line: never run unchecked."""
    from tasks.errors import ConfigError
    from tasks.methods import METHODS, get_method

    spec = get_method("prompt_dpsgd")
    for declared, needle in (((), "declares no pre-noise statistic"), (("nobody_registered",), "unregistered")):
        monkeypatch.setitem(METHODS.items, "prompt_dpsgd", dataclasses.replace(
            spec, traits=dataclasses.replace(spec.traits, neighbour_statistics=declared)))
        with pytest.raises(ConfigError, match=needle) as err:
            _plan_or_raise(_config(tmp_path, "prompt_dpsgd", "record", "off"), "prompt_dpsgd")
        assert "\n" not in str(err.value) and "refused" in str(err.value)


def _plan_or_raise(raw: dict, method: str):
    from tasks.config import parse_config
    from tasks.data import ReleasedSizes
    from tasks.run_plan import plan_for

    cfg = parse_config(raw)
    return plan_for(cfg, method, ReleasedSizes(n_train=400, n_holdout=100, n_test=100, sigma=5.0))


def test_rapts_per_person_bound_holds_in_every_split_it_privatizes(tmp_path):
    """RAPT's local bound per person, ``rapt.ldp_eta_tokens_per_unit`` = η·T·k, counts at most T
    privatized text tokens per record and k records per person: on people with more records than
    the cap (in both source splits) and texts far longer than T, the project's own partition and
    RAPT's own encoding privatize at most T·k tokens of any person in every split a run releases
    from (train, holdout, and test: RAPT privatizes it too) — and the heaviest person reaches it."""
    from models import load_backbone
    from tasks.config import parse_config
    from tasks.methods import get_method
    from tasks.methods.rapt.encoding import encode_rapt
    from tasks.methods.rapt.method import text_tokens_per_record, unit_bounds

    raw = _config(tmp_path, "rapt", "person_capped", "off")
    raw["models"] = {"local": "tiny-bert", "max_length": 24}
    cfg = parse_config(raw)
    block = getattr(cfg.methods, "rapt")
    T, k = text_tokens_per_record(cfg, block), cfg.data.max_records_per_unit
    assert unit_bounds(cfg, block)["rapt.ldp_eta_tokens_per_unit"] == pytest.approx(block.eta * T * k)
    long = " ".join(WORDS * 6)  # far more than T tokens
    people = [{"text": f"{long} {u} {j}", "label": LABELS[j % 2], "author": f"p{u}"} for u in range(12) for j in range(6)]
    source = _source(people, [dict(r, text=r["text"] + " t") for r in people[:30]])
    tokenizer = load_backbone("tiny-bert", "cpu").tokenizer
    plain = list(range(1000, 1000 + (block.plain_tokens if block.reconstruction else 0)))
    author = {t: a for part in (source.train, source.test) for t, a in zip(part[0], part[2])}
    _, rows = neighbours.split_rows(source, cfg, KEY)
    heaviest, splits = 0, 0
    for split in (rows.train, rows.holdout, rows.test):
        texts, _, units = split
        if not texts:
            continue
        splits += 1
        per_record = encode_rapt(tokenizer, texts, plain, cfg.models.max_length)["text_mask"].sum(dim=1)
        per_person: dict = {}
        units = units if units is not None else [author[t] for t in texts]  # the test split keeps no unit column
        for unit, n in zip(units, per_record.tolist()):
            per_person[unit] = per_person.get(unit, 0) + n
        assert max(per_person.values()) <= T * k, (max(per_person.values()), T, k)
        heaviest = max(heaviest, max(per_person.values()))
    assert splits == 3 and heaviest == T * k  # every split checked; the bound is reached (not a loose one)
