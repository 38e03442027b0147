"""A reservation admitted on the RDP bound: the bound never lies below the ledger's exact ε, the
decision is the exact composition's, and the composed ε a reservation reports is the exact one."""

from __future__ import annotations

import itertools
import multiprocessing as mp

import pytest

from privacy import events as ev
from privacy.accountant import spend
from privacy.ledger import BudgetExceededError, Ledger
from privacy.ledger.common import _bound, _compose

FP = "c4d2" + "3" * 60
DELTA = 1e-5

RUN = ev.AdaptiveEvent(ev.GaussianEvent(50.0), ev.dpsgd_event(0.01, 1.0, 100))  # a run: sizes, then DP-SGD
EVENTS = {
    "gaussian": ev.GaussianEvent(3.0),
    "dpsgd": ev.dpsgd_event(0.02, 1.1, 60),
    "run": RUN,
    "parallel": ev.ParallelEvent((ev.dpsgd_event(0.01, 1.0, 50), ev.ExponentialEvent(0.5))),
    "exponential": ev.ExponentialEvent(0.4),
    "group mixture": ev.SelfComposedEvent(ev.binomial_mixture(0.01, 1.2, 3), 40),
    "selection": ev.RepeatAndSelectEvent((ev.GaussianEvent(2.0),), "poisson", mu=3.0),
    "subsampled limited domain": ev.SelfComposedEvent(ev.PoissonSampledEvent(0.1, ev.LimitedDomainEvent(0.5, 1e-8)), 5),
}


def _texts(*names: str) -> list[str]:
    return [ev.event_to_json(EVENTS[n]) for n in names]


@pytest.mark.parametrize("names", [*([n] for n in EVENTS), *itertools.combinations(EVENTS, 2),
                                   ["run", "run", "dpsgd", "gaussian", "exponential", "exponential"]],
                         ids=lambda names: "+".join(names))
def test_the_bound_is_never_below_the_exact_composition(names):
    texts = _texts(*names)
    exact = _compose(texts, DELTA).epsilon
    bound = _bound(texts, DELTA)
    if "subsampled limited domain" in names:
        assert bound is None  # RDP proves nothing there: the exact composition decides
    else:
        assert bound is not None and bound >= exact - 1e-12


def _exact(*events) -> float:
    return spend(ev.ComposedEvent(tuple(events)), DELTA).epsilon


def test_a_reservation_on_the_bound_reports_the_exact_composition(tmp_path):
    led = Ledger(tmp_path / "ledger.sqlite")
    led.register_dataset(FP, "reviews", 100.0, DELTA)
    led.reserve(FP, "a", RUN)
    r = led.reserve(FP, "b", EVENTS["dpsgd"])
    assert r.spent_epsilon == pytest.approx(_exact(RUN, EVENTS["dpsgd"]), rel=1e-12)
    assert r.remaining_epsilon == pytest.approx(100.0 - r.spent_epsilon)
    detail = led.trail(FP, "b")[0]["detail"]
    assert "spent_epsilon" not in detail and detail["spent_epsilon_at_most"] >= r.spent_epsilon
    assert led.spent(FP).epsilon == pytest.approx(r.spent_epsilon, rel=1e-12)


def test_between_the_exact_composition_and_the_bound_the_exact_one_decides(tmp_path):
    exact = _exact(RUN, RUN)
    bound = _bound(_texts("run", "run"), DELTA)
    assert bound > exact * 1.01  # room for a cap between them
    led = Ledger(tmp_path / "ledger.sqlite")
    led.register_dataset(FP, "reviews", exact * 1.001, DELTA)  # two runs fit, a third does not
    led.reserve(FP, "a", RUN)
    r = led.reserve(FP, "b", RUN)  # over the bound, within the cap: admitted by the exact composition
    assert r.spent_epsilon == pytest.approx(exact, rel=1e-12)
    assert led.trail(FP, "b")[0]["detail"]["spent_epsilon"] == pytest.approx(exact, rel=1e-12)
    with pytest.raises(BudgetExceededError):
        led.reserve(FP, "c", RUN)
    assert [e["run_id"] for e in led.entries(FP)] == ["a", "b"]


def test_a_raised_delta_keeps_what_was_spent_on_the_bound(tmp_path):
    """A raised δ holds the spent ε at what it was (the floor): a reservation admitted on the bound
    reports and states no less."""
    led = Ledger(tmp_path / "ledger.sqlite")
    led.register_dataset(FP, "reviews", 100.0, DELTA)
    led.reserve(FP, "a", RUN)
    led.commit("a", RUN)
    before = led.spent(FP).epsilon
    led.change_delta(FP, DELTA * 100, reason="test", allow_raise=True)
    assert _compose(_texts("run"), DELTA * 100).epsilon < before  # the floor is what holds it
    r = led.reserve(FP, "b", ev.GaussianEvent(400.0))
    assert r.spent_epsilon == pytest.approx(before, rel=1e-12)
    assert led.trail(FP, "b")[0]["detail"]["spent_epsilon_at_most"] >= before


def _reserve_in_child(ledger: Ledger, run_id: str, queue) -> None:
    try:
        queue.put(ledger.reserve(FP, run_id, EVENTS["gaussian"]).new)
    except Exception as exc:  # noqa: BLE001 - the parent's assertion shows it
        queue.put(repr(exc))


def test_a_forked_child_opens_its_own_connection(tmp_path):
    led = Ledger(tmp_path / "ledger.sqlite")
    led.register_dataset(FP, "reviews", 100.0, DELTA)
    led.reserve(FP, "parent", EVENTS["gaussian"])  # the parent's engine holds a connection now
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_reserve_in_child, args=(led, "child", queue))
    child.start()
    assert queue.get(timeout=60) is True
    child.join(timeout=60)
    led.reserve(FP, "parent again", EVENTS["gaussian"])  # the parent's connection still works
    assert [e["run_id"] for e in led.entries(FP)] == ["parent", "child", "parent again"]


_FORK_SCRIPT = r'''
import os, sys, time
sys.path.insert(0, {repo!r})
from privacy import events as ev
from privacy.ledger import Ledger
D, FP = {folder!r}, "ab" * 32
led = Ledger(D + "/ledger.sqlite")
led.register_dataset(FP, "x", 1000.0, 1e-5)
led.reserve(FP, "p1", ev.GaussianEvent(30.0))  # the parent holds a pooled connection now
if os.fork() == 0:
    led.reserve(FP, "c1", ev.GaussianEvent(30.0))
    open(D + "/c1", "w").close()
    while not os.path.exists(D + "/go"):
        time.sleep(0.02)
    led.reserve(FP, "c2", ev.GaussianEvent(30.0))
    open(D + "/done", "w").close()
    os._exit(0)
while not os.path.exists(D + "/c1"):
    time.sleep(0.02)
'''


def test_a_reservation_in_a_forked_child_survives_its_parent_ending(tmp_path):
    """No open SQLite connection crosses a fork: a child's reservations stay written after the
    parent ends and another process opens and closes the ledger (its last connection checkpoints)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", _FORK_SCRIPT.format(repo=repo, folder=str(tmp_path))], check=True, timeout=120)
    reader = (f"import sys; sys.path.insert(0, {repo!r}); from privacy.ledger import Ledger; "
              f"print(' '.join(e['run_id'] for e in Ledger({str(tmp_path / 'ledger.sqlite')!r}).entries('{'ab' * 32}')))")
    assert subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, check=True,
                          timeout=120).stdout.split() == ["p1", "c1"]
    (tmp_path / "go").touch()
    deadline = time.monotonic() + 60
    while not (tmp_path / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, check=True,
                          timeout=120).stdout.split() == ["p1", "c1", "c2"]


def test_a_replaced_accountant_turns_the_bound_off(tmp_path, monkeypatch):
    """The bound compares the built-in accountants' answers: a plugin registered under either name
    (here one that states twice the default's ε) leaves every decision to the exact composition."""
    import dataclasses

    from privacy import accountants

    class Pessimist(accountants.MinPldRdp):
        def spend(self, event, delta, discretization=accountants.DISCRETIZATION):
            return dataclasses.replace(super().spend(event, delta, discretization),
                                       epsilon=2 * super().spend(event, delta, discretization).epsilon)

    event = ev.GaussianEvent(5.0)
    monkeypatch.setitem(accountants._ACCOUNTANTS, "min_pld_rdp", Pessimist)
    accountants.cached_spend.cache_clear()
    try:
        exact, rdp = spend(event, DELTA).epsilon, accountants.create_accountant("rdp").spend(event, DELTA).epsilon
        assert rdp < exact
        assert _bound(_texts("gaussian"), DELTA) is None
        led = Ledger(tmp_path / "ledger.sqlite")
        led.register_dataset(FP, "reviews", (exact + rdp) / 2, DELTA)
        with pytest.raises(BudgetExceededError):
            led.reserve(FP, "a", event)
    finally:
        accountants.cached_spend.cache_clear()
