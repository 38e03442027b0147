"""Served dp_icl compared with zero-shot before its first answer (`privprompt predict --dp-icl`): the
comparison is charged once as planned (H answered held-out queries and one released count), kept per
settings in the state folder (public numbers only, 0600), printed with its decision; when it loses,
queries are answered zero-shot and nothing more is charged; `plan` prices it and σ is calibrated for
it; a holdout smaller than H is padded, never revealed by the charge."""

from __future__ import annotations

import json
import os

import pytest

from privacy import accountant as acct
from privacy.events import ComposedEvent
from privacy.ledger import Ledger
from tasks.dp_icl import COMPARISONS_FILE, batch_event, comparison_event
from tests.pipeline.test_dp_icl_served import _queries, _write_config
from tests.pipeline.test_flow import _toy_dataset

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def toy(sst2_dir, tmp_path_factory):
    return _toy_dataset(tmp_path_factory.mktemp("dpicl-compared") / "data", sst2_dir, n_train=60, n_test=10)


def _compared_config(toy, tmp_path, **dp_icl):
    import yaml

    path = _write_config(toy, tmp_path, **{"compare_queries": 6, **dp_icl})
    cfg = yaml.safe_load(path.read_text())
    cfg["fallback"] = {"enabled": True}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _predict(config, queries, out, *extra):
    from privprompt_cli import main

    return main(["predict", "--dp-icl", str(config), "--input", str(queries), "--text-field", "review",
                 "--batch-size", "3", "--output", str(out), *extra])


def _entries(tmp_path):
    ledger = Ledger(tmp_path / "state" / "ledger.sqlite")
    return ledger, [e for e in ledger.entries() if e["kind"] == "dp"]


def _noise(config):
    from tasks.config import load_config
    from tasks.dp_icl import comparison_noise

    return comparison_noise(load_config(config), 1e-5)


def test_the_comparison_runs_once_charged_as_planned_and_is_kept(toy, tmp_path, capsys, monkeypatch):
    import tasks.dp_icl as dp_icl

    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: 1000)  # the vote wins: queries answered by it
    config, queries, out = _compared_config(toy, tmp_path), _queries(tmp_path, 3), tmp_path / "out.jsonl"
    assert _predict(config, queries, out) == 0
    err = capsys.readouterr().err
    ledger, entries = _entries(tmp_path)
    assert [e["status"] for e in entries] == ["committed", "committed"]  # the comparison, then one batch of 3
    assert "comparison with zero-shot, 6 answered held-out queries" in entries[0]["description"]
    noise = _noise(config)
    (dataset,) = ledger.datasets()
    planned = ComposedEvent((batch_event(3.0, 6), comparison_event(noise), batch_event(3.0, 3)))
    assert ledger.spent(dataset["fingerprint"]).epsilon == pytest.approx(acct.spend(planned, 1e-5).epsilon, rel=1e-3)
    assert "released comparison with zero-shot (no demonstration) on 6 held-out private queries" in err
    assert "better than zero-shot beyond its noise" in err and "not compared" not in err
    assert "1 charged batch(es)" in err
    kept = tmp_path / "state" / COMPARISONS_FILE
    assert oct(os.stat(kept).st_mode & 0o777) == "0o600"
    (result,) = json.loads(kept.read_text()).values()
    assert set(result) == {"difference", "sigma", "queries", "run_id"} and result["queries"] == 6
    assert result["run_id"] == entries[0]["run_id"]
    assert result["sigma"] == pytest.approx(noise)
    private = [json.loads(line)["text"] for line in (toy / "train.jsonl").read_text().splitlines()]
    assert not any(t in err or t in kept.read_text() or t in out.read_text() for t in private)
    # a second call reuses it: one more batch, no second comparison
    assert _predict(config, queries, out) == 0
    _, entries = _entries(tmp_path)
    assert len(entries) == 3 and "comparison" not in entries[2]["description"]
    # another setting is compared anew
    other = _compared_config(toy, tmp_path, noise_multiplier=4.0)
    assert _predict(other, queries, out) == 0
    _, entries = _entries(tmp_path)
    assert sum("comparison" in e["description"] for e in entries) == 2
    assert len(json.loads(kept.read_text())) == 2


def test_a_lost_comparison_answers_zero_shot_and_charges_nothing_more(toy, tmp_path, capsys, monkeypatch):
    import tasks.dp_icl as dp_icl

    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: -1000)  # the vote loses beyond any noise
    config, queries, out = _compared_config(toy, tmp_path), _queries(tmp_path, 5), tmp_path / "out.jsonl"
    assert _predict(config, queries, out) == 0
    err = capsys.readouterr().err
    _, entries = _entries(tmp_path)
    assert len(entries) == 1 and "comparison" in entries[0]["description"]  # the answers charged nothing
    assert "WORSE than zero-shot" in err and "answered zero-shot" in err and "nothing charged for them" in err
    answers = [json.loads(line)["prediction"] for line in out.read_text().splitlines()]
    # they are the zero-shot answers of the same model
    from tasks.config import load_config
    from tasks.dp_icl import open_server
    from tasks.state import state_paths

    served = open_server(load_config(config), state_paths(str(tmp_path / "state")))
    texts = [json.loads(line)["review"] for line in queries.read_text().splitlines()]
    assert answers == served.server.zero_shot(texts)
    assert served.holdout is None and served.compare_queries == 0  # kept: no holdout read again
    # the next call charges nothing at all
    assert _predict(config, queries, out) == 0
    _, entries = _entries(tmp_path)
    assert len(entries) == 1


def test_with_fallback_off_a_lost_comparison_warns_and_answers_by_the_vote(toy, tmp_path, capsys, monkeypatch):
    import yaml

    import tasks.dp_icl as dp_icl

    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: -1000)
    config, queries, out = _compared_config(toy, tmp_path), _queries(tmp_path, 3), tmp_path / "out.jsonl"
    cfg = yaml.safe_load(config.read_text())
    cfg["fallback"] = {"enabled": False}
    config.write_text(yaml.safe_dump(cfg))
    assert _predict(config, queries, out) == 0
    err = capsys.readouterr().err
    _, entries = _entries(tmp_path)
    assert len(entries) == 2  # the comparison and the answers' batch
    assert "WARNING worse than zero-shot, answered by the vote anyway" in err


def test_a_holdout_smaller_than_h_is_padded_and_the_charge_is_h(toy, tmp_path, monkeypatch):
    import tasks.dp_icl as dp_icl

    seen = {}

    def count(votes, zero, labels):
        seen["real"] = sum(y is not None for y in labels)
        seen["order"] = [y is not None for y in labels]
        seen["all"] = len(labels)
        return 1000  # a win: the query is then answered by the vote and charged

    monkeypatch.setattr(dp_icl, "compared_difference", count)
    config, queries, out = _compared_config(toy, tmp_path, compare_queries=40), _queries(tmp_path, 1), tmp_path / "o.jsonl"
    assert _predict(config, queries, out) == 0
    assert seen["all"] == 40 and 0 < seen["real"] < 40  # the toy holdout holds ≈ 14 rows: padded with public queries
    assert seen["order"][-seen["real"]:] != [True] * seen["real"]  # the padding sits at secret places, not last
    ledger, entries = _entries(tmp_path)
    (dataset,) = ledger.datasets()
    planned = ComposedEvent((batch_event(3.0, 40), comparison_event(_noise(config)), batch_event(3.0, 1)))
    assert ledger.spent(dataset["fingerprint"]).epsilon == pytest.approx(acct.spend(planned, 1e-5).epsilon, rel=1e-3)


def test_the_comparison_and_the_queries_past_the_cap_are_refused_before_anything(toy, tmp_path, capsys):
    config = _compared_config(toy, tmp_path, compare_queries=60)
    import yaml

    cfg = yaml.safe_load(config.read_text())
    cfg["privacy"]["dataset_epsilon_cap"] = 1.0
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out.jsonl"
    assert _predict(config, _queries(tmp_path, 1), out) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "over its cap" in err[0] and "nothing answered" in err[0]
    _, entries = _entries(tmp_path)
    assert entries == [] and not (tmp_path / "state" / COMPARISONS_FILE).exists()


def test_sigma_is_calibrated_for_the_queries_and_the_comparison_and_plan_prices_both(toy, tmp_path):
    from tasks.config import load_config
    from tasks.data import ReleasedSizes
    from tasks.dp_icl import comparison_noise, first_batch_event, plan_line, settings_of

    cfg = load_config(_compared_config(toy, tmp_path, noise_multiplier=None, expected_queries=100, compare_queries=20))
    sizes = ReleasedSizes(48, 10, 10, 50.0)
    sigma, noise = settings_of(cfg, 1e-5, sizes).noise_multiplier, comparison_noise(cfg, 1e-5)
    total = acct.spend(first_batch_event(sigma, 120, None, None, comparison_event(noise)), 1e-5).epsilon
    assert total <= cfg.privacy.target_epsilon + 1e-9 and total == pytest.approx(cfg.privacy.target_epsilon, rel=3e-2)
    # the count alone at its share (fallback.epsilon_share of the target, a tenth of δ): its ε at that δ
    assert acct.spend(comparison_event(noise), 1e-6).epsilon == pytest.approx(
        cfg.privacy.target_epsilon * cfg.fallback.epsilon_share, rel=1e-2)
    # calibrated on the event the ledger is charged: the comparison's held-out batch and count (the
    # sizes' release in front under poisson sampling, adaptive), then the queries
    from privacy.plan import with_release, with_size_release
    from tasks.dp_icl import batch_event

    charged = with_release(with_size_release(batch_event(sigma, 20, 0.5), sizes.event), comparison_event(noise))
    assert first_batch_event(sigma, 20, 0.5, sizes.event, comparison_event(noise)) == charged
    line = plan_line(cfg, 1e-5, sizes)
    assert "with the comparison with zero-shot first (20 held-out queries" in line
    assert f"spend ε={total:.4f}" in line
    off = load_config(_compared_config(toy, tmp_path, compare_queries=0))
    assert "no comparison with zero-shot" in plan_line(off, 1e-5, sizes)


def test_a_kept_comparison_is_done_as_todays_fallback_says(toy, tmp_path, capsys, monkeypatch):
    """Review 11, F1: a comparison lost under fallback.enabled, then the setting turned off — the line says
    what was done (answered by the vote, charged), not what the first call did."""
    import yaml

    import tasks.dp_icl as dp_icl

    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: -1000)
    config, queries, out = _compared_config(toy, tmp_path), _queries(tmp_path, 3), tmp_path / "out.jsonl"
    assert _predict(config, queries, out) == 0
    assert "answered zero-shot" in capsys.readouterr().err
    cfg = yaml.safe_load(config.read_text())
    cfg["fallback"] = {"enabled": False}
    config.write_text(yaml.safe_dump(cfg))
    assert _predict(config, queries, out) == 0
    err = capsys.readouterr().err
    assert "answered by the vote anyway" in err and "answered zero-shot" not in err and "1 charged batch(es)" in err
    _, entries = _entries(tmp_path)
    assert len(entries) == 2  # the first comparison, kept; then one charged batch


def test_another_split_or_a_replaced_ledger_is_compared_anew(toy, tmp_path, monkeypatch):
    """Review 11, F2: the kept comparison holds for its partition (another holdout_fraction: another
    training split) and for the ledger that holds its charge."""
    import yaml

    import tasks.dp_icl as dp_icl

    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: 1000)
    config, queries, out = _compared_config(toy, tmp_path), _queries(tmp_path, 1), tmp_path / "out.jsonl"
    assert _predict(config, queries, out) == 0
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["holdout_fraction"] = 0.5
    config.write_text(yaml.safe_dump(cfg))
    assert _predict(config, queries, out) == 0
    _, entries = _entries(tmp_path)
    assert sum("comparison" in e["description"] for e in entries) == 2
    (tmp_path / "state" / "ledger.sqlite").unlink()  # a fresh ledger: the kept result's charge is not in it
    assert _predict(config, queries, out) == 0
    _, entries = _entries(tmp_path)
    assert [("comparison" in e["description"]) for e in entries] == [True, False]


def test_the_refusal_counts_the_comparison_due_and_the_ledger_lists_it_apart(toy, tmp_path, capsys, monkeypatch):
    """Review 11, F5: 'N more fit' leaves room for the comparison still due; `privprompt ledger` counts
    its held-out queries apart from the answered ones."""
    import yaml

    import tasks.dp_icl as dp_icl
    from privprompt_cli import main
    from tasks.config import load_config
    from tasks.dp_icl import check_fits, open_server
    from tasks.state import state_paths

    config = _compared_config(toy, tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["privacy"]["dataset_epsilon_cap"] = 12.0
    config.write_text(yaml.safe_dump(cfg))
    assert _predict(config, _queries(tmp_path, 200), tmp_path / "o.jsonl") != 0
    line = capsys.readouterr().err.strip().splitlines()[0]
    fit = int(line.split("; ")[-2].split(" more fit")[0])
    served = open_server(load_config(config), state_paths(str(tmp_path / "state")))
    check_fits(served, fit, fit)  # the comparison and that many fit …
    with pytest.raises(Exception, match="over its cap"):
        check_fits(served, fit + 1, fit + 1)  # … one more does not
    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: 1000)
    assert _predict(config, _queries(tmp_path, 2), tmp_path / "o.jsonl") == 0
    capsys.readouterr()
    assert main(["--state-dir", str(tmp_path / "state"), "ledger"]) == 0
    out = capsys.readouterr().out
    assert "2 queries charged to dp_icl in 1 batch and 1 comparison with zero-shot (6 held-out queries in all" in out


def test_the_served_objects_repr_holds_no_holdout_text(toy, tmp_path):
    """Review 11, F6: a traceback or a debugger printing the served object shows no private row."""
    from tasks.config import load_config
    from tasks.dp_icl import open_server
    from tasks.state import state_paths

    served = open_server(load_config(_compared_config(toy, tmp_path)), state_paths(str(tmp_path / "state")))
    texts, _ = served.holdout
    assert texts and not any(t in repr(served) for t in texts)


def test_the_models_own_placement_is_in_the_digest(toy, tmp_path):
    """Review 11b, G1: `models.placement_for` is keyed by the model's name; another dtype there loads
    another model, and is compared anew."""
    import yaml

    from tasks.config import load_config
    from tasks.dp_icl import open_server
    from tasks.state import state_paths

    config = _compared_config(toy, tmp_path)
    first = open_server(load_config(config), state_paths(str(tmp_path / "state"))).compare_digest
    cfg = yaml.safe_load(config.read_text())
    cfg["models"]["placement_for"] = {"tiny-gpt2": {"dtype": "bfloat16"}}
    config.write_text(yaml.safe_dump(cfg))
    assert open_server(load_config(config), state_paths(str(tmp_path / "state"))).compare_digest != first


def test_a_comparison_refused_at_its_reservation_says_nothing_was_charged(toy, tmp_path, capsys, monkeypatch):
    """Review 11b, G2: another spend taking the room between the check and the comparison's reservation:
    the line says nothing was charged, as the ledger shows."""
    import tasks.dp_icl as dp_icl
    from privacy.ledger.errors import BudgetExceededError

    def refused(self, *a, **k):
        raise BudgetExceededError("privacy budget exhausted (test)", fingerprint="f", name="n", needed=1.0,
                                  spent=0.0, total=1.0, cap=1.0, delta=1e-5)

    monkeypatch.setattr(dp_icl.DPICLServer, "compare", refused)
    config, out = _compared_config(toy, tmp_path), tmp_path / "out.jsonl"
    assert _predict(config, _queries(tmp_path, 2), out) != 0
    err = capsys.readouterr().err
    assert "refused before its charge (nothing charged)" in err and "stays spent" not in err
    _, entries = _entries(tmp_path)
    assert entries == []


def test_an_empty_input_is_refused_before_anything(toy, tmp_path, capsys):
    """Review 11b, G3: no query, no comparison: nothing read, nothing charged."""
    config, queries, out = _compared_config(toy, tmp_path), tmp_path / "empty.csv", tmp_path / "out.jsonl"
    queries.write_text("review\n")
    assert _predict(config, queries, out) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no rows" in err[0] and "nothing charged" in err[0]
    assert not (tmp_path / "state" / "ledger.sqlite").exists() and not out.exists()


def test_a_damaged_comparisons_file_is_one_line(toy, tmp_path, capsys):
    """Review 11b, G6: a damaged kept-comparisons file is named in one line, nothing charged."""
    config, out = _compared_config(toy, tmp_path), tmp_path / "out.jsonl"
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    (tmp_path / "state" / COMPARISONS_FILE).write_text("{trunc")
    assert _predict(config, _queries(tmp_path, 2), out) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and COMPARISONS_FILE in err[0] and "cannot be read" in err[0]
    _, entries = _entries(tmp_path)
    assert entries == []


def test_the_data_root_is_found_as_the_flows_find_it(toy, tmp_path, capsys, monkeypatch):
    """`predict --dp-icl` on a config that names its dataset only (no data.path): the data root is
    $PRIVPROMPT_DATA_ROOT or ../shared/data, as for `privprompt run` (it failed with 'no data root')."""
    import yaml

    import tasks.dp_icl as dp_icl

    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: 1000)
    monkeypatch.setenv("PRIVPROMPT_DATA_ROOT", str(toy.parent))
    config = _compared_config(toy, tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"].pop("path")
    cfg["data"]["name"] = toy.name
    config.write_text(yaml.safe_dump(cfg))
    assert _predict(config, _queries(tmp_path, 2), tmp_path / "out.jsonl") == 0, capsys.readouterr().err


def test_a_row_without_text_is_refused_before_anything(toy, tmp_path, capsys):
    """Review 11c, C1: a missing value (null in JSONL, an empty CSV cell) crashed a charged batch after
    the comparison was charged; it is refused in one line before anything is read."""
    config, out = _compared_config(toy, tmp_path), tmp_path / "out.jsonl"
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"review": "a fine film"}\n{"review": null}\n')
    assert _predict(config, queries, out) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 2" in err[0] and "nothing charged" in err[0]
    assert not (tmp_path / "state" / "ledger.sqlite").exists() and not out.exists()


def test_an_interrupt_before_a_batchs_reservation_says_nothing_under_way_was_charged(toy, tmp_path, capsys,
                                                                                     monkeypatch):
    """Review 11c, C3: after a kept comparison, Ctrl-C before the next batch's reservation: the line says
    the comparison was charged and kept, and claims no batch under way."""
    import tasks.dp_icl as dp_icl
    from privacy.ledger import Ledger as LedgerClass

    monkeypatch.setattr(dp_icl, "compared_difference", lambda *a: 1000)
    real = LedgerClass.reserve

    def reserve(self, fingerprint, run_id, event, **kw):
        if ":batch-" in run_id:
            raise KeyboardInterrupt
        return real(self, fingerprint, run_id, event, **kw)

    monkeypatch.setattr(LedgerClass, "reserve", reserve)
    config = _compared_config(toy, tmp_path)
    assert _predict(config, _queries(tmp_path, 2), tmp_path / "out.jsonl") == 130
    err = capsys.readouterr().err
    assert "comparison with zero-shot before them was charged and kept" in err and "batch under way" not in err
    _, entries = _entries(tmp_path)
    assert [e["status"] for e in entries] == ["committed"]
