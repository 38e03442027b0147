"""RAPT through the method flow on a tiny model: an `ldp` run record (η, replacement rate, no ε),
the model side only ever reads privatized ids (a spy on what tuning and inference load), the
attacks as labelled audit statistics, and no private training text in anything published."""

from pathlib import Path

import pytest
import torch
from tests.conftest import key_with_records_in_training

from tests.pipeline.test_flow import _mlflow, _toy_dataset

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"
CANARY = "zqxv canary wombat ultramarine 7731"


def _config(data, state):
    return {
        "method": "rapt", "experiment": "rapt-tests", "seed": 0, "state_dir": str(state),
        "data": {"name": "toy-sst2", "path": str(data), "labels": ["negative", "positive"], "holdout_fraction": 0.2},
        "models": {"local": "tiny-bert", "max_length": 32},
        "public": {"name": "tweet_sentiment", "path": str(SHARED / "tweet_sentiment"), "size": 100},
        "methods": {"rapt": {"eta": 20.0, "plain_tokens": 6, "head_vocab": 200, "n_tokens": 2, "steps": 4,
                             "batch_size": 8}},
        "mia": {"enabled": False},
    }


@pytest.fixture(scope="module")
def rapt_run(prefect_harness, sst2_dir, tmp_path_factory):
    from flows.method_flow import method_flow
    from tasks.methods.rapt.method import RAPT, Rapt

    root = tmp_path_factory.mktemp("rapt")
    data = _toy_dataset(root / "data", sst2_dir, n_train=80, n_test=30, canaries=[CANARY])
    state = root / "state"
    loaded = []
    original = Rapt.load_privatized

    def spy(path):
        out = original(path)
        loaded.append((Path(path), out))
        return out

    Rapt.load_privatized = staticmethod(spy)
    cfg = _config(data, state)
    key_with_records_in_training(state, cfg["data"], [f"{CANARY} , a film"], ["positive"])
    try:
        summary = method_flow(cfg)
    finally:
        Rapt.load_privatized = staticmethod(original)
    return {"summary": summary, "state": state, "loaded": loaded}


@pytest.mark.slow  # suite time: runs with -m slow
def test_rapt_run_record_is_ldp_with_eta_and_no_epsilon(rapt_run):
    client = _mlflow(rapt_run["state"])
    run = client.get_run(rapt_run["summary"]["mlflow_run_id"])
    m, params, tags = run.data.metrics, run.data.params, run.data.tags
    assert tags["privacy.guarantee"] == "ldp" and tags["method"] == "rapt"
    assert params["rapt.eta"] == "20.0" and params["rapt.tuning"] == "prompt" and params["rapt.reconstruction"] == "true"
    assert "privacy.epsilon" not in m and 0 <= m["audit.rapt.replace_prob"] <= 1 and "test.accuracy" in m
    assert m["audit.attack.inversion.success"] == pytest.approx(1 - m["audit.rapt.replace_prob"], abs=0.05)
    assert "audit.attack.inversion_hidden.success" in m
    # every statistic computed on the unprivatized text is published as audit.* (RUN_RECORD.md)
    assert not [k for k in m if k.startswith(("attack.", "rapt."))]
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "prompt")}
    assert arts == {"prompt/rapt.safetensors"}  # an ldp output: published


@pytest.mark.slow  # suite time: runs with -m slow
def test_rapt_output_is_neither_a_peft_adapter_nor_registered_and_says_why(rapt_run):
    """RAPT's prompt is evaluated on privatized inputs: neither a PEFT adapter nor the registry's
    predictor (plain text in) reproduces it, so nothing is exported and the run record says so."""
    client = _mlflow(rapt_run["state"])
    parent = client.get_run(rapt_run["summary"]["mlflow_run_id"])
    (child,) = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                  "and tags.stage = 'train' and tags.method = 'rapt'")
    for tag in ("peft.adapter", "registry.model"):
        assert child.data.tags[tag].startswith("not exported: rapt evaluates its published prompt its own way")
    assert "peft" not in {a.path for a in client.list_artifacts(child.info.run_id)}
    assert client.search_registered_models() == []


@pytest.mark.slow  # suite time: runs with -m slow
def test_model_side_only_loads_privatized_ids(rapt_run):
    from tasks.methods.rapt.method import RAPT, Rapt

    loaded = rapt_run["loaded"]
    assert len(loaded) == 2  # tuning (train split) and inference (test split)
    for path, data in loaded:
        assert "private" not in path.relative_to(rapt_run["state"]).parts  # outputs side
        assert type(data).__name__ == "PrivatizedEncoding" and data.eta == 20.0
    train = loaded[0][1]
    assert not hasattr(train, "replace_prob")  # the model side gets no statistic of the private text
    assert set(torch.load(loaded[0][0])) == {"input_ids", "attention_mask", "text_mask", "plain_ids", "eta"}


@pytest.mark.slow  # suite time: runs with -m slow
def test_ledger_lists_rapt_as_local_dp_and_the_attacks_as_nonprivate(rapt_run):
    from privacy.ledger import Ledger

    ledger = Ledger(rapt_run["state"] / "ledger.sqlite")
    kinds = [e["kind"] for e in ledger.entries()]
    assert kinds.count("ldp") == 3 and "dp" not in kinds  # the run, and its two releases (train, test draws)
    assert any("attack" in e["description"] for e in ledger.entries() if e["kind"] == "nonprivate")
    ds = ledger.datasets()[0]
    assert ds["ldp_uses"] == 1 and ds["ldp_releases"] == 2 and ds["ldp_eta_bound"] == pytest.approx(40.0)


@pytest.mark.slow  # suite time: runs with -m slow
def test_no_unprivatized_private_text_is_published(rapt_run):
    state = rapt_run["state"]
    for path in state.rglob("*"):
        if path.is_file() and (state / "private") not in path.parents:
            assert CANARY.encode() not in path.read_bytes(), path


@pytest.mark.slow  # suite time: runs with -m slow
def test_variants_share_one_draw_and_report_every_attack(rapt_run):
    """A second run with prefix tuning and no reconstruction on the same data and η reuses the
    first run's privatization (its inputs are the same draw with the plain positions dropped)."""
    from flows.method_flow import method_flow
    from tasks.methods.rapt.method import RAPT, Rapt

    state = rapt_run["state"]
    cfg = _config(state.parent / "data", state)
    cfg["methods"]["rapt"].update({"tuning": "prefix", "reconstruction": False})
    summary = method_flow(cfg)
    first = Rapt.load_privatized(next(p for p, _ in rapt_run["loaded"] if p.name == "rapt_privatized_train.pt"))
    second_path = next(state.glob(f"outputs/{summary['flow_run_id']}/rapt_privatized_train.pt"))
    second = Rapt.load_privatized(second_path)
    assert second.n_plain == 0 and first.n_plain == 6
    assert torch.equal(second.input_ids[:, 1:], first.input_ids[:, 7:])
    assert torch.equal(second.text_mask[:, 1:], first.text_mask[:, 7:])
    client = _mlflow(state)
    run = client.get_run(summary["mlflow_run_id"])
    m, params = run.data.metrics, run.data.params
    assert params["rapt.tuning"] == "prefix" and params["rapt.reconstruction"] == "false"
    for name in ("audit.attack.inversion.success", "audit.attack.inversion_hidden.success",
                 "audit.attack.inversion_hidden.learned_success", "audit.attack.attribute.success",
                 "audit.attack.attribute.majority_rate", "audit.rapt.replace_prob"):
        assert 0.0 <= m[name] <= 1.0, name
    first_run = client.get_run(rapt_run["summary"]["mlflow_run_id"])
    assert m["audit.rapt.replace_prob"] == pytest.approx(first_run.data.metrics["audit.rapt.replace_prob"])
    from privacy.ledger import Ledger

    ds = Ledger(state / "ledger.sqlite").datasets()[0]
    assert ds["ldp_uses"] == 2 and ds["ldp_releases"] == 2  # the shared draws are not released again


def test_concurrent_variants_make_one_draw(tmp_path):
    """Two variants of a Dask sweep asking for the same η's draw at once: one privatization is
    made and both get it (two independent draws of the same private text would weaken the LDP)."""
    import threading
    import time
    from types import SimpleNamespace

    from tasks.methods.rapt.method import draw_once

    shared = tmp_path / "outputs" / "rapt-draws" / "train-key.pt"
    encoding = {"input_ids": torch.zeros((3, 4), dtype=torch.long)}
    made, got = [], []

    def draw():
        time.sleep(0.3)  # long enough for the other thread to arrive
        made.append(1)
        return SimpleNamespace(input_ids=torch.full((3, 4), len(made), dtype=torch.long))

    def save(data, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data.input_ids, path)

    def load(path):
        return SimpleNamespace(input_ids=torch.load(path))

    threads = [threading.Thread(target=lambda: got.append(draw_once(shared, encoding, draw, load, save)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1
    assert len(got) == 2 and all(torch.equal(g.input_ids, got[0].input_ids) for g in got)


def test_draw_paths_key_the_texts_and_keep_seeded_draws_private(tmp_path):
    """A draw of private text made from seeded streams (a debug run, an audit shadow) stays on the
    private side under its own key, so a released run never reuses it; the key also follows the
    texts themselves (keyed fingerprint), so a changed source never gets an old draw."""
    from types import SimpleNamespace

    from tasks.methods.rapt.method import draw_path
    from tasks.randomness import DpRandomness
    from tasks.state import state_paths

    paths = state_paths(str(tmp_path / "state"))
    secret = SimpleNamespace(paths=paths, randomness=DpRandomness(seeded=False))
    seeded = SimpleNamespace(paths=paths, randomness=DpRandomness(seeded=True, seed=0))
    fields, texts = {"eta": 100.0, "split": "train"}, ["a private review", "another one"]
    released = draw_path(secret, "train", fields, private_texts=texts)
    assert released.parent == paths.root / "outputs" / "rapt-draws"
    assert draw_path(secret, "train", fields, private_texts=list(texts)) == released  # shared by variants
    debug = draw_path(seeded, "train", fields, private_texts=texts)
    assert debug.parent == paths.private / "rapt-draws" and debug.name != released.name
    assert draw_path(secret, "train", fields, private_texts=["a changed review", "another one"]) != released
    assert "private review" not in released.name
    public = draw_path(seeded, "public", fields)  # public text, seeded: nothing private in it
    assert public.parent == paths.root / "outputs" / "rapt-draws"


def test_a_split_without_text_tokens_is_drawn_like_any_other(tmp_path):
    """Texts that are all empty after tokenization (or none: an exactly empty split) are privatized
    and recorded as any draw — nothing to replace, no refusal: refusing on the exact rows was a
    0-vs-1 test of one record outside ε (review 6, F5; it used to be refused before the release)."""
    from types import SimpleNamespace

    from tasks.config import parse_config
    from tasks.methods.rapt.method import RAPT, Rapt
    from tasks.randomness import DpRandomness
    from privacy.ledger import Ledger
    from tasks.state import installation_secret, state_paths

    cfg = parse_config(_config(tmp_path / "data", tmp_path / "state"))
    paths = state_paths(str(tmp_path / "state")).create()
    installation_secret(paths.private)
    ledger = Ledger(paths.ledger)
    ledger.register_dataset("toy-key", "toy", 10.0, 1e-5)
    mctx = SimpleNamespace(cfg=cfg, paths=paths, randomness=DpRandomness(seeded=False), dataset_key="toy-key",
                           output_dir=tmp_path / "out")
    for texts in (["", "   "], []):
        data, encoding = RAPT.mechanism.shared_draw(mctx, texts, "train", 3, tmp_path / "out" / f"{len(texts)}.pt")
        assert len(data) == len(texts) and not bool(encoding["text_mask"].any())
    assert ledger.dataset("toy-key")["ldp_releases"] == 2  # each draw its own release, as any other


def test_every_draw_made_is_its_own_release(tmp_path):
    """A draw read back from its file is no new release; a draw made afresh after its file was
    removed is a second one: the ledger counts two releases and the η bound doubles."""
    from types import SimpleNamespace

    from privacy.ledger import Ledger
    from tasks.config import parse_config
    from tasks.methods.rapt.method import RAPT, Rapt
    from tasks.randomness import DpRandomness
    from tasks.state import installation_secret, state_paths

    cfg = parse_config(_config(tmp_path / "data", tmp_path / "state"))
    paths = state_paths(str(tmp_path / "state")).create()
    installation_secret(paths.private)  # the state folder's key exists before its ledger keys a dataset
    ledger = Ledger(paths.ledger)
    ledger.register_dataset("toy-key", "toy", 10.0, 1e-5)
    mctx = SimpleNamespace(cfg=cfg, paths=paths, randomness=DpRandomness(seeded=False), dataset_key="toy-key",
                           output_dir=tmp_path / "out")
    texts = ["a private review of a film", "another private review", "the third one"]
    first, _ = RAPT.mechanism.shared_draw(mctx, texts, "train", 3, tmp_path / "out" / "a.pt")
    again, _ = RAPT.mechanism.shared_draw(mctx, texts, "train", 3, tmp_path / "out" / "b.pt")  # read back: no release
    assert torch.equal(first.input_ids, again.input_ids)
    ds = ledger.dataset("toy-key")
    assert ds["ldp_releases"] == 1 and ds["ldp_eta_bound"] == pytest.approx(20.0)
    (stored,) = (paths.root / "outputs" / "rapt-draws").glob("train-*.pt")
    stored.unlink()  # the draw is made afresh: a second, independent release of the same texts
    RAPT.mechanism.shared_draw(mctx, texts, "train", 3, tmp_path / "out" / "c.pt")
    ds = ledger.dataset("toy-key")
    assert ds["ldp_releases"] == 2 and ds["ldp_eta_bound"] == pytest.approx(40.0)
    draws = [e for e in ledger.entries() if e["kind"] == "ldp"]
    assert len({e["run_id"] for e in draws}) == 2 and all(e["run_id"].startswith(f"rapt-draw:{stored.stem}:")
                                                           for e in draws)
    assert all(e["committed_event"] == {"mechanism": "d_X", "eta": 20.0} for e in draws)


def test_a_draw_is_recorded_in_the_runs_ledger_also_a_team_ledger(tmp_path):
    """With a team ledger (a URL, not the state folder's file) a RAPT draw is recorded there,
    where the run's other uses and its dataset are: never in a file of the state folder."""
    from types import SimpleNamespace

    from privacy.ledger.store import sqlite_url
    from tasks.config import parse_config
    from tasks.methods.rapt.method import RAPT, Rapt
    from tasks.randomness import DpRandomness
    from tasks.state import state_paths

    cfg = parse_config(_config(tmp_path / "data", tmp_path / "state"))
    team_url = sqlite_url(tmp_path / "team" / "ledger.sqlite")
    (tmp_path / "team").mkdir()
    paths = StatePaths_with(state_paths(str(tmp_path / "state")), team_url).create()
    ledger = paths.open_ledger()
    ledger.register_dataset("toy-key", "toy", 10.0, 1e-5)
    mctx = SimpleNamespace(cfg=cfg, paths=paths, randomness=DpRandomness(seeded=False), dataset_key="toy-key",
                           output_dir=tmp_path / "out")
    RAPT.mechanism.shared_draw(mctx, ["a private review of a film", "another one"], "train", 3, tmp_path / "out" / "a.pt")
    assert paths.open_ledger().dataset("toy-key")["ldp_releases"] == 1
    assert not paths.ledger.exists()  # nothing in the state folder's own file


def StatePaths_with(paths, url):
    from dataclasses import replace

    return replace(paths, ledger_setting=url)
