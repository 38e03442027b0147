"""One DP output per charge, and one δ policy for every method.

* A retry (Prefect calls the lifecycle again with the same flow run id) after the commit
  republishes the stored DP output: no private read, no training, one published output, one
  charge. A committed run whose stored output is gone is refused, never trained again. A crash
  between storing the output and committing reuses the stored output; a retry after an attempt
  lost between its first private read and the storing is refused (the lost attempt's reservation
  stays spent: a second run of the mechanism would need a second charge).
* δ: the default is min(1e-5, 1/(10 n)), rounded down, for every method; a configured
  δ ≥ 1/n is refused unless the config opts in, and an opted-in run says so in its run record.

Runs the lifecycle directly (no Prefect) on a tiny model."""

import warnings
from pathlib import Path

import pytest
import yaml

from tests.pipeline.test_flow import _config, _mlflow, _toy_dataset

REPO = Path(__file__).resolve().parents[2]


class Crash(RuntimeError):
    pass


def _context(root: Path, sst2_dir: Path, **extra):
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.record import RunRecord, client, ensure_experiment
    from tasks.stages import StageContext
    from tasks.state import state_paths

    data = root / "data"
    if not data.is_dir():
        _toy_dataset(data, sst2_dir, n_train=120, n_test=20)
    state = root / "state"
    cfg = parse_config(_config(data, state, **extra))
    paths = state_paths(str(state)).create()
    part = partition_dataset(cfg.data, cfg.seed, paths.private, None)
    mlflow = client(paths)
    parent = RunRecord.create(mlflow, ensure_experiment(mlflow, cfg.experiment, paths), "parent", {})
    return StageContext(cfg=cfg, state_dir=str(state), partition=part.to_dict(),
                        parent_run_id=parent.run_id, flow_run_id="flow-run-1")


@pytest.fixture
def spies(monkeypatch):
    """Counts the private reads and trainings of prompt_dpsgd, and keeps what each training made."""
    from tasks import lifecycle
    from tasks.methods import get_method

    method_cls = type(get_method("prompt_dpsgd").mechanism)
    real_train, real_read = method_cls.train, lifecycle.read_private_rows
    seen = {"reads": 0, "trained": []}

    def read(*args, **kwargs):
        seen["reads"] += 1
        return real_read(*args, **kwargs)

    def train(self, *args, **kwargs):
        out = real_train(self, *args, **kwargs)
        seen["trained"].append(out.prompt.detach().clone())
        return out

    monkeypatch.setattr(lifecycle, "read_private_rows", read)
    monkeypatch.setattr(method_cls, "train", train)
    return seen


def _crash_commit(monkeypatch, after: bool):
    """Ledger.commit raises on its first call: after recording the commit, or before."""
    from privacy.ledger import Ledger

    real = Ledger.commit
    calls = []

    def commit(self, run_id, event):
        calls.append(run_id)
        if len(calls) == 1 and not after:
            raise Crash("worker lost before the commit")
        out = real(self, run_id, event)
        if len(calls) == 1:
            raise Crash("worker lost after the commit")
        return out

    monkeypatch.setattr(Ledger, "commit", commit)
    return calls


def _dp_entries(ctx):
    from privacy.ledger import Ledger

    return [e for e in Ledger(ctx.paths.ledger).entries(ctx.part.dataset_key) if e["kind"] == "dp"]


def _published_prompts(ctx):
    """(prompt files in the run's outputs, prompt artifacts over all child runs of the parent)."""
    client = _mlflow(ctx.paths.root)
    parent = client.get_run(ctx.parent_run_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{ctx.parent_run_id}'")
    artifacts = [a.path for c in children for a in client.list_artifacts(c.info.run_id, "prompt")]
    return sorted(p.name for p in ctx.output_dir.glob("*.safetensors")), artifacts


@pytest.mark.slow  # suite time (20-27 s): the crash-between-store-and-commit test and
# tests/ledger/test_preflight_budget.py keep the claim in the default suite
def test_a_retry_after_the_commit_republishes_the_one_output_under_one_charge(tmp_path, sst2_dir, monkeypatch,
                                                                               spies):
    import torch

    from privacy.ledger import Ledger
    from tasks.release_store import release_dir
    from tasks.lifecycle import run_method
    from tasks.prompts import load_prompt_file

    ctx = _context(tmp_path, sst2_dir)
    calls = _crash_commit(monkeypatch, after=True)
    with pytest.raises(Crash, match="after the commit"):
        run_method(ctx, "prompt_dpsgd", {})
    (entry,) = _dp_entries(ctx)
    assert entry["status"] == "committed" and len(spies["trained"]) == 1 and spies["reads"] == 1
    assert _published_prompts(ctx) == ([], [])  # crashed before publishing
    spent = Ledger(ctx.paths.ledger).spent(ctx.part.dataset_key).epsilon

    again = run_method(ctx, "prompt_dpsgd", {})  # the Prefect retry: same flow run id, same run key
    assert again.republished and again.reserved_new is False
    assert len(spies["trained"]) == 1 and spies["reads"] == 1  # no second training, no private read
    assert calls == ["flow-run-1:prompt_dpsgd"] * 2  # the retry's commit is the idempotent no-op
    (after,) = _dp_entries(ctx)  # one charge
    assert after["status"] == "committed" and after["epsilon"] == pytest.approx(entry["epsilon"])
    assert Ledger(ctx.paths.ledger).spent(ctx.part.dataset_key).epsilon == pytest.approx(spent)
    assert again.spend["epsilon"] == pytest.approx(entry["epsilon"], rel=1e-3)
    files, artifacts = _published_prompts(ctx)
    assert files == ["prompt_dpsgd.safetensors"] and artifacts == ["prompt/prompt_dpsgd.safetensors"]
    published = load_prompt_file(again.prompt_path)
    assert torch.equal(published, spies["trained"][0].to(published.dtype))  # the first training's output
    assert (release_dir(ctx.private_run_dir) / "prompt_dpsgd.json").is_file()
    assert release_dir(ctx.private_run_dir).parent.parent.parent == ctx.paths.private  # stored on the private side

    third = run_method(ctx, "prompt_dpsgd", {})  # retrying a finished run is harmless too
    assert torch.equal(load_prompt_file(third.prompt_path), published) and len(spies["trained"]) == 1
    assert len(_dp_entries(ctx)) == 1 and _published_prompts(ctx)[0] == ["prompt_dpsgd.safetensors"]


@pytest.mark.slow  # suite time: runs with -m slow
def test_a_committed_run_without_its_stored_output_is_refused_not_retrained(tmp_path, sst2_dir, monkeypatch, spies):
    from tasks.release_store import ReleaseError, release_dir
    from tasks.lifecycle import run_method

    ctx = _context(tmp_path, sst2_dir)
    _crash_commit(monkeypatch, after=True)
    with pytest.raises(Crash):
        run_method(ctx, "prompt_dpsgd", {})
    (stored,) = release_dir(ctx.private_run_dir).glob("prompt_dpsgd_dp_output.*.safetensors")
    stored.write_bytes(stored.read_bytes()[:-4] + b"\x00\x00\x00\x00")  # changed
    with pytest.raises(ReleaseError, match="was changed after it was stored.*new flow run"):
        run_method(ctx, "prompt_dpsgd", {})
    stored.unlink()
    with pytest.raises(ReleaseError, match="output file .* is missing"):
        run_method(ctx, "prompt_dpsgd", {})
    (release_dir(ctx.private_run_dir) / "prompt_dpsgd.json").unlink()
    with pytest.raises(ReleaseError, match="already committed .* stored output is missing"):
        run_method(ctx, "prompt_dpsgd", {})
    assert len(spies["trained"]) == 1 and spies["reads"] == 1
    assert len(_dp_entries(ctx)) == 1 and _published_prompts(ctx) == ([], [])


def test_a_crash_between_storing_and_committing_reuses_the_stored_output(tmp_path, sst2_dir, monkeypatch, spies):
    import torch

    from tasks.lifecycle import run_method
    from tasks.prompts import load_prompt_file

    ctx = _context(tmp_path, sst2_dir)
    _crash_commit(monkeypatch, after=False)
    with pytest.raises(Crash, match="before the commit"):
        run_method(ctx, "prompt_dpsgd", {})
    assert [e["status"] for e in _dp_entries(ctx)] == ["reserved"]  # counts in full meanwhile
    again = run_method(ctx, "prompt_dpsgd", {})
    assert again.republished and len(spies["trained"]) == 1 and spies["reads"] == 1
    assert [e["status"] for e in _dp_entries(ctx)] == ["committed"]
    assert torch.equal(load_prompt_file(again.prompt_path), spies["trained"][0].to(torch.float32))


@pytest.mark.slow  # suite time (20-27 s): the crash-between-store-and-commit test and
# tests/ledger/test_preflight_budget.py keep the claim in the default suite
def test_a_retry_after_a_lost_attempt_that_read_private_rows_is_refused_and_its_reservation_stays_spent(
        tmp_path, sst2_dir, monkeypatch, spies):
    """An attempt lost after its first private read ran part of the mechanism and may have shown
    some of its outputs (DP-OPT's per-query progress): its reservation covers that. A retry that
    trained again under the same charge would expose a second run of the mechanism (a review: 200
    lost queries + 400 retried ones, ε 2.19, committed as 1.74), so it is refused, reads nothing,
    trains nothing, publishes nothing, and the reservation stays counted."""
    from tasks import lifecycle
    from tasks.release_store import ReleaseError
    from tasks.lifecycle import run_method

    ctx = _context(tmp_path, sst2_dir)
    real_store = lifecycle.store_release
    attempts = []

    def store(*args, **kwargs):
        attempts.append(1)
        if len(attempts) == 1:
            raise Crash("worker lost while training")
        return real_store(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "store_release", store)
    with pytest.raises(Crash):
        run_method(ctx, "prompt_dpsgd", {})
    (reserved,) = _dp_entries(ctx)
    assert reserved["status"] == "reserved" and reserved["read_started_at"] is not None
    reads = spies["reads"]
    with pytest.raises(ReleaseError, match="began reading private data at .* [(]lost, or still running[)]"):
        run_method(ctx, "prompt_dpsgd", {})
    assert spies["reads"] == reads and len(spies["trained"]) == 1  # nothing read or trained again
    (entry,) = _dp_entries(ctx)
    assert entry["status"] == "reserved" and entry["epsilon_reserved"] == pytest.approx(reserved["epsilon_reserved"])
    from privacy.ledger import Ledger

    assert Ledger(ctx.paths.ledger).spent(ctx.part.dataset_key).epsilon == pytest.approx(reserved["epsilon_reserved"])
    assert _published_prompts(ctx) == ([], [])


@pytest.mark.slow  # suite time: runs with -m slow
def test_two_attempts_alive_at_once_release_one_output(tmp_path, sst2_dir, monkeypatch, spies):
    """A worker declared lost keeps running while its retry starts: the retry finds the run's
    reservation already marked read, so it is refused before it reads or trains anything; the
    first attempt stores, commits and publishes the one DP output under the one charge."""
    import torch

    from tasks import lifecycle
    from tasks.release_store import ReleaseError, release_dir
    from tasks.lifecycle import run_method
    from tasks.prompts import load_prompt_file

    ctx = _context(tmp_path, sst2_dir)
    real_store = lifecycle.store_release
    results = {}

    def store(*args, **kwargs):  # the first attempt, about to store, lets the retry run to the end
        monkeypatch.setattr(lifecycle, "store_release", real_store)
        with pytest.raises(ReleaseError) as refused:
            run_method(ctx, "prompt_dpsgd", {})
        results["retry"] = refused.value
        return real_store(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "store_release", store)
    first = run_method(ctx, "prompt_dpsgd", {})
    assert "began reading private data" in str(results["retry"])
    assert len(spies["trained"]) == 1 and spies["reads"] == 1 and not first.republished
    assert torch.equal(load_prompt_file(first.prompt_path), spies["trained"][0].to(torch.float32))
    (entry,) = _dp_entries(ctx)
    assert entry["status"] == "committed" and first.reserved_new is True
    assert len(list(release_dir(ctx.private_run_dir).glob("prompt_dpsgd_dp_output.*"))) == 1
    assert not list(release_dir(ctx.private_run_dir).glob("*.tmp"))
    files, _ = _published_prompts(ctx)
    assert files == ["prompt_dpsgd.safetensors"]


@pytest.mark.slow  # suite time (12 s): the read claim's race on the ledger itself stays in the default suite
# (tests/ledger/test_ledger_team.py: 6 processes, one claim)
def test_two_attempts_that_reach_the_first_read_together_read_once(tmp_path, sst2_dir, monkeypatch, spies):
    """Two attempts of one run pass the reservation together and both reach the first private read:
    the read is claimed in one ledger transaction, so exactly one reads and trains; the other is
    refused before it reads (a check, then a mark in a second transaction, let both read and train
    under one reservation)."""
    import threading
    import time

    from privacy.ledger import Ledger
    from tasks import lifecycle
    from tasks.release_store import ReleaseError
    from tasks.lifecycle import run_method

    ctx = _context(tmp_path, sst2_dir)
    together = threading.Barrier(2, timeout=120)
    real_reserve, real_entry = lifecycle.reserve, Ledger.entry

    def reserve(door):
        real_reserve(door)
        together.wait()  # both attempts reserved (one entry: reserve is idempotent per run)

    def slow_entry(self, run_id):  # widens any window between a check of the entry and a later mark
        row = real_entry(self, run_id)
        time.sleep(0.3)
        return row

    monkeypatch.setattr(lifecycle, "reserve", reserve)
    monkeypatch.setattr(Ledger, "entry", slow_entry)
    results = []

    def attempt():
        try:
            results.append(run_method(ctx, "prompt_dpsgd", {}))
        except ReleaseError as exc:
            results.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert spies["reads"] == 1 and len(spies["trained"]) == 1
    refused = [r for r in results if isinstance(r, ReleaseError)]
    assert len(results) == 2 and len(refused) == 1 and "began reading private data" in str(refused[0])
    (entry,) = _dp_entries(ctx)
    assert entry["status"] == "committed"
    assert [r["action"] for r in Ledger(ctx.paths.ledger).trail()].count("mark_read") == 1


# ---- δ ----------------------------------------------------------------------------------------

def _cfg(tmp_path, **privacy):
    from tasks.config import parse_config

    raw = _config(tmp_path / "data", tmp_path / "state")
    raw["privacy"].update(privacy)
    return parse_config(raw)


def test_default_delta_is_capped_at_a_tenth_of_one_over_n_for_every_method(tmp_path):
    from tasks.run_plan import resolve_delta

    cfg = _cfg(tmp_path)
    assert resolve_delta(cfg, 2000) == pytest.approx(1e-5)
    assert resolve_delta(cfg, 500) == pytest.approx(1e-5)
    assert resolve_delta(cfg, 200_000) == pytest.approx(5e-7)  # min(1e-5, 1/(10 n))
    for n, expected in ((67_349, 1e-6), (40_000, 2e-6), (41_000, 2e-6), (400_000, 2e-7), (10_000, 1e-5)):
        assert resolve_delta(cfg, n) == expected  # 0.1/n rounded down to 1, 2 or 5 × 10^k
    with pytest.raises(ValueError, match="n_train >= 1"):
        resolve_delta(cfg, 0)


def test_a_delta_of_one_over_n_is_refused_unless_the_config_opts_in(tmp_path):
    from tasks.errors import ConfigError
    from tasks.run_plan import delta_opt_in
    from tasks.run_plan import resolve_delta

    cfg = _cfg(tmp_path, target_delta=5e-4)
    with pytest.raises(ConfigError, match=r"privacy\.target_delta=0\.0005 is >= 1/n .*"
                                          r"allow_delta_at_least_one_over_n") as refused:
        resolve_delta(cfg, 2000)
    # n (a released size) is not in the message: it is shown before any charge covers it
    assert "2000" not in str(refused.value) and "0.0005 is >= 1/n =" not in str(refused.value)
    assert resolve_delta(cfg, 1000) == pytest.approx(5e-4)  # below 1/n: allowed
    assert not delta_opt_in(cfg, 1000, 5e-4)
    opted = _cfg(tmp_path, target_delta=5e-4, allow_delta_at_least_one_over_n=True)
    with pytest.warns(UserWarning, match="1/n"):
        assert resolve_delta(opted, 2000) == pytest.approx(5e-4)
    assert delta_opt_in(opted, 2000, 5e-4) and not delta_opt_in(opted, 1000, 5e-4)
    with pytest.raises(ValueError, match="allow_delta_at_least_one_over_n: .*true needs an explicit "
                                         "privacy.target_delta"):
        _cfg(tmp_path, allow_delta_at_least_one_over_n=True)


def test_check_delta_refuses_or_warns_at_one_over_n():
    from privacy.validation import check_delta

    with pytest.raises(ValueError, match=r"delta=0\.001 is >= 1/n .*use δ <= 1/\(10 n\)"):
        check_delta(1e-3, n=1000, allow_at_least_one_over_n=False)
    with pytest.warns(UserWarning, match="permits releasing whole records"):
        assert check_delta(1e-3, n=1000) == 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_delta(1e-4, n=1000, allow_at_least_one_over_n=False) == 1e-4
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        check_delta(1e-4, n=0)
    with pytest.raises(ValueError, match="allow_at_least_one_over_n must be a bool"):
        check_delta(1e-4, n=10, allow_at_least_one_over_n="yes")


@pytest.mark.slow  # suite time: runs with -m slow
def test_an_opted_in_run_says_so_in_its_run_record(tmp_path, sst2_dir):
    from privacy.ledger import Ledger
    from tasks.lifecycle import run_method

    ctx = _context(tmp_path, sst2_dir)
    n = ctx.part.n_train
    ctx = _context(tmp_path, sst2_dir, **{"privacy.target_delta": 1.0 / n,
                                          "privacy.allow_delta_at_least_one_over_n": True})
    with pytest.warns(UserWarning, match="1/n"):
        info = run_method(ctx, "prompt_dpsgd", {})
    client = _mlflow(ctx.paths.root)
    assert client.get_run(ctx.parent_run_id).data.tags["privacy.delta_opt_in"] == "true"
    parent = client.get_run(ctx.parent_run_id)
    (child,) = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{ctx.parent_run_id}'")
    assert child.data.params["privacy.delta_opt_in"] == "true" and info.spend["delta"] == pytest.approx(1.0 / n)
    (entry,) = [e for e in Ledger(ctx.paths.ledger).entries() if e["kind"] == "dp"]
    assert "allow_delta_at_least_one_over_n" in entry["description"]


def test_sweep_config_uses_a_delta_far_below_one_over_n():
    raw = yaml.safe_load((REPO / "configs" / "sweep.yaml").read_text())
    data = raw["data"]
    expected_n = data.get("train_size") or data["train_fraction"] * 67_349  # SST-2's training records
    assert raw["privacy"]["target_delta"] <= 1.0 / (10 * expected_n)
    assert not raw["privacy"].get("allow_delta_at_least_one_over_n", False)
    for path in sorted((REPO / "configs").glob("*.yaml")):  # no config opts in to δ ≥ 1/n silently
        privacy = (yaml.safe_load(path.read_text()) or {}).get("privacy") or {}
        assert not privacy.get("allow_delta_at_least_one_over_n", False), path
