"""Tests of the persistent privacy budget ledger (privacy/ledger/)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from privacy import events as ev
from privacy.accountant import spend
from privacy.ledger import BudgetExceededError, Ledger, Reservation, UnknownDatasetError, UnknownRunError

REPO = Path(__file__).resolve().parents[2]
FP = "a3f1" + "0" * 60          # a sha256-like fingerprint
FP2 = "b7c2" + "1" * 60
DELTA = 1e-5


# Cheap events: exponential mechanisms compose almost additively at small counts, so caps can be
# placed between k and k+1 runs. DP-SGD events for the sub-additivity checks.
EXP = ev.ExponentialEvent(0.5)                      # ε ≈ 0.503 alone at δ=1e-5
DPSGD = ev.dpsgd_event(0.01, 1.0, 100)


def eps(event, delta=DELTA) -> float:
    return spend(ev.ComposedEvent((event,)), delta).epsilon


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "nested" / "dir" / "ledger.db")
    led.register_dataset(FP, "sst2", 8.0, DELTA)
    return led


# ---- basic life cycle -----------------------------------------------------------------------

def test_creates_directory_and_uses_wal(tmp_path):
    path = tmp_path / "a" / "b" / "ledger.sqlite"
    Ledger(path)
    assert path.exists()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        conn.close()


def test_reserve_commit_composes_not_adds(ledger):
    a = ev.dpsgd_event(0.01, 1.0, 100)
    b = ev.dpsgd_event(0.02, 1.2, 80)
    r1 = ledger.reserve(FP, "run-1", a, description="dpsgd sst2 seed 0")
    assert isinstance(r1, Reservation) and r1.new and r1.status == "reserved"
    assert r1.epsilon == pytest.approx(eps(a))
    assert ledger.spent(FP).epsilon == pytest.approx(eps(a))

    r2 = ledger.reserve(FP, "run-2", b)
    expected = spend(ev.ComposedEvent((a, b)), DELTA)
    assert r2.spent_epsilon == pytest.approx(expected.epsilon)
    assert ledger.spent(FP).epsilon == pytest.approx(expected.epsilon)
    # composition, not the sum of the parts' ε
    assert expected.epsilon < eps(a) + eps(b) - 0.1
    assert ledger.remaining(FP) == pytest.approx(8.0 - expected.epsilon)

    # early stop: commit less than reserved; the committed event replaces the reserved one
    a_actual = ev.dpsgd_event(0.01, 1.0, 40)
    row = ledger.commit("run-1", a_actual)
    assert row["status"] == "committed"
    assert row["epsilon"] == pytest.approx(eps(a_actual)) and row["epsilon"] < r1.epsilon
    assert ev.event_from_dict(row["event"]) == a_actual
    after = spend(ev.ComposedEvent((a_actual, b)), DELTA).epsilon
    assert ledger.spent(FP).epsilon == pytest.approx(after)
    assert after < expected.epsilon

    rows = {e["run_id"]: e for e in ledger.entries(FP)}
    assert rows["run-1"]["status"] == "committed" and rows["run-2"]["status"] == "reserved"
    assert ev.event_from_dict(rows["run-2"]["event"]) == b
    assert rows["run-1"]["description"] == "dpsgd sst2 seed 0"
    assert rows["run-1"]["created_at"] and rows["run-1"]["committed_at"]
    assert rows["run-2"]["committed_at"] is None
    # committing the same event again is a no-op (retry)
    assert ledger.commit("run-1", a_actual)["epsilon"] == pytest.approx(eps(a_actual))


def test_commit_rejects_more_than_reserved_but_keeps_the_spend(ledger):
    ledger.reserve(FP, "r", ev.ExponentialEvent(0.2))
    bigger = ev.ExponentialEvent(0.4)
    with pytest.raises(ValueError, match="reserved only"):
        ledger.commit("r", bigger)
    # what was spent stays spent: the ledger counts the larger, actual event
    assert ledger.spent(FP).epsilon == pytest.approx(eps(bigger))
    assert ledger.entries(FP)[0]["over_reservation"] is True
    with pytest.raises(ValueError, match="reserved only"):   # a retry reports it again
        ledger.commit("r", bigger)
    with pytest.raises(ValueError, match="different event"):
        ledger.commit("r", ev.ExponentialEvent(0.1))


# ---- refusal ----------------------------------------------------------------------------------

def test_refusal_states_remaining_and_records_nothing(tmp_path):
    led = Ledger(tmp_path / "l.db")
    led.register_dataset(FP, "sst2", 1.0, DELTA)
    led.reserve(FP, "small", ev.ExponentialEvent(0.2))
    spent_before = led.spent(FP).epsilon
    remaining = led.remaining(FP)
    assert remaining == pytest.approx(1.0 - spent_before) and 0 < remaining < 1.0

    big = ev.dpsgd_event(0.01, 1.0, 1000)
    assert eps(big) > remaining
    with pytest.raises(BudgetExceededError) as info:
        led.reserve(FP, "big", big)
    err = info.value
    assert isinstance(err, ValueError)
    msg = str(err)
    assert f"remaining ε={remaining:.4f}" in msg
    assert f"this run needs ε={eps(big):.4f}" in msg
    assert f"already spent ε={spent_before:.4f}" in msg and "cap ε=1.0000" in msg
    assert "'sst2'" in msg and FP[:12] in msg
    assert err.remaining == pytest.approx(remaining) and err.cap == 1.0
    # nothing recorded for the refused run
    assert [e["run_id"] for e in led.entries(FP)] == ["small"]
    assert led.spent(FP).epsilon == pytest.approx(spent_before)
    with pytest.raises(UnknownRunError):
        led.commit("big", big)


def test_exact_fit_between_k_and_k_plus_1_runs(tmp_path):
    led = Ledger(tmp_path / "l.db")
    two = spend(ev.ComposedEvent((EXP, EXP)), DELTA).epsilon
    three = spend(ev.ComposedEvent((EXP,) * 3), DELTA).epsilon
    led.register_dataset(FP, "d", (two + three) / 2, DELTA)
    led.reserve(FP, "1", EXP)
    led.reserve(FP, "2", EXP)
    with pytest.raises(BudgetExceededError):
        led.reserve(FP, "3", EXP)
    assert led.spent(FP).epsilon == pytest.approx(two)


# ---- crash between reserve and commit ----------------------------------------------------------

def test_crash_between_reserve_and_commit_keeps_reservation(ledger):
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from privacy.ledger import Ledger\n"
        "from privacy import events as ev\n"
        f"led = Ledger({str(ledger.path)!r})\n"
        f"led.reserve({FP!r}, 'crashing-run', ev.dpsgd_event(0.01, 1.0, 100), 'will crash')\n"
        "os._exit(1)  # dies after touching the data, before commit\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    (row,) = ledger.entries(FP)
    assert row["run_id"] == "crashing-run" and row["status"] == "reserved"
    assert ledger.spent(FP).epsilon == pytest.approx(eps(DPSGD))
    assert ledger.remaining(FP) == pytest.approx(8.0 - eps(DPSGD))
    # the next run is composed with the crashed run's reservation
    r = ledger.reserve(FP, "next-run", EXP)
    assert r.spent_epsilon == pytest.approx(spend(ev.ComposedEvent((DPSGD, EXP)), DELTA).epsilon)


def test_abort_only_frees_runs_that_never_touched_data(ledger):
    ledger.reserve(FP, "bad-config", EXP)
    with pytest.raises(ValueError, match="reason"):
        ledger.abort("bad-config", "")
    row = ledger.abort("bad-config", "config validation failed before loading data")
    assert row["status"] == "aborted" and row["epsilon"] == 0.0
    assert ledger.spent(FP).epsilon == 0.0
    assert ledger.abort("bad-config", "again")["status"] == "aborted"   # idempotent
    with pytest.raises(ValueError, match="aborted"):
        ledger.commit("bad-config", EXP)
    # a committed spend can never be undone
    ledger.reserve(FP, "done", EXP)
    ledger.commit("done", EXP)
    with pytest.raises(ValueError, match="committed"):
        ledger.abort("done", "oops")
    assert ledger.spent(FP).epsilon == pytest.approx(eps(EXP))
    # re-reserving an aborted run id charges again (with a budget check)
    r = ledger.reserve(FP, "bad-config", EXP)
    assert r.new and r.status == "reserved"
    assert ledger.spent(FP).epsilon == pytest.approx(spend(ev.ComposedEvent((EXP, EXP)), DELTA).epsilon)


# ---- concurrency ----------------------------------------------------------------------------------

def _concurrent_reserver(path: str, fresh_path: str, fingerprint: str, run_id: str, barrier, results
                         ) -> None:
    from privacy import events as ev_
    from privacy.ledger import BudgetExceededError as Refused, Ledger as Ledger_

    try:
        barrier.wait(timeout=120)
        Ledger_(fresh_path)                   # all processes create one new ledger file at once
        barrier.wait(timeout=120)
        led = Ledger_(path)
        led.reserve(fingerprint, run_id, ev_.ExponentialEvent(0.5))
        results.put((run_id, "ok"))
    except Refused:
        results.put((run_id, "refused"))
    except Exception as exc:  # reported to the parent
        results.put((run_id, f"error: {exc!r}"))


def test_concurrent_reservations_never_overspend(tmp_path):
    led = Ledger(tmp_path / "shared" / "ledger.db")
    one = eps(EXP)
    cap = one / 0.4                       # each run costs ~40% of the cap
    two = spend(ev.ComposedEvent((EXP, EXP)), DELTA).epsilon
    three = spend(ev.ComposedEvent((EXP,) * 3), DELTA).epsilon
    assert two <= cap < three             # exactly two runs fit (exponential events compose ~additively)
    led.register_dataset(FP, "sst2", cap, DELTA)

    ctx = mp.get_context("spawn")
    n = 4
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    fresh = tmp_path / "fresh" / "new.db"
    procs = [ctx.Process(target=_concurrent_reserver,
                         args=(str(led.path), str(fresh), FP, f"run-{i}", barrier, results))
             for i in range(n)]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=120) for _ in range(n))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(v in ("ok", "refused") for v in outcomes.values()), outcomes
    succeeded = [k for k, v in outcomes.items() if v == "ok"]
    assert len(succeeded) <= 2
    assert len(succeeded) == 2            # the budget for two was there, and was used
    assert led.spent(FP).epsilon <= cap
    assert led.spent(FP).epsilon == pytest.approx(two)
    assert sorted(e["run_id"] for e in led.entries(FP)) == sorted(succeeded)
    assert Ledger(fresh).datasets() == []


# ---- idempotency -----------------------------------------------------------------------------------

def test_idempotent_reserve(ledger):
    r1 = ledger.reserve(FP, "retry-me", DPSGD)
    r2 = ledger.reserve(FP, "retry-me", ev.dpsgd_event(0.01, 1.0, 100))   # equal event, new object
    assert r1.new and not r2.new
    assert r2.epsilon == pytest.approx(r1.epsilon)
    assert len(ledger.entries(FP)) == 1
    assert ledger.spent(FP).epsilon == pytest.approx(eps(DPSGD))
    with pytest.raises(ValueError, match="different event"):
        ledger.reserve(FP, "retry-me", ev.dpsgd_event(0.01, 1.0, 101))
    ledger.register_dataset(FP2, "other", 8.0, DELTA)
    with pytest.raises(ValueError, match="another dataset"):
        ledger.reserve(FP2, "retry-me", DPSGD)
    # after commit, a retried reserve still returns the (committed) entry and charges nothing
    ledger.commit("retry-me", ev.dpsgd_event(0.01, 1.0, 50))
    r3 = ledger.reserve(FP, "retry-me", DPSGD)
    assert not r3.new and r3.status == "committed"
    assert len(ledger.entries(FP)) == 1


# ---- non-private uses ----------------------------------------------------------------------------

def test_nonprivate_uses_listed_not_composed(ledger):
    ledger.reserve(FP, "dp-run", EXP)
    before = ledger.spent(FP).epsilon
    row = ledger.record_nonprivate(FP, "baseline-1", "non-private prompt tuning baseline")
    assert row["kind"] == "nonprivate" and row["epsilon"] is None
    ledger.record_nonprivate(FP, "baseline-1", "non-private prompt tuning baseline")  # idempotent
    assert ledger.spent(FP).epsilon == pytest.approx(before)

    kinds = {e["run_id"]: e["kind"] for e in ledger.entries(FP)}
    assert kinds == {"dp-run": "dp", "baseline-1": "nonprivate"}
    (ds,) = ledger.datasets()
    assert ds["nonprivate_uses"] == 1 and ds["reserved_runs"] == 1
    assert ds["spent_epsilon"] == pytest.approx(before)
    assert ds["remaining_epsilon"] == pytest.approx(8.0 - before)
    table = ledger.summary_table()
    assert "sst2" in table and FP[:12] in table
    assert f"{before:.4f}" in table and f"{8.0 - before:.4f}" in table
    assert "baseline-1" in table and "non-private prompt tuning baseline" in table
    assert "no DP guarantee" in table
    with pytest.raises(ValueError):
        ledger.reserve(FP, "baseline-1", EXP)
    with pytest.raises(ValueError, match="non-private"):
        ledger.abort("baseline-1", "x")


def test_summary_table_without_nonprivate(ledger):
    table = ledger.summary_table()
    assert "sst2" in table and "non-private uses: none" in table


# ---- persistence and registration ------------------------------------------------------------------

def test_persistence_across_ledger_objects(ledger):
    ledger.reserve(FP, "a", DPSGD, "first")
    ledger.commit("a", ev.dpsgd_event(0.01, 1.0, 60))
    ledger.reserve(FP, "b", EXP)
    ledger.record_nonprivate(FP, "base", "baseline")
    again = Ledger(ledger.path)
    assert again.entries() == ledger.entries()
    assert again.datasets() == ledger.datasets()
    assert again.spent(FP) == ledger.spent(FP)
    assert again.remaining(FP) == ledger.remaining(FP)
    assert again.reserve(FP, "b", EXP).new is False


def test_register_dataset_rules(ledger):
    assert ledger.register_dataset(FP, "sst2", 8.0, DELTA)["epsilon_cap"] == 8.0    # no-op
    with pytest.raises(ValueError, match="allow_cap_change"):
        ledger.register_dataset(FP, "sst2", 4.0, DELTA)
    ledger.reserve(FP, "r", EXP)
    d = ledger.register_dataset(FP, "sst2", 4.0, DELTA, allow_cap_change=True)
    assert d["epsilon_cap"] == 4.0
    assert d["remaining_epsilon"] == pytest.approx(4.0 - eps(EXP))
    (change,) = ledger.cap_changes(FP)
    assert change["old_cap"] == 8.0 and change["new_cap"] == 4.0
    assert change["spent_epsilon_at_change"] == pytest.approx(eps(EXP))
    # lowering below what is spent: nothing remains, and new reservations are refused
    ledger.register_dataset(FP, "sst2", 0.1, DELTA, allow_cap_change=True)
    assert ledger.remaining(FP) == 0.0
    with pytest.raises(BudgetExceededError, match=r"remaining ε=0\.0000"):
        ledger.reserve(FP, "s", ev.ExponentialEvent(0.01))


@pytest.mark.parametrize("kwargs, argname", [
    (dict(epsilon_cap=0.0), "epsilon_cap"),
    (dict(epsilon_cap=-1.0), "epsilon_cap"),
    (dict(epsilon_cap=math.inf), "epsilon_cap"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(delta=1.5), "delta"),
    (dict(fingerprint=""), "fingerprint"),
    (dict(name=""), "name"),
])
def test_bad_registration_inputs(tmp_path, kwargs, argname):
    led = Ledger(tmp_path / "l.db")
    args = dict(fingerprint=FP, name="sst2", epsilon_cap=1.0, delta=DELTA) | kwargs
    with pytest.raises(ValueError, match=argname):
        led.register_dataset(**args)
    assert led.datasets() == []


def test_bad_inputs_elsewhere(ledger):
    with pytest.raises(UnknownDatasetError, match="unknown dataset fingerprint") as info:
        ledger.reserve("deadbeef", "r", EXP)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    for call in (lambda: ledger.spent("deadbeef"), lambda: ledger.remaining("deadbeef"),
                 lambda: ledger.entries("deadbeef"), lambda: ledger.record_nonprivate("deadbeef", "x", "y")):
        with pytest.raises(KeyError, match="deadbeef"):
            call()
    with pytest.raises(ValueError, match="run_id"):
        ledger.reserve(FP, "", EXP)
    with pytest.raises(ValueError, match="event"):
        ledger.reserve(FP, "r", {"type": "gaussian", "noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="description"):
        ledger.record_nonprivate(FP, "b", "")
    with pytest.raises(UnknownRunError, match="nope"):
        ledger.commit("nope", EXP)
    with pytest.raises(UnknownRunError, match="nope"):
        ledger.abort("nope", "reason")
    with pytest.raises(ValueError, match="path"):
        Ledger(":memory:")
    assert ledger.entries() == []


# ---- issue 9: local-DP uses, dry-run preview, δ mismatch -------------------------------------------

def test_ldp_uses_listed_counted_and_not_composed(ledger):
    ledger.reserve(FP, "dp-run", EXP)
    before = ledger.spent(FP).epsilon
    ledger.record_ldp(FP, "rapt-1", "RAPT: local d_X privacy")
    ledger.record_ldp(FP, "rapt-1", "RAPT: local d_X privacy")  # idempotent
    assert ledger.spent(FP).epsilon == pytest.approx(before)
    kinds = {e["run_id"]: e["kind"] for e in ledger.entries(FP)}
    assert kinds == {"dp-run": "dp", "rapt-1": "ldp"}
    ds = ledger.dataset(FP)
    assert ds["ldp_uses"] == 1 and ds["nonprivate_uses"] == 0
    table = ledger.summary_table()
    assert "local-DP uses (1" in table and "rapt-1" in table
    assert "non-private uses: none" in table



def test_ldp_releases_compose_eta_additively(ledger):
    """Each d_X draw is a release; η adds up over the draws of a dataset (a record in all of them
    is private at the sum). A shared draw recorded twice (variants of a sweep) counts once."""
    assert ledger.dataset(FP)["ldp_eta_bound"] is None
    ledger.record_ldp(FP, "rapt-run", "RAPT: local d_X privacy")  # a run: a use, not a release
    for key, eta in (("draw-a", 50.0), ("draw-b", 100.0), ("draw-b", 100.0), ("draw-c", 150.0)):
        ledger.record_ldp(FP, f"rapt-draw:{key}", f"d_X draw {key}", eta=eta)
    ds = ledger.dataset(FP)
    assert ds["ldp_releases"] == 3 and ds["ldp_eta_bound"] == pytest.approx(300.0) and ds["ldp_uses"] == 1
    assert ledger.spent(FP).epsilon == 0.0  # not composed into ε
    assert "3 d_X draws" in ledger.summary_table() and "η ≤ 300" in ledger.summary_table()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="eta"):
            ledger.record_ldp(FP, "rapt-draw:bad", "bad", eta=bad)
    assert ledger.dataset(FP)["ldp_releases"] == 3  # nothing half-written


def test_preview_composes_without_writing(ledger, tmp_path):
    ledger.reserve(FP, "dp-run", EXP)
    spent = ledger.spent(FP).epsilon
    entries_before = ledger.entries(FP)
    p = ledger.preview(FP, [EXP, EXP], DELTA)
    assert p["spent_epsilon"] == pytest.approx(spent)
    assert p["planned_epsilon"] == pytest.approx([eps(EXP), eps(EXP)])
    assert p["total_epsilon"] == pytest.approx(eps(ev.ComposedEvent((EXP, EXP, EXP))))
    assert p["cap"] == 8.0 and p["remaining_after"] == pytest.approx(8.0 - p["total_epsilon"]) and p["fits"]
    assert ledger.entries(FP) == entries_before and ledger.spent(FP).epsilon == pytest.approx(spent)
    assert not ledger.preview(FP, [EXP] * 40, DELTA)["fits"]
    new = ledger.preview(FP2, [EXP], DELTA, cap=0.4, name="other")
    assert new["spent_epsilon"] == 0.0 and new["cap"] == 0.4 and not new["fits"]
    assert FP2 not in {d["fingerprint"] for d in ledger.datasets()}


def test_delta_mismatch_is_an_error_not_infinite_epsilon(ledger):
    from privacy.ledger import DeltaMismatchError
    ledger.require_delta(FP, DELTA)
    with pytest.raises(DeltaMismatchError, match="δ"):
        ledger.require_delta(FP, 1e-6)
    with pytest.raises(DeltaMismatchError):
        ledger.preview(FP, [EXP], 1e-6)
    assert issubclass(DeltaMismatchError, ValueError)


# ---- a δ change never unspends a budget (issue 35, defect 3) ----------------------------------

RUN_200 = ev.dpsgd_event(0.05, 1.0, 200)  # its ε falls with δ: 4.77 at 1e-5, 3.16 at 1e-3, 0 at 0.5


def _spent_two_runs(tmp_path) -> tuple[Ledger, float]:
    led = Ledger(tmp_path / "ledger.sqlite")
    led.register_dataset(FP, "toy", 8.0, DELTA)
    for run in ("r1", "r2"):
        led.reserve(FP, run, RUN_200)
        led.mark_read(run)
        led.commit(run, RUN_200)
    spent = led.spent(FP).epsilon
    composed_at = {d: spend(ev.ComposedEvent((RUN_200, RUN_200)), d).epsilon for d in (1e-3, 0.5)}
    assert spent == pytest.approx(spend(ev.ComposedEvent((RUN_200, RUN_200)), DELTA).epsilon)
    assert composed_at[1e-3] < spent - 1.0 and composed_at[0.5] == 0.0  # what a δ raise would have "unspent"
    return led, spent


def test_set_delta_cannot_lower_spent_epsilon(tmp_path, capsys):
    from privprompt_cli import main

    led, spent = _spent_two_runs(tmp_path)
    entries = {e["run_id"]: e["epsilon"] for e in led.entries(FP)}
    trail = led.trail()
    for delta in ("1e-3", "0.5"):
        assert main(["--state-dir", str(tmp_path), "budget", "set-delta", "toy", delta, "--reason", "more"]) == 2
        err = capsys.readouterr().err
        assert "raises the budget" in err and "allow_cap_change=True" in err and err.count("\n") == 1
    assert led.dataset(FP)["delta"] == DELTA and led.spent(FP).epsilon == pytest.approx(spent, rel=1e-12)
    assert led.trail() == trail and led.cap_changes(FP) == []      # a refusal writes nothing
    # the explicit, recorded step (as a cap raise): δ goes up, the spent ε does not come down
    d = led.change_delta(FP, 1e-3, "policy review", allow_raise=True)
    assert d["delta"] == 1e-3 and d["spent_epsilon"] == pytest.approx(spent, rel=1e-12)
    assert led.spent(FP).epsilon == pytest.approx(spent, rel=1e-12)
    assert led.remaining(FP) == pytest.approx(8.0 - spent, rel=1e-12)
    assert {e["run_id"]: e["epsilon"] for e in led.entries(FP)} == entries   # no entry's charge drops
    (change,) = led.cap_changes(FP)
    assert change["spent_epsilon_at_change"] == pytest.approx(spent) and change["reason"] == "policy review"
    assert led.trail()[-1]["detail"]["delta_raised"] is True
    # the table and the plan say the same
    assert f"{spent:.4f}" in led.summary_table()
    assert led.preview(FP, [], 1e-3)["spent_epsilon"] == pytest.approx(spent, rel=1e-12)
    # a run that fits under the cap at the new δ is admitted; the total is never below the held ε
    r = led.reserve(FP, "r3", ev.ExponentialEvent(0.01))
    assert r.spent_epsilon == pytest.approx(spent, rel=1e-12)
    led.abort("r3", "test: never read")
    # a cap lowered below the held ε leaves nothing, even though the composition at 1e-3 is below it
    led.lower_cap(FP, spent - 0.5, "policy")
    with pytest.raises(BudgetExceededError) as info:
        led.reserve(FP, "r4", ev.ExponentialEvent(0.01))
    assert info.value.spent == pytest.approx(spent, rel=1e-12) and info.value.remaining == 0.0
    # a smaller δ tightens: the spent ε rises with it, and every entry's ε is re-stated upwards
    led.change_delta(FP, 1e-7, "stricter")
    lower = spend(ev.ComposedEvent((RUN_200, RUN_200)), 1e-7).epsilon
    assert lower > spent and led.spent(FP).epsilon == pytest.approx(lower)
    assert all(led.entry(r)["epsilon"] >= entries[r] for r in entries)


def test_a_delta_raise_through_register_dataset_holds_the_spent_epsilon_too(tmp_path):
    led, spent = _spent_two_runs(tmp_path)
    with pytest.raises(ValueError, match="allow_cap_change"):
        led.register_dataset(FP, "toy", 8.0, 0.5)
    led.register_dataset(FP, "toy", 8.0, 0.5, allow_cap_change=True)    # no records known: no 1/n rule
    assert led.dataset(FP)["delta"] == 0.5 and led.spent(FP).epsilon == pytest.approx(spent, rel=1e-12)
    # a δ change with an open reservation is refused on this path as well
    led.reserve(FP, "open", ev.ExponentialEvent(0.01))
    with pytest.raises(ValueError, match="open reservation"):
        led.register_dataset(FP, "toy", 8.0, 1e-6, allow_cap_change=True)


def test_a_delta_raise_to_one_over_n_of_the_known_records_stays_refused(tmp_path):
    led = Ledger(tmp_path / "ledger.sqlite")
    digests = [bytes([i]) * 16 for i in range(200)]              # the dataset is known by 200 records
    row = led.register_source("k" * 64, "toy", 8.0, DELTA, digests)
    led.reserve(row["fingerprint"], "r1", RUN_200)
    led.commit("r1", RUN_200)
    for delta in (1 / 200, 0.01, 0.5):
        with pytest.raises(ValueError, match=r">= 1/n for the n records") as info:
            led.change_delta(row["fingerprint"], delta, "x", allow_raise=True)
        assert "200" not in str(info.value)                      # n is not in the message
    led.change_delta(row["fingerprint"], 1e-3, "x", allow_raise=True)  # below 1/n: allowed, recorded
    assert led.dataset(row["fingerprint"])["delta"] == 1e-3


def test_a_ledger_whose_delta_was_raised_before_this_rule_reports_the_spent_epsilon_again(tmp_path):
    """A δ raise made by the earlier code re-stated every entry at the new δ and recorded the ε spent
    at the old one: that record now holds the dataset's spent ε, so the budget it unspent is back."""
    led, spent = _spent_two_runs(tmp_path)
    with led._store.write() as conn:  # what the earlier change_delta wrote
        conn.exec_driver_sql(
            "INSERT INTO cap_changes (fingerprint, old_name, old_cap, old_delta, new_name, new_cap, new_delta, "
            "spent_epsilon_at_change, changed_at, reason) VALUES (?, 'toy', 8.0, ?, 'toy', 8.0, 0.5, ?, 'then', 'old')",
            (FP, DELTA, spent))
        conn.exec_driver_sql("UPDATE datasets SET delta = 0.5 WHERE fingerprint = ?", (FP,))
    assert led.spent(FP).epsilon == pytest.approx(spent, rel=1e-12)
    assert led.dataset(FP)["spent_epsilon"] == pytest.approx(spent, rel=1e-12)


# ---- a δ raised by the set-delta of schema <= 6 (fixtures/make_schema6_raised_delta_ledger.py) ----

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
OLD_RUN = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.1, ev.GaussianEvent(0.7)), 11)  # the fixture's run


def _rows(path, table: str) -> list[dict]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(f"SELECT * FROM {table} ORDER BY id")]
    finally:
        conn.close()


def test_a_schema6_ledger_whose_delta_set_delta_raised_migrates_to_its_smallest_delta(tmp_path):
    """The old set-delta raised 'raised' from δ=1e-5 to 1e-3 after a run of ε 6.197 (at 1e-5) under a
    cap of 8: at 1e-3 four more such runs fitted (five composed at 1e-5: ε ≈ 11.1 > 8). Migrated, the
    dataset is back at 1e-5: of the four, the one that fits at 1e-5 (two composed: ε 7.79) is
    accepted and the others are refused by the cap; every row survives."""
    path = tmp_path / "ledger.sqlite"
    shutil.copyfile(FIXTURES / "schema6_raised_delta_ledger.sqlite", path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 6
    before = {t: _rows(path, t) for t in ("entries", "cap_changes", "trail")}
    led = Ledger(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 8
    ds = {d["name"]: d for d in led.datasets()}
    raised = ds["raised"]["fingerprint"]
    assert ds["raised"]["delta"] == 1e-5 and ds["raised-half"]["delta"] == 1e-6   # the smallest earlier δ
    assert ds["lowered"]["delta"] == 1e-6 and ds["wide"]["delta"] == 0.2           # no raise: as they were
    assert led.spent(raised).epsilon == pytest.approx(eps(OLD_RUN), rel=1e-9)
    assert eps(OLD_RUN) == pytest.approx(6.197, abs=1e-3)
    half = ds["raised-half"]["fingerprint"]
    assert led.spent(half).epsilon == pytest.approx(eps(ev.ExponentialEvent(1.0), 1e-6), rel=1e-9)
    accepted = 0
    for i in range(4):  # the review's four further runs: at 1e-5 the second run still fits (ε 7.79), no third
        try:
            led.reserve(raised, f"again-{i}", OLD_RUN)
        except BudgetExceededError:
            continue
        led.commit(f"again-{i}", OLD_RUN)
        accepted += 1
    assert accepted == 1
    assert led.spent(raised).epsilon <= 8.0
    assert led.spent(raised).epsilon == pytest.approx(spend(ev.SelfComposedEvent(OLD_RUN, 2), 1e-5).epsilon, rel=1e-3)
    assert spend(ev.SelfComposedEvent(OLD_RUN, 3), 1e-5).epsilon > 8.0
    # every row survives: the old rows are a prefix of the new tables, each entry's ε only rises
    after = {t: _rows(path, t) for t in ("entries", "cap_changes", "trail")}
    after["entries"] = [e for e in after["entries"] if not e["run_id"].startswith("again-")]
    assert after["cap_changes"][:len(before["cap_changes"])] == before["cap_changes"]
    assert after["trail"][:len(before["trail"])] == before["trail"]
    assert len(after["entries"]) == len(before["entries"]) == 6
    for old, new in zip(before["entries"], after["entries"]):
        for column in old:
            if column.startswith("epsilon_") and old[column] is not None:
                assert new[column] >= old[column] - 1e-12
            else:
                assert new[column] == old[column]
    undo = [t for t in led.trail() if t["detail"].get("undoes_unrecorded_delta_raise")]
    assert [(t["fingerprint"], t["detail"]["old_delta"], t["detail"]["new_delta"]) for t in undo] == sorted(
        [(raised, 1e-3, 1e-5), (half, 1e-2, 1e-6)])
    assert all("smallest δ before a raise" in t["detail"]["reason"] for t in undo)
    assert len(after["cap_changes"]) == len(before["cap_changes"]) + 2
    # opening it again changes nothing
    Ledger(path)
    assert _rows(path, "trail") == after["trail"][:len(_rows(path, "trail"))] and len(_rows(path, "trail")) == len(
        after["trail"])


def test_a_stored_delta_at_or_above_one_over_n_is_refused_at_reserve(tmp_path):
    """'wide' was registered by the old code at δ=0.2 for its 10 known records (nothing checked a
    stored δ against n then): a reservation is refused in one line, n not in it, nothing recorded."""
    path = tmp_path / "ledger.sqlite"
    shutil.copyfile(FIXTURES / "schema6_raised_delta_ledger.sqlite", path)
    led = Ledger(path)
    wide = led.find_dataset("wide")["fingerprint"]
    trail = led.trail()
    with pytest.raises(ValueError, match=r"δ=0.2, which is >= 1/n for the n records") as info:
        led.reserve(wide, "w1", ev.ExponentialEvent(0.1))
    assert "\n" not in str(info.value) and "10" not in str(info.value)
    assert led.trail() == trail and led.entries(wide) == []
    # a config's explicit opt-in (privacy.allow_delta_at_least_one_over_n, recorded in the run record)
    opted = led.reserve(wide, "w0", ev.ExponentialEvent(0.1), allow_delta_at_least_one_over_n=True)
    assert opted.new and opted.delta == pytest.approx(0.2)
    led.abort("w0", "test: opted in, nothing read")
    led.change_delta(wide, 1e-3, "below 1/n")   # a lowering is always allowed; then runs go on
    assert led.reserve(wide, "w1", ev.ExponentialEvent(0.1)).new


def test_a_recorded_delta_raise_survives_the_migration_an_unrecorded_one_does_not(tmp_path):
    """On a schema-7 ledger a raise by the recorded step (trail: delta_raised) stays; one without the
    mark (what the earlier set-delta left, carried through schema 7) is put back. An export of
    schema 7 imported into an empty ledger gets the same treatment."""
    led = Ledger(tmp_path / "ledger.sqlite")
    led.register_dataset(FP, "kept", 8.0, DELTA)
    led.reserve(FP, "r1", RUN_200)
    led.commit("r1", RUN_200)
    led.change_delta(FP, 1e-3, "policy review", allow_raise=True)        # recorded raise
    led.register_dataset(FP2, "undone", 8.0, 1e-6)
    led.reserve(FP2, "r2", RUN_200)
    led.commit("r2", RUN_200)
    with led._store.write() as conn:  # an unrecorded raise, as the set-delta of schema <= 6 wrote it
        conn.exec_driver_sql(
            "INSERT INTO cap_changes (fingerprint, old_name, old_cap, old_delta, new_name, new_cap, new_delta, "
            "spent_epsilon_at_change, changed_at, reason) VALUES (?, 'undone', 8.0, 1e-6, 'undone', 8.0, 0.01, 1.0, "
            "'then', 'old set-delta')", (FP2,))
        conn.exec_driver_sql("UPDATE datasets SET delta = 0.01 WHERE fingerprint = ?", (FP2,))
    export = led.export()
    export["schema_version"] = 7
    with led._store.write() as conn:
        conn.exec_driver_sql("UPDATE ledger_meta SET value = '7' WHERE name = 'schema_version'")
        conn.exec_driver_sql("PRAGMA user_version = 7")
    led = Ledger(tmp_path / "ledger.sqlite")
    assert led.dataset(FP)["delta"] == 1e-3 and led.dataset(FP2)["delta"] == 1e-6
    restored = Ledger(tmp_path / "restored.sqlite")
    restored.import_ledger(export)
    assert restored.dataset(FP)["delta"] == 1e-3 and restored.dataset(FP2)["delta"] == 1e-6
    assert restored.spent(FP2).epsilon == pytest.approx(eps(RUN_200, 1e-6), rel=1e-9)
    assert restored.trail()[-1]["detail"]["undoes_unrecorded_delta_raise"] is True
