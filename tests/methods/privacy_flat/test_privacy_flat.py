"""Privacy-Flat: AWP only in the first E steps and never noised, the greedy layer elimination,
the regulariser's gradient, all-off == plain DP prefix tuning, and the honest labels."""

from __future__ import annotations

import pytest
import torch

import models.dp_prompt_training as dpt
from tasks.methods.base import run_label
from models import DPConfig, PromptTrainingConfig, build_classifier, load_backbone, select_rows, train_prompt
from models.dp_prompt_training import seeded_dp_generators
from models.landscape import mean_gradient, prefix_sharpness
from tasks.methods.privacy_flat.flat import FlatStepHook, awp_perturbation, eliminate_layers
from models.prompts.prefix import prefix_shape
from models.soft_prompt import PrefixPrompt

torch.set_num_threads(2)
LABELS = ["negative", "positive"]


@pytest.fixture(scope="module")
def toy():
    clf = build_classifier(load_backbone("tiny-bert", "cpu"), LABELS)
    texts = [f"{w} {noun}" for noun in ("movie", "film")  # unique texts: a batch's rows are found by their ids
             for w in ["good", "bad", "great", "awful", "fine", "boring", "nice", "dull"]]
    y = torch.tensor([i % 2 == 0 for i in range(16)], dtype=torch.long)
    init = PrefixPrompt.init_from_vocab(clf.backbone, 2, seed=0).weight.detach()
    return clf, clf.encode(texts, max_length=12), y, init


def _run(toy, flat, steps=4, sigma=0.5):
    clf, enc, y, init = toy
    sample, noise = seeded_dp_generators(3)
    tc = PromptTrainingConfig(n_tokens=2, lr=0.05, steps=steps, batch_size=8, kind="prefix")
    return train_prompt(clf, enc, y, tc, dp=DPConfig(noise_multiplier=sigma, max_grad_norm=1.0, sample_rate=0.5),
                        seed=0, init_prompt=init, sample_generator=sample, noise_generator=noise,
                        hooks=() if flat is None else [flat])


def test_all_components_off_is_plain_dp_prefix_tuning_exactly(toy):
    plain = _run(toy, None)
    off = _run(toy, FlatStepHook())
    assert torch.equal(plain.prompt, off.prompt)
    assert [h["batch_size"] for h in plain.history] == [h["batch_size"] for h in off.history]


def test_awp_only_in_first_steps_from_the_unnoised_batch_gradient(toy, monkeypatch):
    clf, enc, y, init = toy
    calls = []  # (the prompt the per-sample gradients were taken at, the batch's rows)
    original = dpt.per_sample_prompt_gradients

    def spy(classifier, batch, labels, prompt, **kw):
        calls.append((prompt.detach().clone(), batch["input_ids"].clone(), labels.clone()))
        return original(classifier, batch, labels, prompt, **kw)

    monkeypatch.setattr(dpt, "per_sample_prompt_gradients", spy)
    weights = []
    real_step = torch.optim.Adam.step

    def record(self, *a, **k):
        weights.append(self.param_groups[0]["params"][0].detach().clone())
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", record)
    gamma = 0.05
    res = _run(toy, FlatStepHook(awp_steps=2, awp_gamma=gamma), steps=5)
    assert len(calls) == len(weights) == 5  # one physical batch per step here
    for step, ((at, ids, labels), w) in enumerate(zip(calls, weights), start=1):
        if step <= 2:  # perturbed by v = γ‖w_l‖ g_l/‖g_l‖ of the batch's UN-noised mean gradient
            rows = [i for i in range(enc["input_ids"].shape[0])
                    if any(torch.equal(enc["input_ids"][i, :ids.shape[1]], r) for r in ids)]
            g = mean_gradient(clf, select_rows(enc, torch.tensor(rows)), y[rows], w)
            torch.testing.assert_close(at - w, awp_perturbation(w, g, gamma), atol=1e-6, rtol=1e-4)
            assert not torch.equal(at, w)
        else:
            assert torch.equal(at, w)
    # the sampling and noise streams are the same as without AWP (AWP draws nothing)
    monkeypatch.setattr(dpt, "per_sample_prompt_gradients", original)
    plain = _run(toy, None, steps=5)
    assert [h["batch_size"] for h in res.history] == [h["batch_size"] for h in plain.history]


def test_dp_flat_prefix_training_on_an_exactly_empty_set_takes_its_planned_steps(toy):
    """Review 6, F5: AWP and the sparse layers on an EXACTLY empty training set — every Poisson batch
    empty, each step noise alone on the kept layers — rather than a crash one record away from a run."""
    clf, enc, y, init = toy
    none = torch.zeros(0, dtype=torch.long)
    sample, noise = seeded_dp_generators(3)
    tc = PromptTrainingConfig(n_tokens=2, lr=0.05, steps=4, batch_size=8, kind="prefix")
    L = init.shape[0]
    res = train_prompt(clf, select_rows(enc, none), y[none], tc,
                       dp=DPConfig(noise_multiplier=0.5, max_grad_norm=1.0, sample_rate=0.5, expected_batch=8.0),
                       seed=0, init_prompt=init, sample_generator=sample, noise_generator=noise,
                       hooks=[FlatStepHook(awp_steps=2, awp_gamma=0.05, layers=[L - 1])])
    assert res.steps == 4 and res.empty_batches == 4 and [h["batch_size"] for h in res.history] == [0] * 4
    assert torch.equal(res.prompt[: L - 1], init[: L - 1]) and not torch.equal(res.prompt[L - 1], init[L - 1])


def test_sparse_layers_freeze_removed_layers_and_get_no_noise(toy):
    clf, enc, y, init = toy
    L = init.shape[0]
    res = _run(toy, FlatStepHook(layers=[L - 1]), sigma=5.0)
    assert torch.equal(res.prompt[: L - 1], init[: L - 1])  # removed layers never move, not even by noise
    assert not torch.equal(res.prompt[L - 1], init[L - 1])


def test_regulariser_gradient_is_that_of_the_unsquared_norm():
    w = torch.randn(2, 2, 3, 4)
    w_nor = torch.randn(2, 2, 3, 4)
    p = w.clone().requires_grad_()
    (0.01 * (p - w_nor).norm()).backward()
    torch.testing.assert_close(FlatStepHook(w_nor=w_nor, lam=0.01).regularizer_gradient(w, None), p.grad)
    assert FlatStepHook(w_nor=w_nor, lam=0.0).regularizer_gradient(w, None) is None


def test_greedy_elimination_removes_the_layer_whose_removal_lowers_sharpness_most():
    # planted: layer 2 contributes most sharpness, then layer 0; layers 1 and 3 add nothing
    contrib = {0: 2.0, 1: 0.0, 2: 5.0, 3: 0.0}

    def sharpness(kept):
        return 1.0 + sum(contrib[l] for l in kept)

    kept, rounds = eliminate_layers(sharpness, 4, keep=2)
    assert [r["removed"] for r in rounds] == [2, 0] and kept == [1, 3]
    # stops when no removal lowers the sharpness
    kept, rounds = eliminate_layers(lambda k: 1.0 + (0.0 if 2 in k else 3.0), 4, keep=1)
    assert rounds[-1]["removed"] is None and 2 in kept
    with pytest.raises(ValueError, match="keep"):
        eliminate_layers(sharpness, 4, keep=0)


def test_prefix_sharpness_definition_on_a_quadratic():
    """L(w) = a/2 ‖w‖² at w = 1 (4 entries, RMS 1): the box of side η = 0.1 has its ascent corner at
    w + 0.05 · sign(∇L) = 1.05 · w, where L = a/2 · 4 · 1.05²: the maximum over the box."""
    a = 3.0
    w = torch.ones(1, 2, 1, 2)
    loss = lambda p: float(a / 2 * (p ** 2).sum())  # noqa: E731
    grad = lambda p: a * p  # noqa: E731
    base = loss(w)
    expected = (a / 2 * 4 * 1.05 ** 2 - base) / (1 + base) ** 2
    assert prefix_sharpness(loss, grad, w) == pytest.approx(expected, rel=1e-5)
    assert prefix_sharpness(loss, grad, w, box=0.2) > expected  # a larger box reaches higher
    mask = torch.zeros_like(w)  # nothing trainable: no box, no sharpness
    assert prefix_sharpness(loss, grad, w, mask) == 0.0
    # a layer that cannot move (masked out) adds no sharpness: the kept layer alone
    mask[0, 0] = 1.0
    assert 0 < prefix_sharpness(loss, grad, w, mask) < expected


@pytest.mark.slow  # suite time (11-30 s): runs with -m slow
def test_guarantee_labels_follow_the_settings(tmp_path):
    from tasks.config import parse_config
    from tasks.methods import get_method

    def cfg(flat, allow=True):
        return parse_config({
            "method": "privacy_flat", "experiment": "x", "state_dir": str(tmp_path), "allow_nonprivate_baselines": allow,
            "data": {"name": "sst2", "labels": LABELS}, "models": {"local": "tiny-bert"},
            "public": {"name": "tweet_sentiment"},
            "methods": {"privacy_flat": {"flat": flat}}})

    method = get_method("privacy_flat")
    assert method.mechanism.guarantee(cfg({})) == "dp"
    assert method.mechanism.guarantee(cfg({"sparse": True, "sparse_data": "public"})) == "dp"
    for flat in ({"awp": True}, {"sparse": True}, {"regularizer": True, "lambda": 0.02}):
        c = cfg(flat)
        assert method.mechanism.guarantee(c) == "none"
        plan = method.mechanism.plan(c, 100, 1e-5)
        assert plan.event is None and "without noise" in plan.note
    with pytest.raises(ValueError, match="allow_nonprivate_baselines"):
        cfg({"awp": True}, allow=False)
    assert cfg({"regularizer": True, "lambda": 0.02}).methods.privacy_flat.flat.lam == 0.02
    params = method.mechanism.plan(cfg({"awp": True}), 100, 1e-5).params
    assert {"flat.awp", "flat.sparse", "flat.regularizer", "flat.lambda", "flat.awp_epochs", "flat.layers"} <= set(params)


def test_prefix_shape_of_minilm():
    backbone = load_backbone("minilm", "cpu")
    assert prefix_shape(backbone.model, 5) == (6, 2, 5, 384)


@pytest.mark.slow  # suite time (10 s): Privacy-Flat's own regulariser test runs by default
def test_dpzero_regulariser_is_labelled_none_and_pulls_toward_w_nor(tmp_path):
    from tasks.config import parse_config
    from tasks.methods import get_method

    def cfg(dpzero):
        return parse_config({
            "method": "dpzero", "experiment": "x", "state_dir": str(tmp_path), "allow_nonprivate_baselines": True,
            "data": {"name": "sst2", "labels": LABELS}, "models": {"local": "tiny-bert"},
            "methods": {"dpzero": dpzero}})

    method = get_method("dpzero")
    assert method.mechanism.guarantee(cfg({})) == "dp" and method.mechanism.plan(cfg({}), 100, 1e-5).event is not None
    reg = cfg({"regularizer": True, "lambda": 0.05})
    plan = method.mechanism.plan(reg, 100, 1e-5)
    assert method.mechanism.guarantee(reg) == "none" and plan.event is None and plan.params["flat.lambda"] == 0.05
    assert run_label(method, reg) == "dpzero+regularizer"
    # the privacy_flat labels name the rungs
    pf = get_method("privacy_flat")
    base = {"method": "privacy_flat", "experiment": "x", "state_dir": str(tmp_path), "allow_nonprivate_baselines": True,
            "data": {"name": "sst2", "labels": LABELS}, "models": {"local": "tiny-bert"}}
    assert run_label(pf, parse_config(base)) == "dp_prefix"
    assert run_label(pf, parse_config({**base, "methods": {"privacy_flat": {"flat": {"awp": True, "regularizer": True}}}})) \
        == "dp_prefix+awp+reg"


def test_prefix_settings_that_do_not_fit_the_model_are_refused_before_any_budget(tmp_path):
    from types import SimpleNamespace

    from tasks.config import parse_config
    from tasks.errors import ConfigError
    from tasks.methods import get_method

    cfg = parse_config({
        "method": "privacy_flat", "experiment": "x", "state_dir": str(tmp_path), "allow_nonprivate_baselines": True,
        "data": {"name": "sst2", "labels": LABELS}, "models": {"local": "tiny-bert"},
        "methods": {"privacy_flat": {"flat": {"sparse": True, "layers": 99}}}})
    mechanism = get_method("privacy_flat").mechanism
    with pytest.raises(ConfigError, match="flat.layers = 99"):
        mechanism.preflight(cfg, None)  # the flow's preflight, before any reservation
    ok = parse_config({**cfg.model_dump(mode="json"), "methods": {"privacy_flat": {"flat": {"sparse": True, "layers": 1}}}})
    mechanism.preflight(ok, None)
    assert mechanism.prepare(SimpleNamespace(cfg=ok)) == {}  # nothing to prepare: the checks run once, in preflight


def test_private_sharpness_selection_publishes_nothing_of_it(toy, monkeypatch, tmp_path):
    """With sparse_data: private the kept layers (and the number of rounds) are statistics of the
    private data: they stay in the private history, not in the published metrics or progress."""
    from types import SimpleNamespace

    from tasks.methodkit import classifiers
    from tasks.config import parse_config
    from tasks.methods import PrivateRows, get_method

    clf, enc, y, init = toy
    monkeypatch.setattr(classifiers, "classifier_for", lambda cfg, name, template=None: clf)
    cfg = parse_config({
        "method": "privacy_flat", "experiment": "x", "state_dir": str(tmp_path), "allow_nonprivate_baselines": True,
        "data": {"name": "sst2", "labels": LABELS}, "models": {"local": "tiny-bert"},
        "methods": {"privacy_flat": {"n_tokens": 2, "flat": {"sparse": True, "layers": 1, "sharpness_examples": 8}}}})
    method = get_method("privacy_flat")
    plan = method.mechanism.plan(cfg, 16, 1e-5)
    rows = PrivateRows([f"text {i}" for i in range(16)], [LABELS[i % 2] for i in range(16)])
    calls = []
    out = method.mechanism.step_additions(SimpleNamespace(cfg=cfg, seed=0, paths=None), plan, rows,
                              progress=lambda *a: calls.append(a))
    assert not calls and not any(k.startswith("flat.layer") for k in out["metrics"])
    assert any("flat.sharpness_round" in h for h in out["history"])


def test_flatness_diagnostics_size_is_a_setting_and_zero_turns_them_off(tmp_path):
    """The flatness diagnostics cost ~18 passes over their test examples: a large local model
    (SmolLM2) runs them on fewer, or none (``flatness_examples: 0``)."""
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq

    from models.prompts.prefix import prefix_shape
    from tasks.config import parse_config
    from tasks.methods import get_method
    from tasks.prompts import save_prompt_file

    def cfg(examples):
        return parse_config({"method": "prefix_dpsgd", "experiment": "x", "state_dir": str(tmp_path),
                             "data": {"name": "sst2", "labels": LABELS},
                             "models": {"local": "tiny-gpt2", "max_length": 24},
                             "methods": {"prefix_dpsgd": {"n_tokens": 2, "flatness_examples": examples}}})

    test = tmp_path / "test.parquet"
    pq.write_table(pa.table({"text": ["a fine film", "dull", "a joy", "bad"] * 3, "label": LABELS * 6}), test)
    shape = prefix_shape(load_backbone("tiny-gpt2", "cpu").model, 2)
    prompt = save_prompt_file(tmp_path, "prefix", torch.randn(shape) * 0.1, {})
    ctx = SimpleNamespace(part=SimpleNamespace(test_path=str(test)))
    method = get_method("prefix_dpsgd")
    assert method.extras.diagnostics(ctx, str(prompt), SimpleNamespace(cfg=cfg(0))) == {}
    out = method.extras.diagnostics(ctx, str(prompt), SimpleNamespace(cfg=cfg(5)))
    assert "flatness.sharpness" in out["metrics"] and "plots/flatness.png" in out["figures"]
    assert "(5 test examples)" in out["figures"]["plots/flatness.png"].axes[0].get_ylabel()
