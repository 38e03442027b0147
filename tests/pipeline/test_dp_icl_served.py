"""DP-ICL served from a config (`privprompt predict --dp-icl CONFIG`): the answers come from the
dataset's keyed training split, every batch is charged to the config's ledger exactly as planned,
queries past the cap are refused in one line before any is answered (nothing charged, nothing
written), a dataset of people is refused, `plan` prices the expected queries, and no private
text reaches the output."""

from __future__ import annotations

import json

import pytest
import yaml

from privacy import accountant as acct
from privacy.events import ComposedEvent
from privacy.ledger import Ledger
from tasks.data import ReleasedSizes
from tasks.dp_icl import batch_event
from tests.pipeline.test_flow import _config, _toy_dataset

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def toy(sst2_dir, tmp_path_factory):
    return _toy_dataset(tmp_path_factory.mktemp("dpicl") / "data", sst2_dir, n_train=60, n_test=10)


def _write_config(toy, tmp_path, cap=50.0, **dp_icl):
    cfg = _config(toy, tmp_path / "state", **{"models.local": "tiny-gpt2", "privacy.target_delta": 1e-5,
                                              "privacy.dataset_epsilon_cap": cap})
    cfg["dp_icl"] = {"subsets": 4, "shots": 2, "noise_multiplier": 3.0, "compare_queries": 0, **dp_icl}
    path = tmp_path / "dp_icl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _queries(tmp_path, n=5):
    path = tmp_path / "queries.jsonl"
    path.write_text("".join(json.dumps({"review": f"query number {i} , a fine film", "label": "positive"}) + "\n"
                            for i in range(n)))
    return path


def _dp_entries(tmp_path):
    ledger = Ledger(tmp_path / "state" / "ledger.sqlite")
    return ledger, [e for e in ledger.entries() if e["kind"] == "dp"]


def test_answers_are_charged_per_batch_exactly_as_planned(toy, tmp_path, capsys):
    from privprompt_cli import main

    config, queries, out = _write_config(toy, tmp_path), _queries(tmp_path), tmp_path / "out.jsonl"
    rc = main(["predict", "--dp-icl", str(config), "--input", str(queries), "--text-field", "review",
               "--batch-size", "2", "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and {r["prediction"] for r in rows} <= {"negative", "positive"}
    ledger, entries = _dp_entries(tmp_path)
    assert [e["status"] for e in entries] == ["committed"] * 3  # batches of 2, 2 and 1
    (dataset,) = ledger.datasets()
    expected = acct.spend(ComposedEvent((batch_event(3.0, 2), batch_event(3.0, 2), batch_event(3.0, 1))), 1e-5)
    assert ledger.spent(dataset["fingerprint"]).epsilon == pytest.approx(expected.epsilon, rel=1e-3)
    assert "3 charged batch(es)" in err and "per record at δ=1e-05" in err
    assert "not compared with zero-shot" in err  # never worse than no prompt in silence
    private = [json.loads(line)["text"] for line in (toy / "train.jsonl").read_text().splitlines()]
    assert not any(t in out.read_text() or t in err for t in private)  # answers only: no demonstration leaves
    assert main(["--state-dir", str(tmp_path / "state"), "ledger"]) == 0  # the ledger says it as such
    table = capsys.readouterr().out
    assert f"5 queries charged to dp_icl in 3 batches, ε={expected.epsilon:.4f} per record" in table


def test_queries_past_the_cap_are_refused_before_any_is_answered(toy, tmp_path, capsys):
    from privprompt_cli import main

    config, queries, out = _write_config(toy, tmp_path, cap=1.0), _queries(tmp_path, 40), tmp_path / "out.jsonl"
    rc = main(["predict", "--dp-icl", str(config), "--input", str(queries), "--text-field", "review",
               "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "over its cap" in err[0] and "nothing answered" in err[0]
    assert "more fit" in err[0]
    assert not out.exists()
    _, entries = _dp_entries(tmp_path)
    assert entries == []  # nothing reserved, nothing charged


def test_a_dataset_of_people_is_refused(toy, tmp_path):
    from privacy.ledger.errors import UnitMismatchError
    from tasks.config import load_config
    from tasks.dp_icl import open_server
    from tasks.state import state_paths

    cfg = load_config(_write_config(toy, tmp_path))
    served = open_server(cfg, state_paths(str(tmp_path / "state")))  # registers the dataset (per record)
    Ledger(tmp_path / "state" / "ledger.sqlite").change_unit(served.server.fingerprint, "customer_id",
                                                             reason="test: a dataset of people")
    with pytest.raises(UnitMismatchError, match="customer_id"):  # its per-query ε holds for one record only
        open_server(cfg, state_paths(str(tmp_path / "state")))


def test_sigma_is_calibrated_for_the_expected_queries_and_plan_prices_them(toy, tmp_path):
    from tasks.config import load_config
    from tasks.dp_icl import plan_line, settings_of

    cfg = load_config(_write_config(toy, tmp_path, noise_multiplier=None, expected_queries=100))
    sizes = ReleasedSizes(48, 10, 10, 50.0)
    sigma = settings_of(cfg, 1e-5, sizes).noise_multiplier
    assert acct.spend(batch_event(sigma, 100), 1e-5).epsilon == pytest.approx(cfg.privacy.target_epsilon, rel=1e-2)
    line = plan_line(cfg, 1e-5, sizes)
    assert "100 answered queries" in line and "per record at δ=1e-05" in line
    assert f"spend ε={acct.spend(batch_event(sigma, 100), 1e-5).epsilon:.4f}" in line
    most = int(line.split("which affords ")[1].split(" of them")[0].replace(",", ""))
    cap = cfg.privacy.dataset_epsilon_cap
    assert acct.spend(batch_event(sigma, most), 1e-5).epsilon <= cap < acct.spend(batch_event(sigma, most + 1), 1e-5).epsilon
    assert "and fit the dataset's cap" in line


def test_plan_prints_the_dp_icl_line_with_q_from_the_released_size(toy, tmp_path, capsys):
    from privprompt_commands.run import _print_dp_icl_plan
    from tasks.config import load_config
    from tasks.dp_icl import plan_line
    from tasks.planning import released_sizes
    from tasks.state import config_state_paths

    config = _write_config(toy, tmp_path, cap=2.0, sampling="poisson")  # a small cap: a short search for the most queries
    cfg = load_config(config)
    # what `privprompt plan` prints after its table (the whole command also times a probe run: slow)
    _print_dp_icl_plan(cfg, {"runs": [{"delta": 1e-5}]}, config_state_paths(cfg))
    out = capsys.readouterr().out
    sizes = released_sizes(cfg, config_state_paths(cfg).private)
    assert plan_line(cfg, 1e-5, sizes) in out and f"q={min(1.0, 8 / sizes.n_train):.3g}" in out


def test_a_delta_of_at_least_one_over_n_is_refused_as_for_runs(toy, tmp_path):
    from tasks.config import load_config
    from tasks.dp_icl import open_server
    from tasks.errors import ConfigError
    from tasks.state import state_paths

    path = _write_config(toy, tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["privacy"]["target_delta"] = 0.05  # ≥ 1/n for the toy's ~48 training rows
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="privacy.target_delta"):
        open_server(load_config(path), state_paths(str(tmp_path / "state")))
    assert not (tmp_path / "state" / "ledger.sqlite").exists() or Ledger(tmp_path / "state" / "ledger.sqlite").datasets() == []


def test_a_refusal_mid_way_keeps_the_answers_already_charged(toy, tmp_path, monkeypatch):
    from privacy.ledger.errors import BudgetExceededError
    from tasks.config import load_config
    from tasks.dp_icl import DPICLServer, answer_all, open_server
    from tasks.state import state_paths

    served = open_server(load_config(_write_config(toy, tmp_path)), state_paths(str(tmp_path / "state")))
    real, calls = DPICLServer.answer, []

    def answer(self, texts, keep=None):  # another run takes the room left after the first batch
        calls.append(len(texts))
        if len(calls) == 2:
            raise BudgetExceededError("over the cap", fingerprint="f", name="n", needed=1.0, spent=1.0, total=2.0,
                                      cap=1.5, delta=1e-5)
        return real(self, texts, keep)

    monkeypatch.setattr(DPICLServer, "answer", answer)
    answers, refusal = answer_all(served, ["good", "bad", "fine", "dull"], 2)
    assert len(answers) == 2 and isinstance(refusal, BudgetExceededError)
    (entry,) = [e for e in served.server.ledger.entries() if e["kind"] == "dp"]
    assert entry["status"] == "committed"  # the answered batch stays charged, and its answers are returned


def test_an_interrupt_writes_the_answers_already_charged_and_the_ledger_says_so(toy, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) mid-way: the batches already answered and charged are written, not thrown
    away (a retry would pay for them again); the stopped batch stays charged, and `privprompt ledger`
    counts it as charged, not answered (review 10, F3)."""
    import privprompt_cli
    from tasks.dp_icl import DPICLServer

    real, calls = DPICLServer.histogram, []

    def histogram(self, text):
        calls.append(text)
        if len(calls) == 3:  # inside the second batch of two
            raise KeyboardInterrupt
        return real(self, text)

    monkeypatch.setattr(DPICLServer, "histogram", histogram)
    out = tmp_path / "answers.jsonl"
    rc = privprompt_cli.main(["predict", "--dp-icl", str(_write_config(toy, tmp_path)), "--input",
                              str(_queries(tmp_path, 5)), "--text-field", "review", "--batch-size", "2",
                              "--output", str(out)])
    assert rc == 130
    assert "interrupted: 2 of 5 queries answered and charged (written)" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 2
    ledger, entries = _dp_entries(tmp_path)
    assert sorted(e["status"] for e in entries) == ["committed", "reserved"]
    assert privprompt_cli.main(["--state-dir", str(tmp_path / "state"), "ledger"]) == 0
    assert "4 queries charged to dp_icl (2 of them in batches not committed: stopped, or under way) in 2 batches" \
        in capsys.readouterr().out


def test_an_interrupt_at_the_commit_keeps_the_committed_batchs_answers(toy, tmp_path, monkeypatch):
    """Ctrl-C landing as a batch's charge is committed: the answers of that committed batch are kept
    (held until they are), the interrupt then stops the rest (review 10b, G4)."""
    import os
    import signal

    from privacy.ledger import Ledger as LedgerClass
    from tasks.config import load_config
    from tasks.dp_icl import answer_all, open_server
    from tasks.state import state_paths

    served = open_server(load_config(_write_config(toy, tmp_path)), state_paths(str(tmp_path / "state")))
    real = LedgerClass.commit

    def commit(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # delivered once the answers are kept
        return out

    monkeypatch.setattr(LedgerClass, "commit", commit)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # the CLI's (an earlier test may set another)
    try:
        answers, stop = answer_all(served, ["good", "bad", "fine", "dull"], 2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(stop, KeyboardInterrupt), stop
    assert len(answers) == 2
    assert [e["status"] for e in served.server.ledger.entries() if e["kind"] == "dp"] == ["committed"]


def test_public_refusals_come_before_any_private_read(toy, tmp_path, capsys):
    """A person unit in the config, and a batch size below one, are refused with one line before the
    training split is read or the dataset registered in the ledger (review 10, F4)."""
    import privprompt_cli

    cfg = yaml.safe_load(_write_config(toy, tmp_path).read_text())
    cfg["data"].update(person_field="author", max_records_per_unit=2)  # checked before any row is read
    path = tmp_path / "people.yaml"
    path.write_text(yaml.safe_dump(cfg))
    query = ["predict", "--dp-icl", str(path), "--input", str(_queries(tmp_path, 2)), "--text-field", "review"]
    assert privprompt_cli.main(query) == 2
    err = capsys.readouterr().err
    assert "its per-query ε holds for one record, not one person; refused" in err and "Traceback" not in err
    assert not (tmp_path / "state" / "ledger.sqlite").exists() and not (tmp_path / "state" / "private").exists()
    with pytest.raises(SystemExit) as stop:
        privprompt_cli.main(query + ["--batch-size", "0"])
    assert stop.value.code == 2 and "must be at least 1, got 0" in capsys.readouterr().err


def test_long_private_demonstrations_are_clipped_to_the_context_without_a_length_warning(toy, tmp_path, capfd):
    from tasks.config import load_config
    from tasks.dp_icl import open_server
    from tasks.methods import PrivateRows
    from tasks.state import state_paths

    served = open_server(load_config(_write_config(toy, tmp_path, shots=4)), state_paths(str(tmp_path / "state")))
    server = served.server
    long = PrivateRows([" ".join(["unbelievably"] * 40)] * 8, ["positive"] * 8)
    prompt = server._demos([(t, y) for t, y in zip(long.texts[:4], long.labels[:4])])
    context = server.engine.model.config.n_positions
    assert len(server.engine.ids(prompt)) <= context - 128
    assert "longer than the specified maximum" not in capfd.readouterr().err


def test_a_poisson_sampled_config_charges_each_batch_its_subsampled_event(toy, tmp_path, capsys):
    """sampling: poisson — q from the RELEASED training size, each answered query charged as
    PoissonSampled(q, Gaussian(σ)); plan prices the same event."""
    from privacy.events import GaussianEvent, PoissonSampledEvent, event_from_dict
    from privprompt_cli import main
    from tasks.config import load_config
    from tasks.dp_icl import answered_queries, plan_line, settings_of

    config, queries, out = _write_config(toy, tmp_path, sampling="poisson"), _queries(tmp_path, 3), tmp_path / "o.jsonl"
    raw = yaml.safe_load(config.read_text())
    raw["data"]["size_noise_sigma"] = 2.0  # ñ ≈ 48 ± 6: q = 8 / ñ stays under 1 (σ = 50 could make it 1: no sampling)
    config.write_text(yaml.safe_dump(raw))
    rc = main(["predict", "--dp-icl", str(config), "--input", str(queries), "--text-field", "review",
               "--batch-size", "3", "--output", str(out)])
    first = capsys.readouterr().err
    assert rc == 0, first
    # an output predict cannot write is refused in one line before anything is charged
    rc = main(["predict", "--dp-icl", str(config), "--input", str(queries), "--output", str(tmp_path / "o.txt")])
    err = capsys.readouterr().err
    assert rc != 0 and "unknown output format '.txt'" in err and err.count("\n") == 1
    ledger, entries = _dp_entries(tmp_path)
    sizes = json.loads(next((tmp_path / "state").rglob("released-sizes/*.json")).read_text())
    released = sizes["n_train"]
    q = min(1.0, 4 * 2 / released)
    (entry,) = [e for e in entries if e["description"].startswith("dp_icl:")]
    # q carries the released size into the answers: the first batch also charges the sizes' release
    charged = event_from_dict(entry["event"])
    size_release, votes = charged.first, charged.then
    assert size_release == GaussianEvent(sizes["sigma"]) and answered_queries(event_from_dict(entry["event"])) == 3
    assert votes.count == 3 and votes.event == PoissonSampledEvent(q, GaussianEvent(3.0))
    capsys.readouterr()
    assert main(["--state-dir", str(tmp_path / "state"), "ledger"]) == 0
    assert "3 queries charged to dp_icl in 1 batch," in capsys.readouterr().out
    cfg = load_config(config)
    rs = ReleasedSizes(released, sizes["n_holdout"], sizes["n_test"], sizes["sigma"])
    assert settings_of(cfg, 1e-5, rs).sample_rate == q
    # plan prices the same first batch: the votes and the sizes' release
    line = plan_line(cfg, 1e-5, rs)
    assert f"q={q:.3g}" in line
    assert f"spend ε={acct.spend(event_from_dict(entry['event']), 1e-5).epsilon:.4f}" in plan_line(
        load_config(config, ["dp_icl.expected_queries=3"]), 1e-5, rs)



def test_the_shipped_dp_icl_config_samples_per_query_and_fits_its_cap():
    from pathlib import Path

    from tasks.config import load_config
    from tasks.dp_icl import sample_rate_of

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "dp_icl.yaml")
    assert cfg.dp_icl.sampling == "poisson" and cfg.privacy.target_epsilon <= cfg.privacy.dataset_epsilon_cap
    assert sample_rate_of(cfg.dp_icl, 60_000) == pytest.approx(40 / 60_000)
