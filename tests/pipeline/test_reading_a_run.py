"""Issue 29, reading a run: the CLI summary says where the prompt is (or that it stays private),
`privprompt report` keeps datasets apart, shows the zero-shot baseline and labels its log ε axis
without overlapping tick labels."""

from __future__ import annotations

import pytest

import privprompt_commands.run
from tasks.comparison import comparison_figure, comparison_table, label_summary, parent_runs


def _row(method="prompt_dpsgd", eps=8.0, acc=0.7, dataset="tickets", zero_shot=0.55, seed="0", run="r"):
    return {"run_id": run * 8, "method": method, "dataset": dataset, "zero_shot": zero_shot,
            "guarantee": "dp" if eps is not None else "none", "variant": "", "seed": seed, "epsilon": eps,
            "delta": 1e-5 if eps is not None else None, "unit": "record",
            "eta": None, "accuracy": acc, "mia_auc": 0.5, "target_epsilon": eps if eps is not None else float("nan"),
            "note": "", "flatness": {}, "empirical_privacy": None}


def _summary(published):
    return {"flow_run_id": "f", "mlflow_run_id": "m", "experiment": "e", "method": "prompt_sgd",
            "metrics": {"test.accuracy": 0.7, "mia.loss.auc": 0.61, "mia.loss.auc_low": 0.5,
                        "mia.loss.auc_high": 0.7, "audit.epsilon_lower_bound": 0.3},
            "guarantee": "none", "compute_seconds": {"train": 1.0}, "published": published, "device": "cpu"}


def test_summary_of_an_unpublished_prompt_says_it_stays_private(capsys):
    privprompt_commands.run._print_summary(_summary({"method": "prompt_sgd", "prompt_path": "/s/private/runs/x/p.safetensors",
                                            "prompt_published": False, "guarantee": "none",
                                            "formal_dp_guarantee": False, "artifact_uri": None}), 10.0)
    out = capsys.readouterr().out
    assert "prompt (not published):     /s/private/runs/x/p.safetensors (no formal guarantee" in out
    assert "MLflow artifact" not in out and "published prompt:" not in out
    assert "mia.loss.auc:               0.6100 [0.5000, 0.7000] (audit statistic, not DP)" in out
    assert "audit.epsilon_lower_bound:  0.3000 (audit statistic, not DP)" in out
    privprompt_commands.run._print_summary(_summary({"method": "zero_shot", "prompt_path": None, "prompt_published": False,
                                            "guarantee": "none", "formal_dp_guarantee": False,
                                            "artifact_uri": None}), 10.0)
    assert "prompt:                     none (the method publishes no prompt)" in capsys.readouterr().out


def test_report_keeps_datasets_apart_and_shows_zero_shot():
    rows = [_row(dataset="tickets_csv", acc=0.80, zero_shot=0.50, run="a"),
            _row(dataset="tickets_parquet", acc=0.60, zero_shot=0.52, run="b"),
            _row(method="zero_shot", eps=None, acc=0.50, dataset="tickets_csv", zero_shot=0.50, run="c")]
    table = comparison_table(rows).splitlines()
    assert table[0].startswith("| dataset | method |") and "zero-shot accuracy" in table[0]
    assert table[2] == ("| tickets_csv | prompt_dpsgd | dp | 8.0000 | 1e-05 | per record | - | 0.8000 | 0.5000 | 0.5000 "
                        "| 0 | aaaaaaaa |")
    assert table[3].startswith("| tickets_csv | zero_shot | none | - | - | - | - | 0.5000 | 0.5000 |")
    assert table[4] == ("| tickets_parquet | prompt_dpsgd | dp | 8.0000 | 1e-05 | per record | - | 0.6000 | 0.5200 | "
                        "0.5000 | 0 | bbbbbbbb |")
    summary = label_summary(rows).splitlines()
    # the same method and ε on two datasets: two rows of one run each, never one row averaging 0.8 and 0.6
    assert summary[2].startswith("| tickets_csv | prompt_dpsgd | - | its output | dp | 8 | 1 | 0.8000 | - | 0.5000 |")
    assert summary[4].startswith("| tickets_parquet | prompt_dpsgd | - | its output | dp | 8 | 1 | 0.6000 | - | 0.5200 |")
    assert not [line for line in summary if "0.7000" in line]
    fig = comparison_figure(rows, "t")
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert "prompt_dpsgd · tickets_csv" in labels and "prompt_dpsgd · tickets_parquet" in labels
    zero = {line.get_label(): line.get_ydata()[0] for line in fig.axes[0].lines if line.get_label().startswith("zero-shot ")}
    assert zero == {"zero-shot · tickets_csv": 0.5, "zero-shot · tickets_parquet": 0.52}
    one = comparison_figure([_row(acc=0.8, zero_shot=0.5), _row(acc=0.81, zero_shot=0.54, seed="1")], "t")
    zero = [line for line in one.axes[0].lines if line.get_label() == "zero-shot"]
    assert len(zero) == 1 and zero[0].get_ydata()[0] == pytest.approx(0.52)


@pytest.mark.parametrize("eps", [[2.97, 4.5, 7.99], [0.98, 1.01, 1.03, 2.99, 3.02, 7.98, 8.01],
                                 [0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 8, 10, 16, 32, 64]])
def test_log_epsilon_axis_has_no_overlapping_tick_labels(eps):
    rows = [_row(eps=e, run=str(i % 10)) for i, e in enumerate(eps)] + [_row(method="prompt_sgd", eps=None)]
    fig = comparison_figure(rows, "t")
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:2]:
        shown = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        texts = [t.get_text() for t in shown]
        assert "∞" in texts and len(texts) >= 2
        assert not [t for t in texts if "times" in t or "$" in t]  # plain numbers, no 3×10⁰
        assert not [t for t in ax.get_xticklabels(minor=True) if t.get_visible() and t.get_text()]
        boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda b: b.x0)
        for left, right in zip(boxes, boxes[1:]):
            assert left.x1 <= right.x0, (texts, left, right)
        for t in shown[:-1]:  # every finite label sits at a plotted ε (2 significant digits)
            assert any(abs(float(t.get_text()) - e) / e < 0.06 for e in eps), t.get_text()


def test_parent_runs_reads_dataset_and_zero_shot(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "art"))
    for dataset, acc in (("tickets_csv", 0.8), ("tickets_parquet", 0.6)):
        run = client.create_run(exp, tags={"method": "prompt_dpsgd", "dataset": dataset, "privacy.guarantee": "dp"})
        client.log_param(run.info.run_id, "privacy.target_epsilon", "8.0")
        for key, value in (("test.accuracy", acc), ("test.accuracy.zero_shot", 0.5), ("privacy.epsilon", 7.99)):
            client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id)
    rows = sorted(parent_runs(client, "e"), key=lambda r: r["dataset"])
    assert [(r["dataset"], r["accuracy"], r["zero_shot"]) for r in rows] == [("tickets_csv", 0.8, 0.5),
                                                                          ("tickets_parquet", 0.6, 0.5)]
