"""No budget spent on a mistake that needs no private data, and budget answers a user can act on
(issue 29, the budget half).

* Config mistakes found without private data — label descriptions whose first tokens collide on
  a verbalizer model, an unloadable ``models.local``, a cap above the stored one, another δ —
  fail before the reservation with a one-line error and leave the ledger unchanged; ``plan``
  refuses the same configs with the same rules.
* A run that fails after its reservation but before its first private read releases it
  (recorded as such); one that fails after the read began keeps it spent; both say what they used.
* "The largest target_epsilon that still fits" is checked against the accountant: a run at it
  fits, one at +1% does not; the refusal, ``plan`` and ``privprompt ledger --config`` say it.
* ``privprompt ledger`` into a closed pipe exits without a traceback; the budget commands
  (open reservations, lower a cap, register anew at another δ) are recorded in the ledger.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.pipeline.test_flow import _config, _toy_dataset
from tests.claims.test_release_once import Crash, _context

REPO = Path(__file__).resolve().parents[2]
SENTENCES = {"negative": "The movie was bad", "positive": "The movie was good"}


@pytest.fixture(scope="module")
def toy(sst2_dir, tmp_path_factory):
    return _toy_dataset(tmp_path_factory.mktemp("preflight") / "data", sst2_dir, n_train=120, n_test=20)


def _cfg(toy, state, **extra):
    cfg = _config(toy, state, **extra)
    cfg["methods"]["zero_shot"]["enabled"] = False
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    cfg["mia"]["enabled"] = False
    return cfg


def _spent_ledger(cfg_dict, epsilon=2.0):
    """The config's dataset registered in its ledger with one committed DP run of ε ≈ ``epsilon``
    (what a user's earlier run left), and the ledger's full contents to compare later."""
    from privacy.ledger import Ledger
    from tasks.config import parse_config
    from tasks.data import dataset_key
    from tasks.run_plan import planned_events, resolve_delta
    from tasks.planning import released_sizes
    from tasks.state import default_data_root, state_paths

    cfg = parse_config(cfg_dict)
    paths = state_paths(cfg.state_dir).create()
    n = released_sizes(cfg, paths.private)
    delta = resolve_delta(cfg, n.n_for_delta)
    key = dataset_key(cfg.data, default_data_root(cfg.data_root), paths.private)
    ledger = Ledger(paths.ledger)
    ledger.register_dataset(key, cfg.data.name, cfg.privacy.dataset_epsilon_cap, delta)
    (event,) = planned_events(cfg, n, delta, epsilon)
    ledger.reserve(key, "earlier-run", event)
    ledger.commit("earlier-run", event)
    return ledger, key, n, delta


def _contents(ledger):
    return ledger.datasets(), ledger.entries(), ledger.cap_changes()


def _plan(cfg_dict, largest=False):
    from tasks.config import parse_config
    from tasks.planning import plan_runs
    from tasks.state import state_paths

    cfg = parse_config(cfg_dict)
    return plan_runs([("", cfg)], state_paths(cfg.state_dir), largest=largest)


def _flow_fails_before_reservation(cfg_dict, error, match):
    """The method flow fails with ``error`` before any reservation; the ledger is unchanged."""
    from flows.method_flow import method_flow

    ledger, _, _, _ = _spent_ledger(cfg_dict)
    before = _contents(ledger)
    with pytest.raises(error, match=match) as info:
        method_flow(cfg_dict)
    assert _contents(ledger) == before
    return info.value


def _one_line(err):
    return "\n" not in str(err) and len(str(err)) < 600


# ---- mistakes that need no private data ---------------------------------------------------------

@pytest.mark.slow  # suite time: runs with -m slow
def test_sentences_as_verbalizer_words_fail_before_the_reservation(prefect_harness, toy, tmp_path):
    from tasks.errors import ConfigError

    cfg = _cfg(toy, tmp_path / "state", **{"models.label_descriptions": SENTENCES})
    err = _flow_fails_before_reservation(cfg, ConfigError, "share a first token")
    assert _one_line(err) and "models.label_descriptions" in str(err) and "tiny-bert" in str(err)
    with pytest.raises(ConfigError, match="share a first token") as planned:  # plan: the same check
        _plan(cfg)
    assert str(planned.value) == str(err)
    # the same words as short first-token words pass both
    cfg["models"]["label_descriptions"] = {"negative": " bad", "positive": " good"}
    assert _plan(cfg)["fits"]


@pytest.mark.slow  # suite time: runs with -m slow
def test_an_unloadable_local_model_fails_before_the_reservation(prefect_harness, toy, tmp_path, monkeypatch):
    from models.backbones import ModelLoadError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: the load fails at once, as it would after retries
    cfg = _cfg(toy, tmp_path / "state", **{"models.local": "no-such-org/no-such-model"})
    err = _flow_fails_before_reservation(cfg, ModelLoadError, "cannot load model 'no-such-org/no-such-model'")
    assert _one_line(err)
    with pytest.raises(ModelLoadError, match="cannot load model 'no-such-org/no-such-model'"):
        _plan(cfg)


@pytest.mark.slow  # suite time: runs with -m slow
def test_plan_and_run_refuse_a_higher_cap_and_another_delta_alike(toy, tmp_path):
    from privacy.ledger import DeltaMismatchError, Ledger
    from tasks.errors import ConfigError
    from tasks.charge import ensure_dataset

    state = tmp_path / "state"
    cfg = _cfg(toy, state)
    ledger, key, n, delta = _spent_ledger(cfg)
    before = _contents(ledger)
    from types import SimpleNamespace

    part = SimpleNamespace(dataset_key=key, dataset="toy-sst2")  # what ensure_dataset reads of a partition

    higher = _cfg(toy, state, **{"privacy.dataset_epsilon_cap": 60.0})
    with pytest.raises(ConfigError, match="above the cap ε=50") as planned:
        _plan(higher)
    with pytest.raises(ConfigError, match="above the cap ε=50") as ran:
        ensure_dataset(Ledger(state / "ledger.sqlite"), part, 60.0, delta)
    assert str(planned.value) == str(ran.value) and _one_line(ran.value)

    other = _cfg(toy, state, **{"privacy.target_delta": delta / 2})
    with pytest.raises(DeltaMismatchError, match="differs from δ") as planned:
        _plan(other)
    with pytest.raises(DeltaMismatchError, match="differs from δ") as ran:
        ensure_dataset(Ledger(state / "ledger.sqlite"), part, 50.0, delta / 2)
    assert str(planned.value) == str(ran.value) and _one_line(ran.value)
    assert "privprompt budget set-delta" in str(ran.value)
    assert _contents(ledger) == before

    # a lower cap: plan shows it, a run stores it (recorded)
    lower = _plan(_cfg(toy, state, **{"privacy.dataset_epsilon_cap": 10.0}))
    assert lower["datasets"][key]["cap"] == 10.0 and _contents(ledger) == before


@pytest.mark.slow  # suite time: runs with -m slow
def test_cli_plan_errors_are_one_line(toy, tmp_path):
    state = tmp_path / "state"
    cfg = _cfg(toy, state)
    _, _, _, delta = _spent_ledger(cfg)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}, "PYTHONPATH": str(REPO)}
    for override, needle in ((f"privacy.target_delta={delta / 2}", "differs from δ"),
                             ("privacy.dataset_epsilon_cap=99", "above the cap"),
                             ('models.label_descriptions={"negative": "The movie was bad", '
                              '"positive": "The movie was good"}', "share a first token")):
        proc = subprocess.run([sys.executable, "-m", "privprompt_cli", "plan", str(cfg_file), "--set", override],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("privprompt: error:") and needle in lines[0], proc.stderr


# ---- a failed run releases or keeps its reservation, and says which ------------------------------

def test_a_failure_before_the_first_private_read_releases_the_reservation(tmp_path, sst2_dir, monkeypatch):
    from privacy.ledger import Ledger
    from tasks import lifecycle

    ctx = _context(tmp_path, sst2_dir)
    reads = []
    monkeypatch.setattr(lifecycle.randomness, "for_config", lambda cfg: (_ for _ in ()).throw(Crash("lost")))
    monkeypatch.setattr(lifecycle, "read_private_rows", lambda *a, **k: reads.append(1))
    with pytest.raises(Crash) as info:
        lifecycle.run_method(ctx, "prompt_dpsgd", {})
    ledger = Ledger(ctx.paths.ledger)
    (entry,) = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert not reads
    assert entry["status"] == "released" and entry["epsilon"] == 0.0 and entry["read_started_at"] is None
    assert entry["release_reason"] == "Crash before any private record was read" and entry["released_at"]
    assert ledger.spent(ctx.part.dataset_key).epsilon == 0.0
    assert any(n.startswith("budget: no ε used") and "released" in n for n in info.value.__notes__)
    assert ledger.datasets()[0]["released_runs"] == 1

    # a retry of the same run reserves again (a fresh budget check) and trains
    monkeypatch.undo()
    out = lifecycle.run_method(ctx, "prompt_dpsgd", {})
    (entry,) = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert entry["status"] == "committed" and entry["read_started_at"] is not None
    assert ledger.spent(ctx.part.dataset_key).epsilon == pytest.approx(out.spend["epsilon"], rel=1e-6)


def test_a_failure_after_the_read_began_keeps_the_reservation_spent(tmp_path, sst2_dir, monkeypatch):
    from privacy.ledger import Ledger
    from tasks import lifecycle
    from tasks.methods import get_method

    ctx = _context(tmp_path, sst2_dir)

    def train(self, *args, **kwargs):
        raise Crash("worker lost while training")

    monkeypatch.setattr(type(get_method("prompt_dpsgd").mechanism), "train", train)
    with pytest.raises(Crash) as info:
        lifecycle.run_method(ctx, "prompt_dpsgd", {})
    ledger = Ledger(ctx.paths.ledger)
    (entry,) = [e for e in ledger.entries() if e["kind"] == "dp"]
    assert entry["status"] == "reserved" and entry["read_started_at"] is not None
    assert ledger.spent(ctx.part.dataset_key).epsilon == pytest.approx(entry["epsilon_reserved"], rel=1e-9)
    assert any(n.startswith(f"budget: ε={entry['epsilon_reserved']:.4f} used") and "stays spent" in n
               for n in info.value.__notes__)
    with pytest.raises(ValueError, match="began reading private data"):
        ledger.release(entry["run_id"], "trying")
    with pytest.raises(ValueError, match="began reading private data"):
        ledger.abort(entry["run_id"], "trying")
    assert [e["run_id"] for e in ledger.open_reservations()] == [entry["run_id"]]


# ---- the largest ε that fits ------------------------------------------------------------------

@pytest.mark.slow  # suite time: runs with -m slow
def test_the_largest_fitting_epsilon_is_the_accountants(toy, tmp_path):
    from privacy import accountant as acct
    from privacy import events as ev
    from tasks.config import parse_config
    from tasks.run_plan import planned_events

    state = tmp_path / "state"
    cfg_dict = _cfg(toy, state, **{"privacy.dataset_epsilon_cap": 3.0})
    ledger, key, n, delta = _spent_ledger(cfg_dict, epsilon=2.0)
    remaining = ledger.remaining(key)
    plan = _plan(cfg_dict, largest=True)
    x = plan["datasets"][key]["largest_epsilon"]
    cfg = parse_config(cfg_dict)
    existing = ledger.counted_events(key)

    def total(eps):
        return acct.spend(ev.ComposedEvent(tuple(existing + planned_events(cfg, n, delta, eps))), delta).epsilon

    assert total(x) <= 3.0 < total(x * 1.01)
    assert x > remaining + 0.5  # composition is sub-additive: far more fits than cap − spent
    shown = float(plan["datasets"][key]["largest_hint"].rsplit("≈", 1)[1])
    assert shown == x and total(shown) <= 3.0  # the number shown is the one checked: it fits as typed
    from tasks.planning import format_plan

    assert f"the largest target_epsilon that still fits: ≈ {shown:.3f}" in format_plan(plan)


@pytest.mark.slow  # ~30 s: one calibration at ε = 100
def test_a_cap_far_above_any_meaningful_target_is_not_searched_to_its_end(toy, tmp_path):
    """With ε spent and a cap of 1000 the search once calibrated σ for targets near 1000 (σ → 0:
    a PLD on an ever finer grid, > 10 min and 4 GB for configs/smoke.yaml): it stops at 100 and
    says so."""
    import time

    from tasks.planning import format_plan
    from tasks.run_plan import LARGEST_SEARCHED

    cfg_dict = _cfg(toy, tmp_path / "state", **{"privacy.dataset_epsilon_cap": 1000.0})
    _, key, _, _ = _spent_ledger(cfg_dict, epsilon=2.0)
    started = time.perf_counter()
    plan = _plan(cfg_dict, largest=True)
    assert time.perf_counter() - started < 120
    assert plan["datasets"][key]["largest_epsilon"] == LARGEST_SEARCHED
    assert "still fits: ≥ 100 (not searched further" in format_plan(plan)


@pytest.mark.slow  # three trainings and the search (≈ 55 s in the suite); the plan's answer is checked by default above
def test_the_refusal_says_what_fits_and_records_nothing(tmp_path, sst2_dir):
    from privacy.ledger import BudgetExceededError, Ledger
    from tasks.lifecycle import run_method

    import dataclasses

    cap = {"privacy.dataset_epsilon_cap": 3.0}
    ctx = _context(tmp_path, sst2_dir, **cap, **{"privacy.target_epsilon": 2.5})
    first = run_method(ctx, "prompt_dpsgd", {})
    ledger = Ledger(ctx.paths.ledger)
    before = _contents(ledger)
    with pytest.raises(BudgetExceededError, match="the largest target_epsilon that still fits: ≈") as info:
        run_method(dataclasses.replace(ctx, flow_run_id="flow-run-2"), "prompt_dpsgd", {})
    assert _one_line(info.value) and _contents(ledger) == before
    largest = info.value.largest_fitting_epsilon
    assert first.spend["epsilon"] <= 2.5 and 0 < largest < 2.5
    # what it says fits, fits
    fitting = _context(tmp_path, sst2_dir, **cap, **{"privacy.target_epsilon": float(f"{largest:.3f}") - 0.001})
    run_method(dataclasses.replace(fitting, flow_run_id="flow-run-3"), "prompt_dpsgd", {})
    assert ledger.spent(ctx.part.dataset_key).epsilon <= 3.0


# ---- the ledger commands ---------------------------------------------------------------------

@pytest.mark.slow  # suite time: a CLI subprocess printing 300 entries into a closed pipe
def test_ledger_into_a_closed_pipe_exits_quietly(tmp_path):
    from privacy import events as ev
    from privacy.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.register_dataset("f" * 64, "toy", 8.0, 1e-5)
    for i in range(300):
        ledger.record_nonprivate("f" * 64, f"use-{i}", "a non-private use " + "x" * 80)
    ledger.reserve("f" * 64, "r", ev.ExponentialEvent(0.5))
    read, write = os.pipe()
    os.close(read)  # the reader (`| head`) is gone
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "privprompt_cli", "--state-dir", str(tmp_path), "ledger"],
                          stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_budget_commands_are_recorded(tmp_path, capsys):
    import privprompt_cli
    from privacy import events as ev
    from privacy.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    fp = "ab" * 32
    ledger.register_dataset(fp, "toy", 8.0, 1e-5)
    gaussian = ev.dpsgd_event(0.05, 1.0, 50)  # its ε depends on δ
    ledger.reserve(fp, "open-run", gaussian)
    main = privprompt_cli.main
    assert main(["--state-dir", str(tmp_path), "budget", "reservations"]) == 0
    out = capsys.readouterr().out
    assert "open-run" in out and "has not read private data yet" in out

    assert main(["--state-dir", str(tmp_path), "budget", "lower-cap", "toy", "5", "--reason", "policy"]) == 0
    assert ledger.dataset(fp)["epsilon_cap"] == 5.0
    assert main(["--state-dir", str(tmp_path), "budget", "lower-cap", "toy", "6", "--reason", "x"]) == 2
    assert "only lowered" in capsys.readouterr().err
    # another δ is refused while a reservation is open, then recorded with its reason
    assert main(["--state-dir", str(tmp_path), "budget", "set-delta", "abab", "1e-6", "--reason", "r"]) == 2
    assert "open reservation" in capsys.readouterr().err
    ledger.commit("open-run", gaussian)
    eps_before = ledger.entry("open-run")["epsilon"]
    assert main(["--state-dir", str(tmp_path), "budget", "set-delta", "abab", "1e-6", "--reason", "new policy"]) == 0
    assert ledger.dataset(fp)["delta"] == 1e-6
    changes = ledger.cap_changes(fp)
    assert [(c["old_cap"], c["new_cap"], c["reason"]) for c in changes] == [(8.0, 5.0, "policy"), (5.0, 5.0, "new policy")]
    assert changes[1]["old_delta"] == 1e-5 and changes[1]["new_delta"] == 1e-6
    eps_after = ledger.entry("open-run")["epsilon"]  # re-stated at the new δ
    assert eps_after == pytest.approx(ledger.spent(fp).epsilon) and eps_after > eps_before
    assert main(["--state-dir", str(tmp_path), "budget", "lower-cap", "nope", "1", "--reason", "x"]) == 2
    assert "no dataset named" in capsys.readouterr().err


def test_ledger_table_explains_its_counts(tmp_path):
    from privacy import events as ev
    from privacy.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.register_dataset("c" * 64, "toy", 8.0, 1e-5)
    ledger.reserve("c" * 64, "a", ev.ExponentialEvent(0.5))
    ledger.release("a", "ModelLoadError before any private record was read")
    table = ledger.summary_table({"c" * 64: "the largest target_epsilon that still fits: ≈ 7.123"})
    header = next(l for l in table.splitlines() if l.startswith("dataset"))
    assert header.split()[2] == "unit" and header.split()[7:11] == ["reserved", "committed", "released", "aborted"]
    for needle in ("reserved = holding a reservation", "committed = finished", "released = failed before reading",
                   "aborted = cancelled", "ε composes sub-additively", "≈ 7.123"):
        assert needle in table, needle
