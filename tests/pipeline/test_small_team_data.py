"""A small team's own data: what a contribution cap leaves out and a test split of few classes are
said (exactly, on the operator's terminal only) or refused before anything is released; the quality
numbers include per-class recall and balanced accuracy; a gate fails a one-label classifier."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.errors import DataError


def _people(folder, per=(30, 3, 3, 3, 3, 3, 3, 3, 3, 3) * 6, test_labels=("neg", "pos")):
    """People p0.. with ``per[u]`` reviews each (a few heavy users); a test split of other people."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"customer {u} review {j}", "label": ["neg", "pos"][(u + j) % 2], "author": f"p{u}"}
            for u, n in enumerate(per) for j in range(n)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    test = [{"text": f"test {i}", "label": test_labels[i % len(test_labels)], "author": f"t{i}"} for i in range(40)]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    return rows


def _cfg(tmp_path, **data):
    from tasks.config import parse_config

    return parse_config({
        "method": "prompt_dpsgd", "state_dir": str(tmp_path / "state"),
        "data": {"name": "shop", "path": str(tmp_path / "shop"), "labels": ["neg", "pos"], "privacy_unit": "author",
                 "size_noise_sigma": 4.0, **data},
        "models": {"local": "tiny-bert"}, "privacy": {"target_epsilon": 4.0},
        "methods": {"prompt_dpsgd": {"batch_size": 8, "epochs": 1}}})


def test_the_records_a_cap_leaves_out_are_counted_exactly_for_the_operator(tmp_path):
    from tasks.data import partition_dataset, partition_notes
    from tasks.planning import source_notes

    rows = _people(tmp_path / "shop")
    cfg = _cfg(tmp_path, max_records_per_unit=5)
    notes = source_notes(cfg, tmp_path / "state" / "private")  # the plan's, before a partition is written
    part = partition_dataset(cfg.data, 0, tmp_path / "state" / "private", None)
    # the heavy users' reviews beyond 5, of those on the training side (test people have one review each)
    on_side = part.n_train + part.n_holdout
    assert part.n_dropped_by_cap > 0 and part.n_dropped_by_cap % 25 == 0
    assert on_side + part.n_dropped_by_cap <= len(rows)
    (line,) = [n for n in partition_notes(cfg.data, part) if n.startswith("data.max_records_per_unit")]
    assert f"left out {part.n_dropped_by_cap:,} of" in line and line in notes
    uncapped = _cfg(tmp_path, max_records_per_unit=None)
    assert not partition_notes(uncapped.data, partition_dataset(uncapped.data, 0, tmp_path / "state" / "private",
                                                               None))


def test_a_test_split_of_one_class_is_refused_before_anything_is_released(tmp_path):
    from tasks.data import partition_dataset
    from tasks.planning import released_sizes

    _people(tmp_path / "shop", test_labels=("neg",))
    cfg = _cfg(tmp_path)
    private = tmp_path / "state" / "private"
    with pytest.raises(DataError, match="every test record has the same label") as refused:
        released_sizes(cfg, private)  # the plan
    assert "'neg', 'pos'" in str(refused.value) and "'neg' " not in str(refused.value)  # which one: not said
    with pytest.raises(DataError, match="every test record has the same label"):
        partition_dataset(cfg.data, 0, private, None)  # the run
    assert not list(private.rglob("released-sizes/*.json")) and not list(private.rglob("manifest.json"))


def test_a_rare_test_class_is_flagged(tmp_path):
    from tasks.data import partition_dataset, partition_notes

    _people(tmp_path / "shop", test_labels=("neg",) * 39 + ("pos",))
    cfg = _cfg(tmp_path)
    part = partition_dataset(cfg.data, 0, tmp_path / "state" / "private", None)
    assert part.test_label_counts == {"neg": 39, "pos": 1}
    (line,) = partition_notes(cfg.data, part)
    assert "'pos' 1 of 40" in line and "balanced accuracy" in line


class _Fixed(torch.nn.Module):
    """A classifier whose logits are given per example (by the first input id)."""

    n_labels = 3

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.as_tensor(logits, dtype=torch.float)

    def forward(self, encoded, prompt=None):
        return self.logits[encoded["input_ids"][:, 0]]


def test_balanced_accuracy_is_the_mean_recall_over_the_classes_present():
    from models.scoring import accuracy_by_class
    from tasks.stages import class_metrics

    labels = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 1])  # 80 % class 0; class 2 absent
    clf = _Fixed([[1.0, 0.0, 0.0]] * 10)  # always class 0
    encoded = {"input_ids": torch.arange(10).unsqueeze(1), "attention_mask": torch.ones(10, 1, dtype=torch.long)}
    out = accuracy_by_class(clf, encoded, labels, batch_size=3)
    assert out["accuracy"] == pytest.approx(0.8) and out["recall"] == {0: 1.0, 1: 0.0}
    assert out["balanced_accuracy"] == pytest.approx(0.5) and out["predicted_classes"] == 1
    m = class_metrics(out, ["neg", "pos", "neutral"])
    assert m == {"test.balanced_accuracy": 0.5, "test.recall.neg": 1.0, "test.recall.pos": 0.0}


def test_runs_are_named_by_method_dataset_and_target(tmp_path):
    from flows.parent_run import run_title

    _people(tmp_path / "shop")
    cfg = _cfg(tmp_path)
    assert run_title(cfg, "prompt_dpsgd", "dp") == "prompt_dpsgd · shop · ε 4"
    assert run_title(cfg, "zero_shot", "none") == "zero_shot · shop · no ε (none)"
    assert run_title(cfg, "sweep", "none") == "sweep · shop"


def test_progress_is_reported_every_k_steps_and_whenever_15_seconds_passed(monkeypatch):
    from models import dp_prompt_training as training

    clock = iter([0.0, 1.0, 2.0, 20.0, 21.0, 40.0, 41.0])
    monkeypatch.setattr(training.time, "monotonic", lambda: next(clock))
    calls = []
    report = training.StepProgress(lambda step, total, loss: calls.append((step, loss)), every=10, total=5)
    for step, loss in enumerate([1.0, 2.0, 3.0, 4.0, 5.0], start=1):
        report(step, loss)  # at t = 1, 2, 20, 21, 40 (the reporter was made at t = 0)
    assert calls == [(3, 2.0), (5, 4.5)]  # 15 s passed by step 3, then the end: mean loss since the last call


def test_a_run_links_to_the_ui_privprompt_ui_serves_on_its_state_and_to_no_throwaway_one(tmp_path):
    import os
    import subprocess
    import sys

    from tasks.state import UI_MARKER, persistent_ui_url

    home = tmp_path / "prefect"
    home.mkdir()
    assert persistent_ui_url(str(home)) == "" and persistent_ui_url(None) == ""  # no UI: no link at all
    (home / UI_MARKER).write_text(json.dumps({"url": "http://127.0.0.1:4200", "pid": os.getpid()}))
    assert persistent_ui_url(str(home)) == "http://127.0.0.1:4200"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (home / UI_MARKER).write_text(json.dumps({"url": "http://127.0.0.1:4200", "pid": gone.pid}))
    assert persistent_ui_url(str(home)) == ""  # its process ended: the marker says nothing
