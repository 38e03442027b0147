"""A classifier check that passed is remembered per machine (tasks/check_memo.py): the same model
files, settings and code are not built again by the next plan; any change checks again."""

from __future__ import annotations

import os

import pytest

from tasks import check_memo
from tasks import estimate as est
from tasks.config import parse_config
from tasks.errors import ConfigError
from tasks.methods import base


def _cfg(tmp_path, **models):
    return parse_config({"method": "prompt_dpsgd", "state_dir": str(tmp_path / "state"),
                         "data": {"name": "toy", "path": str(tmp_path / "data"), "labels": ["negative", "positive"]},
                         "models": {"local": "tiny-bert", "max_length": 32, **models}})


@pytest.fixture
def memo(tmp_path, monkeypatch):
    monkeypatch.setenv(est.CACHE_ENV, str(est.state_cache(tmp_path / "state")))
    return tmp_path / "state" / "cache" / "checks.json"


def test_a_passed_check_is_not_built_again(tmp_path, memo, monkeypatch):
    cfg = _cfg(tmp_path)
    base.check_classifier(cfg, "tiny-bert", "models.local", 3)
    assert memo.is_file() and oct(memo.stat().st_mode & 0o777) == "0o600"
    built = []
    import tasks.methodkit.classifiers as classifiers

    monkeypatch.setattr(classifiers, "classifier_for", lambda *a, **k: built.append(a) or pytest.fail("built again"))
    base.check_classifier(cfg, "tiny-bert", "models.local", 3)  # remembered: nothing built
    assert built == []
    with pytest.raises(ConfigError, match="exceed the 256 positions"):  # the positions are checked every time
        base.check_classifier(_cfg(tmp_path, max_length=300), "tiny-bert", "models.local", 3)


def test_other_settings_or_files_check_again(tmp_path, memo):
    cfg = _cfg(tmp_path)
    first = check_memo.key(cfg, "tiny-bert")
    assert first == check_memo.key(_cfg(tmp_path), "tiny-bert")
    relabelled = _cfg(tmp_path, label_descriptions={"negative": "bad", "positive": "good"})
    assert check_memo.key(relabelled, "tiny-bert") != first
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    before = check_memo.key(cfg, str(folder))
    assert before is not None
    os.utime(folder / "config.json", ns=(1, 1))  # the same file, touched: its stat changed
    assert check_memo.key(cfg, str(folder)) != before
    assert check_memo.key(cfg, "some-org/some-hub-model") is None  # no local files to stat: never remembered


def test_a_failed_check_is_not_remembered(tmp_path, memo):
    cfg = _cfg(tmp_path, label_descriptions={"negative": "same", "positive": "same"})
    with pytest.raises(Exception):
        base.check_classifier(cfg, "tiny-bert", "models.local", 3)
    assert check_memo.passed(check_memo.key(cfg, "tiny-bert")) is None
