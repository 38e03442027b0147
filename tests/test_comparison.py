"""The comparison report's RAPT table (Table 1 shape) and flatness figure, from run rows."""

from tasks.comparison import comparison_figure, flatness_figure, label_summary, ldp_table


def _row(method, eta=None, acc=0.5, priv=None, guarantee="ldp", flatness=None, seed="0"):
    return {"run_id": "r" * 8, "method": method, "guarantee": guarantee, "variant": "", "seed": seed,
            "epsilon": None, "eta": eta, "accuracy": acc, "mia_auc": None, "target_epsilon": 8.0, "note": "",
            "flatness": flatness or {}, "empirical_privacy": priv}


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
            _row("zero_shot", guarantee="none", acc=0.6)]
    rows[0]["epsilon"] = rows[1]["epsilon"] = 7.99
    lines = label_summary(rows).splitlines()
    assert lines[2].startswith("| - | dp_prefix | dp | 8 | 2 | 0.7500 ± 0.0707 | - | - | 7.9900 |")
    assert lines[3].startswith("| - | zero_shot | none | - | 1 | 0.6000 | 0.6000 |")


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
