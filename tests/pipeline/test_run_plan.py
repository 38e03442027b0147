"""One plan, one door (issue 36): a run's plan is a frozen :class:`privacy.plan.RunPlan`, computed
at one place (``tasks.run_plan.plan_for``) by the pure planner of ``privacy/plan.py``, never
written into a config; a selection is a method (``tasks.selected.selected``) that goes through
the lifecycle's door like any other.

* the planner: the budget's division (sizes release at δ/10, the method's share at 9δ/10), the
  group charge, refusals; frozen (the plan, its releases, its settings); planning twice gives equal
  plans; the config is the same object, unchanged, after planning and after a run;
* the method's calibration gets its ε share as an argument (``Method.plan(..., epsilon=share)``);
* no code under tasks/, flows/, privacy/ writes ``target_epsilon`` into a config copy;
* the lifecycle names no selection; each step of its door is a small function; a run with the
  flow's plan does not plan again; a selection run goes through the same door (its ``train`` and
  ``chosen`` are the wrapper's).
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DELTA = 1e-5


def _cfg(tmp_path, method="prompt_dpsgd", **extra):
    from tasks.config import parse_config

    raw = {"method": method, "state_dir": str(tmp_path / "state"),
           "data": {"name": "toy", "path": str(tmp_path), "labels": ["neg", "pos"]},
           "models": {"local": "tiny-bert"}, "privacy": {"target_epsilon": 2.0},
           "methods": {method: {"batch_size": 16, "epochs": 1}}, **extra}
    return parse_config(raw)


def _sizes(sigma=50.0):
    from tasks.data import ReleasedSizes

    return ReleasedSizes(n_train=480, n_holdout=60, n_test=200, sigma=sigma)


# ---- the pure planner --------------------------------------------------------------------------

def _gaussian_calibration(calls):
    """A method whose calibration is one Gaussian at the ε share it is given (closed form)."""
    from types import SimpleNamespace

    from privacy import events as ev
    from privacy import rdp as rdp_lib

    def calibrate(epsilon, delta):
        calls.append((epsilon, delta))
        sigma = rdp_lib.gaussian_sigma_for_epsilon(epsilon, delta) * 1.001
        return SimpleNamespace(method="toy", guarantee="dp", n_train=100, event=ev.GaussianEvent(sigma),
                               params={"toy.sigma": sigma}, settings={"sigma": sigma, "nested": {"k": [1, 2]}},
                               reads_private=True, note="")
    return calibrate


def test_the_planner_divides_the_budget_into_its_releases_and_the_plan_is_frozen():
    from privacy import accountant as acct
    from privacy import events as ev
    from privacy.plan import FrozenMap, RunPlan, plan_run

    calls = []
    sizes = ev.GaussianEvent(50.0)
    plan = plan_run("toy", 2.0, DELTA, 100, _gaussian_calibration(calls), sizes_event=sizes, sizes_sigma=50.0)
    # asked first at the whole budget (its guarantee), then at its share of what the sizes leave
    assert calls[0] == (2.0, DELTA) and calls[1][1] == pytest.approx(0.9 * DELTA)
    eps_sizes = acct.spend(sizes, DELTA / 10).epsilon
    assert [r.name for r in plan.releases] == ["sizes", "method"]
    assert plan.release("sizes").epsilon == eps_sizes and plan.release("sizes").delta == pytest.approx(DELTA / 10)
    assert plan.method_epsilon == pytest.approx(2.0 - eps_sizes) == calls[1][0]
    assert plan.release("method").epsilon == plan.method_epsilon and plan.target_epsilon == 2.0
    assert plan.event == ev.AdaptiveEvent(sizes, plan.release("method").event, 0.1)
    assert plan.params["privacy.size_epsilon"] == eps_sizes
    assert plan.params["privacy.method_epsilon"] == plan.method_epsilon
    assert sum(r.epsilon for r in plan.releases) <= 2.0 * (1 + 1e-9)
    # the guarantee: the sizes release and the method by basic composition, which the ledger charges too
    method_eps = acct.spend(plan.release("method").event, 0.9 * DELTA).epsilon
    assert plan.guarantee_epsilon == pytest.approx(eps_sizes + method_eps) and plan.guarantee_epsilon <= 2.0
    assert acct.spend(plan.event, DELTA).epsilon == pytest.approx(plan.guarantee_epsilon, rel=1e-12)
    # frozen: the plan, its releases, its params and (nested) settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.method_epsilon = 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.releases[0].epsilon = 0.0
    with pytest.raises(TypeError):
        plan.params["privacy.method_epsilon"] = 3.0  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.settings["nested"]["k"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.settings.update({"sigma": 1.0})  # type: ignore[attr-defined]
    assert isinstance(plan.settings["nested"], FrozenMap) and plan.settings["nested"]["k"] == (1, 2)
    # planning twice: equal plans (and equal hashes); a plan pickles (a Prefect task's input)
    again = plan_run("toy", 2.0, DELTA, 100, _gaussian_calibration([]), sizes_event=sizes, sizes_sigma=50.0)
    assert again == plan and hash(again.params) == hash(plan.params)
    assert pickle.loads(pickle.dumps(plan)) == plan and isinstance(plan, RunPlan)


class _Sampled:
    """A calibration of DP-SGD-like steps: Poisson-subsampled Gaussians, σ chosen for the share."""

    method, guarantee, n_train, reads_private, note, settings = "toy", "dp", 100, True, "", {}

    def __init__(self, epsilon, delta):
        from privacy import events as ev
        from privacy.accountant import calibrate_noise_multiplier

        self.event = ev.dpsgd_event(0.1, calibrate_noise_multiplier(epsilon, delta, 0.1, 5), 5)
        self.params = {}


@pytest.mark.slow  # suite time: the exact group charges are checked by tests/accounting/test_group_exact.py
def test_the_planner_charges_a_person_by_group_privacy_and_refuses_what_it_cannot_plan():
    from privacy import events as ev
    from privacy.group import group_event
    from privacy.plan import PlanError, plan_run

    sizes = ev.GaussianEvent(50.0)
    plan = plan_run("toy", 2.0, DELTA, 100, _gaussian_calibration([]), sizes_event=sizes, sizes_sigma=50.0,
                    group_size=3, person_field="author")
    assert plan.record_event == ev.AdaptiveEvent(sizes, plan.release("method").event, 0.1)
    assert plan.event == group_event(plan.record_event, 3) and plan.params["privacy.group_size"] == 3
    assert plan.params["privacy.group_accounting"] == "exact"  # Gaussians only: σ/k is exact
    sampled = plan_run("toy", 2.0, DELTA, 100, lambda e, d: _Sampled(e, d), sizes_event=sizes, sizes_sigma=50.0,
                       group_size=3, person_field="author")
    assert sampled.params["privacy.group_accounting"] == "exact_mixture"  # DP-SGD steps: the exact mixture
    assert {(r.sensitivity, r.unit) for r in plan.releases} == {(3.0, "author")}
    # what a training realised is charged by the same rule
    method_event = plan.release("method").event
    assert plan.charged(method_event) == (plan.event, plan.record_event)
    with pytest.raises(PlanError, match="leaves nothing for the method"):
        plan_run("toy", 2.0, DELTA, 100, _gaussian_calibration([]), sizes_event=ev.GaussianEvent(0.5),
                 sizes_sigma=0.5)

    def missing(epsilon, delta):  # a calibration that misses its share
        out = _gaussian_calibration([])(epsilon, delta)
        return dataclasses.replace(_as_plan(out), event=ev.GaussianEvent(out.event.noise_multiplier / 2))

    with pytest.raises(PlanError, match="a calibration that misses its"):
        plan_run("toy", 2.0, DELTA, 100, missing, sizes_event=sizes, sizes_sigma=50.0)


def _as_plan(ns):
    from tasks.methods.base import MethodPlan

    return MethodPlan(ns.method, ns.guarantee, ns.n_train, 0.0, event=ns.event, params=dict(ns.params),
                      settings=dict(ns.settings))


def test_a_plan_without_a_dp_claim_has_no_releases(tmp_path):
    from tasks.run_plan import plan_for

    cfg = _cfg(tmp_path, allow_nonprivate_baselines=True,
               methods={"prompt_dpsgd": {"batch_size": 16, "epochs": 1}, "prompt_sgd": {"enabled": True}})
    plan = plan_for(cfg, "prompt_sgd", _sizes(), DELTA)
    assert plan.guarantee == "none" and plan.releases == () and plan.event is None
    assert plan.method_epsilon is None and plan.target_epsilon is None


@pytest.mark.slow  # suite time (11-30 s): runs with -m slow
def test_plan_for_gives_the_method_its_share_and_leaves_the_config_as_it_was(tmp_path, monkeypatch):
    from tasks.methods import get_method
    from tasks.run_plan import plan_for

    cfg = _cfg(tmp_path)
    before = cfg.model_dump()
    method_cls = type(get_method("prompt_dpsgd").mechanism)
    real, asked = method_cls.plan, []

    def plan(self, c, n_train, delta, epsilon=None):
        asked.append((c is cfg, c.privacy.target_epsilon, epsilon))
        return real(self, c, n_train, delta, epsilon=epsilon)

    monkeypatch.setattr(method_cls, "plan", plan)
    first = plan_for(cfg, "prompt_dpsgd", _sizes(), DELTA)
    assert cfg.model_dump() == before
    # the user's config every time (never a copy with a derived target); the shares as arguments: the
    # whole target first (is it dp?), the additive share, then the joint calibration's raised ones
    assert all(mine and target == 2.0 for mine, target, _ in asked) and asked[0][2] == 2.0
    shares = [share for _, _, share in asked[1:]]
    assert first.method_epsilon in shares and shares[0] < first.method_epsilon == max(
        s for s in shares if s <= first.method_epsilon)
    assert first == plan_for(cfg, "prompt_dpsgd", _sizes(), DELTA) and cfg.model_dump() == before
    # another budget (the largest-fitting search) is an argument too
    lower = plan_for(cfg, "prompt_dpsgd", _sizes(), DELTA, target_epsilon=1.0)
    assert lower.target_epsilon == 1.0 and lower.method_epsilon < first.method_epsilon
    assert cfg.model_dump() == before


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_selection_is_planned_through_its_wrapper_with_each_trial_at_its_target(tmp_path):
    from privacy import accountant as acct
    from privacy.plan import with_size_release
    from tasks.methods import get_method
    from tasks.run_plan import plan_for, runner
    from tasks.selected import Selection

    cfg = _cfg(tmp_path, selection={"enabled": True, "candidates": [{"lr": 0.05}, {"lr": 0.2}],
                                    "mode": "every_candidate"})
    before = cfg.model_dump()
    wrapped = runner(cfg, "prompt_dpsgd")
    assert isinstance(wrapped.mechanism, Selection) and wrapped.mechanism.method is get_method("prompt_dpsgd")
    assert not isinstance(runner(cfg, "zero_shot").mechanism, Selection)  # the published method only
    plan = plan_for(cfg, "prompt_dpsgd", _sizes(), DELTA)
    assert cfg.model_dump() == before and plan == plan_for(cfg, "prompt_dpsgd", _sizes(), DELTA)
    info = plan.settings["selection"]
    assert plan.params["selection.trial_target_epsilon"] == info["trial_target"] < plan.method_epsilon
    assert [r.name for r in plan.releases] == ["sizes", "selection"] and plan.own.epsilon == plan.method_epsilon
    assert plan.event == with_size_release(plan.own.event, plan.sizes_event)  # the whole mechanism, with the sizes
    assert acct.spend(plan.event, DELTA).epsilon <= cfg.privacy.target_epsilon * (1 + 1e-6)
    # each trial: the method's own plan of the candidate's settings, at the per-trial target
    trial = get_method("prompt_dpsgd").mechanism.plan(cfg, 480, info["delta"], epsilon=info["trial_target"])
    assert acct.spend(trial.event, info["delta"]).epsilon <= info["trial_target"] * (1 + 1e-6)
    assert [c["name"] for c in info["candidates"]] == ["lr=0.05", "lr=0.2", "no prompt"]


# ---- nothing writes a derived value into a config ------------------------------------------------

def _sources():
    for package in ("tasks", "flows", "privacy", "privprompt_commands"):
        yield from sorted((REPO / package).rglob("*.py"))
    for script in ("privprompt_cli.py", "privprompt_worker.py"):
        yield REPO / script


def test_no_code_writes_target_epsilon_into_a_config():
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "model_copy":
                if "target_epsilon" in ast.unparse(node):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}")
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "target_epsilon":
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: assigns .target_epsilon")
    assert offenders == []


def test_the_plan_is_computed_at_one_place():
    """Only ``tasks/run_plan.py`` calls the planner; every other caller goes through ``plan_for``."""
    callers = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name == "plan_run" and "pplan" in ast.unparse(node.func):
                    callers.append(str(path.relative_to(REPO)))
    assert callers == ["tasks/run_plan.py"]
    assert "sized_plan" not in (REPO / "tasks" / "lifecycle.py").read_text()


# ---- the door ----------------------------------------------------------------------------------

DOOR = ("run_method", "open_door", "reserve", "run_releases", "store", "commit", "publish", "write_outputs")


def test_the_lifecycle_is_a_short_door_that_names_no_selection():
    source = (REPO / "tasks" / "lifecycle.py").read_text()
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in DOOR:
        node = functions[name]
        assert node.end_lineno - node.lineno + 1 < 60, name
    imported = {alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for alias in n.names}
    assert "selection" not in imported and "selection." not in source.replace("selection.log", "")


@pytest.fixture
def ran(tmp_path, sst2_dir, monkeypatch):
    """One prompt_dpsgd run on tiny-bert through the door with the flow's plan."""
    from tests.claims.test_release_once import _context

    from tasks import lifecycle
    from tasks.run_plan import plan_for

    ctx = _context(tmp_path, sst2_dir)
    cfg = ctx.cfg
    before = cfg.model_dump()
    plan = plan_for(cfg, "prompt_dpsgd", ctx.part.sizes)

    def again(*args, **kwargs):
        raise AssertionError("the lifecycle planned again")

    monkeypatch.setattr(lifecycle, "plan_for", again)
    steps = []
    for step in ("reserve", "run_releases", "store", "commit", "publish"):
        real = getattr(lifecycle, step)
        monkeypatch.setattr(lifecycle, step, (lambda real, step: lambda *a, **k: steps.append(step) or real(*a, **k))(
            real, step))
    out = lifecycle.run_method(ctx, "prompt_dpsgd", {}, plan=plan)
    return {"ctx": ctx, "cfg": cfg, "before": before, "plan": plan, "out": out, "steps": steps}


def test_a_run_with_the_flows_plan_goes_through_the_door_and_leaves_the_config_unchanged(ran):
    from privacy import accountant as acct

    assert ran["steps"] == ["reserve", "run_releases", "store", "commit", "publish"]
    assert ran["cfg"].model_dump() == ran["before"]
    out, plan = ran["out"], ran["plan"]
    assert out.params["privacy.method_epsilon"] == plan.method_epsilon  # the plan's params, as planned
    assert out.spend["epsilon"] <= acct.spend(plan.event, plan.delta).epsilon * (1 + 1e-9)


def test_a_selection_goes_through_the_same_door(tmp_path, sst2_dir, monkeypatch):
    """The wrapper's ``train`` runs where any method's does, its ``chosen`` names the winner on the
    run record; reserve, store, commit, publish are the same steps (a stand-in for the trials:
    the mechanism's planned event, no prompt published)."""
    from tests.claims.test_release_once import _context

    from tasks import lifecycle
    from tasks.methods.base import Trained
    from tasks.selected import Selection

    ctx = _context(tmp_path, sst2_dir, selection={"enabled": True, "candidates": [{"lr": 0.05}],
                                                  "mode": "every_candidate"})
    seen = []

    def train(self, mctx, plan, rows, progress=None):
        seen.append(("train", type(self).__name__, len(rows.validation) > 0))
        return Trained(None, plan.release("selection").event, 0, {"selection.winner_index": 1.0})

    monkeypatch.setattr(Selection, "train", train)
    for step in ("reserve", "store", "commit", "publish"):
        real = getattr(lifecycle, step)
        monkeypatch.setattr(lifecycle, step, (lambda real, step: lambda *a, **k: seen.append(step) or real(*a, **k))(
            real, step))
    out = lifecycle.run_method(ctx, "prompt_dpsgd", {})
    assert seen == ["reserve", ("train", "Selection", True), "store", "commit", "publish"]
    assert out.params["selection.winner"] == "no prompt" and out.prompt_path is None
    assert out.spend is not None and out.guarantee == "dp"


def test_a_plan_handed_to_another_method_is_refused_before_anything_is_reserved(tmp_path, sst2_dir):
    """The door trusts the flow's plan only for the method it was made for (review F2)."""
    from tests.claims.test_release_once import _context

    from privacy.ledger import Ledger
    from tasks.lifecycle import run_method
    from tasks.run_plan import plan_for

    ctx = _context(tmp_path, sst2_dir)
    other = plan_for(ctx.cfg, "zero_shot", ctx.part.sizes)
    with pytest.raises(ValueError, match="handed the plan of 'zero_shot'"):
        run_method(ctx, "prompt_dpsgd", {}, plan=other)
    assert not ctx.paths.ledger.exists() or Ledger(ctx.paths.ledger).entries() == []


def test_whether_a_run_reads_private_rows_is_the_methods_trait_not_its_plans_say(tmp_path, monkeypatch):
    """The door skips the reservation of a plan that reads no private rows: that flag comes from the
    method's declared ``Traits.reads_private`` alone, whatever its mechanism's plan says."""
    import dataclasses

    from tasks.methods import get_method
    from tasks.run_plan import plan_for

    mechanism = type(get_method("prompt_dpsgd").mechanism)
    real = mechanism.plan
    monkeypatch.setattr(mechanism, "plan", lambda self, *a, **k: dataclasses.replace(real(self, *a, **k),
                                                                                      reads_private=False))
    assert plan_for(_cfg(tmp_path), "prompt_dpsgd", _sizes(), DELTA).reads_private is True
    zero = type(get_method("zero_shot").mechanism)
    real_zero = zero.plan
    monkeypatch.setattr(zero, "plan", lambda self, *a, **k: dataclasses.replace(real_zero(self, *a, **k),
                                                                                 reads_private=True))
    raw = {"method": "zero_shot", "state_dir": str(tmp_path / "state"),
           "data": {"name": "toy", "path": str(tmp_path), "labels": ["neg", "pos"]}, "models": {"local": "tiny-bert"}}
    from tasks.config import parse_config

    assert plan_for(parse_config(raw), "zero_shot", _sizes(), DELTA).reads_private is False


def test_with_the_comparison_the_method_and_it_are_calibrated_together_to_the_target():
    """The additive split leaves the PLD composition of the method and the comparison below what
    is left after the sizes release; the planner raises the method's share until the two, composed
    at 9δ/10, spend it, so the guarantee (sizes by basic composition) meets the target from below."""
    from privacy import accountant as acct
    from privacy import events as ev
    from privacy.plan import JOINT_TOLERANCE, plan_run

    sizes = ev.GaussianEvent(50.0)
    plan = plan_run("toy", 2.0, DELTA, 100, lambda e, d: _Sampled(e, d), sizes_event=sizes, sizes_sigma=50.0,
                    no_prompt_share=0.1, always_dp=True)
    eps_sizes = plan.release("sizes").epsilon
    method, comparison = plan.release("method"), plan.no_prompt
    assert method.delta == pytest.approx(0.8 * DELTA) and comparison.delta == pytest.approx(0.1 * DELTA)
    assert plan.method_epsilon > 2.0 - eps_sizes - comparison.epsilon  # raised above the additive share
    together = acct.spend(ev.ComposedEvent((method.event, comparison.event)), 0.9 * DELTA).epsilon
    assert plan.guarantee_epsilon == pytest.approx(eps_sizes + together)
    assert 2.0 * (1 - JOINT_TOLERANCE) <= plan.guarantee_epsilon <= 2.0
    assert plan.params["privacy.guarantee_epsilon"] == plan.guarantee_epsilon
    assert acct.spend(plan.event, DELTA).epsilon <= plan.guarantee_epsilon  # the ledger's: tighter
    # the method alone at its share is what its calibration was asked
    assert acct.spend(method.event, 0.8 * DELTA).epsilon <= method.epsilon * (1 + 1e-6)
