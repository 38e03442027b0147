"""The comparison report from run rows: what the methods declare (RAPT's table in Table 1's shape
and its empirical-privacy panel, the prefix methods' flatness figure and summary column, the
zero-shot reference) and the generic tables and figure."""

from tasks.comparison import comparison_figure, label_summary
from tasks.methodkit.prompt_methods import flatness_figure
from tasks.methods.rapt.report import ldp_table


def _row(method, eta=None, acc=0.5, priv=None, guarantee="ldp", flatness=None, seed="0", zero_shot=None):
    return {"run_id": "r" * 8, "method": method, "guarantee": guarantee, "variant": "", "seed": seed,
            "epsilon": None, "eta": eta, "accuracy": acc, "mia_auc": None, "target_epsilon": 8.0, "note": "",
            "flatness": flatness or {}, "empirical_privacy": priv, "zero_shot": zero_shot}


def test_ldp_table_has_one_row_per_variant_and_one_column_per_eta():
    rows = [_row("rapt[prompt]", 50, 0.6, 0.9), _row("rapt[prompt]", 100, 0.7, 0.5),
            _row("rapt[prompt+reconstruction]", 50, 0.62, 0.91), _row("rapt[prompt+reconstruction]", 50, 0.64, 0.89, seed="1"),
            _row("dp_prefix", guarantee="dp")]
    table = ldp_table(rows)
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert lines[0] == "| variant | η = 50 | η = 100 |"
    assert lines[2] == "| rapt[prompt+reconstruction] | 0.6300 (0.900) n=2 | - |"
    assert lines[3] == "| rapt[prompt] | 0.6000 (0.900) | 0.7000 (0.500) |"
    assert ldp_table([_row("dp_prefix", guarantee="dp")]) is None
    fig = comparison_figure(rows, "t")
    assert len(fig.axes) == 4  # accuracy, MIA, accuracy vs η, empirical privacy vs η
    only_ldp = comparison_figure(rows[:4], "t")
    assert len(only_ldp.axes) == 2  # no empty ε panels when every run is ldp


def test_flatness_figure_averages_curves_per_label():
    curve = {"flatness.random.r00": 0.5, "flatness.random.r10": 0.6, "flatness.adversarial.r00": 0.5,
             "flatness.adversarial.r10": 0.9}
    rows = [_row("dp_prefix", guarantee="dp", flatness=curve), _row("dp_prefix+awp", guarantee="none", flatness=curve),
            _row("zero_shot", guarantee="none")]
    fig = flatness_figure(rows, "t")
    ax = fig.axes[0]
    assert sorted(line.get_label() for line in ax.lines) == ["dp_prefix (n=1)", "dp_prefix+awp (n=1)"]
    assert list(ax.lines[0].get_xdata()) == [0.0, 0.1] and list(ax.lines[0].get_ydata()) == [0.5, 0.6]
    assert flatness_figure([_row("zero_shot")], "t") is None


def test_label_summary_gives_mean_and_std_over_seeds():
    rows = [_row("dp_prefix", guarantee="dp", acc=0.70, seed="0"), _row("dp_prefix", guarantee="dp", acc=0.80, seed="1"),
            _row("zero_shot", guarantee="none", acc=0.6, zero_shot=0.6)]  # a zero-shot run's reference: itself
    rows[0]["epsilon"] = rows[1]["epsilon"] = 7.99
    lines = label_summary(rows).splitlines()
    assert lines[2].startswith("| - | dp_prefix | - | its output | dp | 8 | 2 | 0.7500 ± 0.0707 | - | - | - | "
                               "7.9900 per record |")
    assert lines[3].startswith("| - | zero_shot | - | its output | none | - | 1 | 0.6000 | - | 0.6000 |")


def test_label_summary_never_averages_unlike_runs():
    """A run that fell back (no prompt's accuracy) and one that published, or two configs, are rows
    of their own, never one mean."""
    def dp(acc, seed, family="aaaa1111", fell_back=False, balanced=None):
        r = _row("prompt_dpsgd", guarantee="dp", acc=acc, seed=seed)
        r.update(epsilon=3.99, target_epsilon=4.0, config_family=family, fell_back=fell_back,
                 balanced_accuracy=balanced, unit="customer_id")
        return r

    rows = [dp(0.673, "0", fell_back=True, balanced=0.5), dp(0.043, "1", balanced=0.04),
            dp(0.70, "2", family="bbbb2222"), dp(0.72, "3", family="bbbb2222")]
    lines = label_summary(rows).splitlines()[2:]
    assert len(lines) == 3 and not [line for line in lines if "±" in line and "aaaa1111" in line]
    assert lines[0].startswith("| - | prompt_dpsgd | aaaa1111 | its output | dp | 4 | 1 | 0.0430 | 0.0400 |")
    assert lines[1].startswith("| - | prompt_dpsgd | aaaa1111 | no prompt (fallback) | dp | 4 | 1 | 0.6730 | 0.5000 |")
    assert lines[2].startswith("| - | prompt_dpsgd | bbbb2222 | its output | dp | 4 | 2 | 0.7100 ± 0.0141 |")
    assert "| 3.9900 per person (customer_id) |" in lines[2]  # ε with its unit


def test_privacy_utility_figure_draws_seed_means_with_std():
    def dp(eps, acc, seed):
        r = _row("prompt_dpsgd", guarantee="dp", acc=acc, seed=seed)
        r.update(epsilon=eps * 0.999, target_epsilon=eps, mia_auc=0.5)
        return r

    rows = [dp(1.0, 0.70, "0"), dp(1.0, 0.74, "1"), dp(8.0, 0.80, "0"), dp(8.0, 0.78, "1"), dp(8.0, 0.82, "2"),
            _row("prompt_sgd", guarantee="none", acc=0.9)]
    fig = comparison_figure(rows, "t")
    ax = fig.axes[0]
    mean_line = next(line for line in ax.lines if line.get_label().startswith("prompt_dpsgd"))
    assert mean_line.get_label() == "prompt_dpsgd (mean ± sd, n≤3)"
    assert list(mean_line.get_xdata()) == [0.999, 7.992]
    assert [round(y, 6) for y in mean_line.get_ydata()] == [0.72, 0.80]
    # one error bar per multi-seed level: sample std 0.028284 at ε = 1, 0.02 at ε = 8
    bars = sorted(abs(seg[1][1] - seg[0][1]) / 2 for coll in ax.collections if hasattr(coll, "get_segments")
                  for seg in coll.get_segments())
    assert [round(b, 6) for b in bars] == [0.02, 0.028284]
    non_private = next(line for line in ax.lines if line.get_label() == "prompt_sgd")
    assert list(non_private.get_ydata()) == [0.9]  # at ε = ∞, one run: no "mean ± sd" label


def _log_runs(tmp_path, runs):
    """Finished parent runs in a fresh sqlite MLflow: (tags, params, metrics) each."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "art"))
    for tags, params, metrics in runs:
        run = client.create_run(exp, tags={"dataset": "d", **tags})
        for key, value in params.items():
            client.log_param(run.info.run_id, key, value)
        for key, value in metrics.items():
            client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id)
    return client


def test_parent_runs_read_what_each_method_declares(tmp_path):
    """The rows carry each run's own method's declared metrics (RAPT's empirical privacy under its
    current and its old name, the prefix methods' flatness curves, a zero-shot run's own accuracy
    as its reference) and the zero-shot baseline every run logged; other runs get them empty."""
    from tasks.comparison import parent_runs

    client = _log_runs(tmp_path, [
        ({"method": "rapt", "privacy.guarantee": "ldp", "method.label": "rapt[new]"}, {"rapt.eta": "50"},
         {"test.accuracy": 0.6, "audit.attack.inversion_hidden.success": 0.25}),
        ({"method": "rapt", "privacy.guarantee": "ldp", "method.label": "rapt[old]"}, {"rapt.eta": "50"},
         {"test.accuracy": 0.6, "attack.inversion_hidden.success": 0.125}),
        ({"method": "prefix_dpsgd", "privacy.guarantee": "dp", "method.label": "dp_prefix"}, {},
         {"test.accuracy": 0.7, "test.accuracy.zero_shot": 0.55, "flatness.adversarial.r30": 0.9,
          "flatness.sharpness": 0.1}),
        ({"method": "zero_shot", "privacy.guarantee": "none"}, {}, {"test.accuracy": 0.5}),
        ({"method": "prompt_dpsgd", "privacy.guarantee": "dp"}, {}, {"test.accuracy": 0.8,
                                                                    "flatness.adversarial.r30": 7.0}),
    ])
    rows = {r["method"]: r for r in parent_runs(client, "e")}
    assert rows["rapt[new]"]["empirical_privacy"] == 0.75 and rows["rapt[old]"]["empirical_privacy"] == 0.875
    assert rows["rapt[new]"]["eta"] == 50.0 and rows["rapt[new]"]["flatness"] == {}
    assert rows["dp_prefix"]["flatness"] == {"flatness.adversarial.r30": 0.9, "flatness.sharpness": 0.1}
    assert rows["dp_prefix"]["zero_shot"] == 0.55 and rows["dp_prefix"]["empirical_privacy"] is None
    assert rows["zero_shot"]["zero_shot"] == 0.5  # a zero-shot run is its own reference
    # a metric another method declares is read only on that method's runs
    assert rows["prompt_dpsgd"]["flatness"] == {} and rows["prompt_dpsgd"]["zero_shot"] is None


def test_report_sections_come_from_the_declarations_once_each():
    """A skeleton's sections, declared by every method built on it (prefix_dpsgd, prefix_sgd,
    privacy_flat), are in the report once; RAPT's table and panel and the zero-shot reference too."""
    from tasks.comparison import report_declarations
    from tasks.methods.base import LevelPanel, ReferenceAccuracy, ReportArtifact, SummaryColumn

    _, sections = report_declarations()
    artifacts = [s.path for s in sections if isinstance(s, ReportArtifact)]
    assert sorted(artifacts) == ["report/flatness.png", "report/ldp_table.md"]
    assert [s.header for s in sections if isinstance(s, SummaryColumn)] == ["test loss, adversarial 0.3‖w‖"]
    assert [s.key for s in sections if isinstance(s, LevelPanel)] == ["empirical_privacy"]
    assert [(s.key, s.label) for s in sections if isinstance(s, ReferenceAccuracy)] == [("zero_shot", "zero-shot")]


class _Record:
    def __init__(self):
        self.texts, self.figures = {}, []

    def log_text(self, text, path):
        self.texts[path] = text

    def log_figure(self, fig, path):
        self.figures.append(path)


def test_a_new_methods_declarations_reach_the_report(tmp_path):
    """A method registered for the test declares a metric, a summary column and an artifact: the
    report reads them without a line of tasks/comparison.py knowing it."""
    from tasks.comparison import label_summary, log_report, parent_runs
    from tasks.methods import register_method, unregister_method
    from tasks.methods import Method
    from tasks.methods.base import Report, ReportArtifact, ReportMetric, SummaryColumn
    from tasks.schema import Block

    def table(rows):
        scored = [r for r in rows if r.get("toy_score") is not None]
        return "".join(f"{r['method']}: {r['toy_score']:.2f}\n" for r in scored) or None

    class ToyReported(Method):
        name = "toy_reported"
        config_class = Block

        report = Report(metrics=(ReportMetric("toy_score", ("toy.score", "toy.old_score"), transform=lambda v: 2 * v),),
                        sections=(SummaryColumn("toy score", lambda r: r.get("toy_score")),
                                  ReportArtifact("report/toy.md", table)))

    register_method(ToyReported)
    try:
        client = _log_runs(tmp_path, [
            ({"method": "toy_reported", "privacy.guarantee": "none"}, {}, {"test.accuracy": 0.6, "toy.old_score": 0.2}),
            ({"method": "prompt_dpsgd", "privacy.guarantee": "dp"}, {}, {"test.accuracy": 0.8, "toy.score": 0.3})])
        rows = {r["method"]: r for r in parent_runs(client, "e")}
        assert rows["toy_reported"]["toy_score"] == 0.4 and rows["prompt_dpsgd"]["toy_score"] is None
        summary = label_summary(list(rows.values())).splitlines()
        assert summary[0].endswith("| toy score |") and summary[1].count("|") == summary[0].count("|")
        assert [line for line in summary if "toy_reported" in line][0].endswith("| 0.4000 |")
        record = _Record()
        log_report(record, list(rows.values()), "t")
        assert record.texts["report/toy.md"] == "toy_reported: 0.40\n"
        assert "report/flatness.png" not in record.figures and "report/ldp_table.md" not in record.texts  # nothing to show
    finally:
        unregister_method("toy_reported")
