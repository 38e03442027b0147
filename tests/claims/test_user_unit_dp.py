"""User-level DP-SGD and DPZero (issue 28): Poisson sampling of UNITS, one gradient (or one DPZero
scalar) per unit — its examples' combined, THEN clipped to C —, σ·C noise, and the accountant's q
and steps over units. Per-unit gradients are checked against a per-unit autograd loop (as the
per-sample ones are against a per-example loop in test_models.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from models import DPConfig, PromptTrainingConfig, load_backbone, select_rows, train_prompt
from models.classifiers import VerbalizerCausalLM, VerbalizerMaskedLM
from models.dp_prompt_training import DPStepHook, per_sample_prompt_gradients, per_unit_prompt_gradients

torch.set_num_threads(2)
LABELS = ["negative", "positive"]
TEXTS = ["a great movie", "terrible , boring and far too long", "ok", "the acting was wonderful", "bad",
         "awful film", "good fun", "i loved it"]
Y = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1])
UNITS = torch.tensor([0, 1, 1, 2, 0, 1, 3, 0])  # 4 people with 3, 3, 1 and 1 records


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-bert"])
def clf(request):
    cls = VerbalizerCausalLM if request.param == "tiny-gpt2" else VerbalizerMaskedLM
    return cls(load_backbone(request.param, "cpu"), LABELS)


def _prompt(clf, n=3, seed=0):
    return torch.randn(n, clf.embed_dim, generator=torch.Generator().manual_seed(seed)) * 0.5


def _unit_loop(clf, enc, y, prompt, units, combine):
    """Each unit's gradient by ordinary autograd on the shared prompt: d/dP of the mean (or sum) of
    its examples' losses, one backward pass per unit."""
    out = []
    for u in dict.fromkeys(units.tolist()):
        rows = (units == u).nonzero().squeeze(1)
        p = prompt.clone().requires_grad_()
        loss = F.cross_entropy(clf(select_rows(enc, rows), p), y[rows], reduction=combine)
        (g,) = torch.autograd.grad(loss, p)
        out.append(g)
    return torch.stack(out)


@pytest.mark.parametrize("combine", ["mean", "sum"])
def test_per_unit_gradients_match_a_per_unit_loop(clf, combine):
    enc = clf.encode(TEXTS)
    prompt = _prompt(clf)
    got = per_unit_prompt_gradients(clf, enc, Y, prompt, UNITS, combine)
    ref = _unit_loop(clf, enc, Y, prompt, UNITS, combine)
    assert got.shape == (4, *prompt.shape)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # a unit of several records is not any one of its records' gradients
    per_sample = per_sample_prompt_gradients(clf, enc, Y, prompt)
    assert not torch.allclose(got[0], per_sample[0], atol=1e-6)


def test_dp_step_clips_one_combined_gradient_per_unit_and_divides_by_expected_units():
    clf = VerbalizerCausalLM(load_backbone("tiny-llama", "cpu"), LABELS)
    enc = clf.encode(TEXTS, max_length=16)
    init = _prompt(clf)
    per_unit = _unit_loop(clf, enc, Y, init, UNITS, "mean")
    norms = per_unit.flatten(1).norm(dim=1)
    C = float(norms.median())  # about half the units get clipped
    factor = (C / (norms + 1e-6)).clamp(max=1.0)
    expected = init - 0.5 * (per_unit * factor[:, None, None]).sum(0) / 4  # q·U = 1·4 units
    cfg = PromptTrainingConfig(n_tokens=3, steps=1, lr=0.5, optimizer="sgd")
    res = train_prompt(clf, enc, Y, cfg, DPConfig(0.0, C, 1.0), init_prompt=init, units=UNITS)
    torch.testing.assert_close(res.prompt, expected, atol=1e-6, rtol=1e-5)
    assert res.history[0]["batch_size"] == 4 and res.history[0]["batch_examples"] == 8
    assert 0 < res.history[0]["clipped_frac"] < 1
    # the record-level step differs (it clips each of the 8 records)
    rec = train_prompt(clf, enc, Y, cfg, DPConfig(0.0, C, 1.0), init_prompt=init)
    assert not torch.allclose(rec.prompt, res.prompt, atol=1e-6)


def test_one_record_per_unit_is_the_record_level_step():
    clf = VerbalizerMaskedLM(load_backbone("tiny-bert", "cpu"), LABELS)
    enc = clf.encode(TEXTS, max_length=16)
    init = _prompt(clf)
    cfg = PromptTrainingConfig(n_tokens=3, steps=4, lr=0.1, optimizer="sgd")
    gens = lambda: dict(sample_generator=torch.Generator().manual_seed(1),  # noqa: E731
                        noise_generator=torch.Generator().manual_seed(2))
    dp = DPConfig(1.0, 0.5, 0.5)
    a = train_prompt(clf, enc, Y, cfg, dp, init_prompt=init, **gens())
    b = train_prompt(clf, enc, Y, cfg, dp, init_prompt=init, units=torch.arange(len(TEXTS)), **gens())
    torch.testing.assert_close(a.prompt, b.prompt, atol=1e-6, rtol=1e-5)


class _Spy(DPStepHook):
    def __init__(self):
        self.batches = []

    def gradient_point(self, step, classifier, encoded, labels, idx, weight, sample_rate):
        self.batches.append(idx.tolist())
        return weight


def test_poisson_sampling_draws_whole_units_at_rate_q():
    """Each step draws every UNIT independently with probability q (one uniform per unit from the
    sampling stream: U draws, not N) and takes all of its examples."""
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", "cpu"), LABELS)
    U, per, steps, q = 30, 3, 6, 0.2
    units = torch.arange(U).repeat_interleave(per)[torch.randperm(U * per, generator=torch.Generator().manual_seed(3))]
    texts = [f"review {i} good" if i % 2 else f"review {i} bad" for i in range(U * per)]
    enc = clf.encode(texts, max_length=8)
    y = torch.tensor([i % 2 for i in range(U * per)])
    spy = _Spy()
    res = train_prompt(clf, enc, y, PromptTrainingConfig(n_tokens=2, steps=steps, lr=0.01, physical_batch_size=256),
                       DPConfig(1.0, 1.0, q), units=units, hooks=[spy],
                       sample_generator=torch.Generator().manual_seed(0), noise_generator=torch.Generator().manual_seed(1))
    replay = torch.Generator().manual_seed(0)
    for idx, h in zip(spy.batches, res.history):
        drawn = set((torch.rand(U, generator=replay) < q).nonzero().squeeze(1).tolist())
        assert set(units[idx].tolist()) == drawn  # the units drawn at rate q ...
        assert sorted(idx) == [i for i in range(U * per) if int(units[i]) in drawn]  # ... with all their examples
        assert h["batch_size"] == len(drawn) and h["batch_examples"] == per * len(drawn)
    assert any(h["batch_size"] for h in res.history)


def test_units_must_cover_every_example():
    clf = VerbalizerCausalLM(load_backbone("tiny-gpt2", "cpu"), LABELS)
    enc = clf.encode(TEXTS, max_length=12)
    cfg = PromptTrainingConfig(n_tokens=2, steps=1)
    with pytest.raises(ValueError, match="units"):
        train_prompt(clf, enc, Y, cfg, DPConfig(1.0, 1.0, 1.0), units=torch.tensor([0, 2, 2, 2, 0, 2, 2, 0]))


# ---- DPZero ------------------------------------------------------------------------------------

def test_dpzero_releases_one_clipped_scalar_per_unit():
    from tasks.methods.dpzero.training import (DPZeroConfig, per_example_losses, train_dpzero,
                                               two_point_differences, unit_means)

    clf = VerbalizerMaskedLM(load_backbone("tiny-bert", "cpu"), LABELS)
    enc = clf.encode(TEXTS, max_length=12)
    init = _prompt(clf, n=2)
    mu, clip, lr = 1e-2, 0.05, 0.1
    z = torch.randn(init.shape, generator=torch.Generator().manual_seed(7))
    d = two_point_differences(lambda w: per_example_losses(clf, enc, Y, w), init, z, mu)
    # the per-unit scalar: the mean of its examples' differences (a per-unit loop)
    loop = torch.stack([d[UNITS == u].mean() for u in range(4)])
    torch.testing.assert_close(unit_means(d, UNITS), loop)
    expected = init - lr * (loop.clamp(-clip, clip).sum() / 4) * z
    cfg = DPZeroConfig(steps=1, sample_rate=1.0, noise_multiplier=0.0, clip=clip, mu=mu, lr=lr)
    res = train_dpzero(clf, enc, Y, init, cfg, sample_generator=torch.Generator().manual_seed(0),
                       noise_generator=torch.Generator().manual_seed(1),
                       direction_generator=torch.Generator().manual_seed(7), units=UNITS)
    torch.testing.assert_close(res.prompt, expected, atol=1e-6, rtol=1e-5)
    assert res.history[0]["batch_size"] == 4
    # adding or removing one unit moves the released sum by at most C (one clipped scalar per unit)
    without = unit_means(d[UNITS != 0], UNITS[UNITS != 0])
    assert abs(float(loop.clamp(-clip, clip).sum() - without.clamp(-clip, clip).sum())) <= clip + 1e-7


# ---- the plan: q and steps over units ------------------------------------------------------------

def _user_source(folder, people=120, per=5):
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"person {u} wrote review {j}", "label": ["neg", "pos"][(u + j) % 2], "author": f"p{u}"}
            for u in range(people) for j in range(per)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text("".join(json.dumps({**r, "text": r["text"] + " again",
                                                           "author": "t" + r["author"]}) + "\n" for r in rows[:50]))


@pytest.mark.parametrize("method", ["prompt_dpsgd", "dpzero"])
def test_plan_samples_units_at_q_over_the_released_unit_count(tmp_path, method, monkeypatch):
    from privacy import accountant as acct
    from privacy import events as ev

    # σ's calibration is tested in test_accountant.py; a fixed σ keeps this test fast (the ε of the
    # plan below is still the accountant's, and plan_for still checks it against the target)
    monkeypatch.setattr(acct, "calibrate_noise_multiplier", lambda *a, **k: 3.0)
    from tasks.config import parse_config
    from tasks.data import partition_dataset
    from tasks.run_plan import plan_for

    _user_source(tmp_path / "toy")
    raw = {"method": method, "state_dir": str(tmp_path / "state"),
           "data": {"name": "toy", "path": str(tmp_path / "toy"), "labels": ["neg", "pos"],
                    "privacy_unit": "author", "size_noise_sigma": 4.0},
           "models": {"local": "tiny-bert"}, "privacy": {"target_epsilon": 4.0},
           "methods": {method: {"batch_size": 10, "epochs": 0.3}}}
    cfg = parse_config(raw)
    part = partition_dataset(cfg.data, 0, tmp_path / "state" / "private", None)
    sizes = part.sizes
    assert part.n_train == 5 * part.n_train_units  # records vs people
    assert abs(sizes.n_train - part.n_train_units) < 25  # released: a count of units (σ = 4)
    plan = plan_for(cfg, method, sizes, 1e-6)
    q = plan.settings["sample_rate"]
    assert q == pytest.approx(10 / sizes.n_train)  # B units over the released number of units
    assert plan.settings["steps"] == math.ceil(0.3 / q)  # epochs over units
    assert plan.settings["expected_batch"] == pytest.approx(q * sizes.n_train)
    assert isinstance(plan.event, ev.AdaptiveEvent) and plan.event.first == sizes.event
    method_event = plan.event.then.events[0]
    assert isinstance(method_event, ev.SelfComposedEvent) and method_event.count == plan.settings["steps"]
    inner = method_event.event
    assert isinstance(inner, ev.PoissonSampledEvent) and inner.sampling_probability == pytest.approx(q)
    sampled = "dpsgd.sampled" if method == "prompt_dpsgd" else "dpzero.sampled"
    assert plan.params[sampled] == "units"


def test_a_record_level_dp_method_is_refused_with_a_user_unit(monkeypatch):
    """Every registered method whose guarantee is dp bounds a unit's contribution (unit_level); a dp
    method that does not is refused at config time with a user unit."""
    from tasks.config import parse_config
    from tasks.errors import ConfigError
    from tasks.methods import get_method, registered_methods

    raw = lambda m: {"method": m, "data": {"name": "toy", "labels": ["neg", "pos"], "privacy_unit": "author"},  # noqa: E731
                     "models": {"local": "tiny-bert"}, "allow_nonprivate_baselines": True}
    for m in registered_methods():
        try:
            cfg = parse_config(raw(m))
        except ConfigError:
            continue  # refused for its own reasons (e.g. public data it needs)
        assert get_method(m).traits.unit_level or get_method(m).mechanism.guarantee(cfg) != "dp", m
    from tasks.methods import METHODS

    spec = get_method("prompt_dpsgd")
    monkeypatch.setitem(METHODS.items, "prompt_dpsgd",
                        dataclasses.replace(spec, traits=dataclasses.replace(spec.traits, unit_level=False)))
    with pytest.raises(ConfigError, match="bounds only one record's contribution"):
        parse_config(raw("prompt_dpsgd"))
    parse_config({**raw("prompt_dpsgd"), "data": {"name": "toy", "labels": ["neg", "pos"]}})  # record: fine


# ---- DP-OPT: one vote per unit per query, at most one count per unit per candidate --------------

def _unit_members(seed, units, q=0.05, members=8, cap=6):
    import numpy as np

    from tasks.methods.dp_opt.method import member_demos

    return member_demos(np.random.default_rng(seed), len(units), q, members, cap, np.asarray(units))


@pytest.mark.parametrize("seed", range(30))
def test_dpopt_one_added_unit_changes_at_most_one_member(seed):
    """A unit of several rows added (its own draws; every other unit keeps its draws): at most one
    member's demos change — one vote moved, added or removed per unit, LimitedDomain's neighbours."""
    import numpy as np

    g = np.random.default_rng(500 + seed)
    U = int(g.integers(10, 120))
    sizes = g.integers(1, 8, size=U + 1)
    units = np.repeat(np.arange(U + 1), sizes)
    before_units = units[units < U]  # the last unit's rows are the last rows
    before, after = _unit_members(seed, before_units, q=0.2), _unit_members(seed, units, q=0.2)
    new_rows = set(np.flatnonzero(units == U).tolist())
    changed = [j for j, (a, b) in enumerate(zip(before, after)) if a.tolist() != b.tolist()]
    assert len(changed) <= 1
    for j in changed:
        assert set(after[j].tolist()) & new_rows
        assert set(after[j].tolist()) - new_rows <= set(before[j].tolist())
    # a unit's rows sit in one member
    for u in range(U + 1):
        holding = [j for j, m in enumerate(after) if set(m.tolist()) & set(np.flatnonzero(units == u).tolist())]
        assert len(holding) <= 1


def test_dpopt_units_are_sampled_at_rate_q():
    import numpy as np

    U, q = 20000, 0.1
    units = np.repeat(np.arange(U), 2)
    parts = _unit_members(3, units, q=q, members=5, cap=10**6)
    flat = np.concatenate(parts)
    drawn = np.unique(units[flat])
    assert abs(drawn.size / U - q) < 0.01  # units, not rows, at rate q
    assert flat.size == 2 * drawn.size  # with all their rows


def test_dpopt_selection_counts_at_most_one_per_unit_per_candidate():
    import numpy as np

    from tasks.methods.dp_opt.text_prompts import per_unit_counts

    g = np.random.default_rng(0)
    units = np.repeat(np.arange(12), g.integers(1, 9, size=12))
    correct = g.random((3, units.size)) < 0.6
    scores = per_unit_counts(correct, units)
    loop = np.array([sum(correct[c, units == u].mean() for u in range(12)) for c in range(3)])
    np.testing.assert_allclose(scores, loop)
    for u in range(12):  # removing any unit moves every candidate's score by at most one, the same way
        keep = units != u
        rest = np.unique(units[keep], return_inverse=True)[1]
        diff = scores - per_unit_counts(correct[:, keep], rest)
        assert np.all(diff >= -1e-12) and np.all(diff <= 1 + 1e-12)
    assert np.array_equal(per_unit_counts(correct), correct.sum(axis=1))  # record level: plain counts


# ---- RAPT: the d_X bound per record and per unit, no unit-level claim beyond it ------------------

def test_rapt_reports_its_token_bound_per_record_and_per_unit():
    from pathlib import Path

    from tasks.config import load_config
    from tasks.methods import get_method

    cfg_path = Path(__file__).resolve().parents[2] / "configs" / "rapt.yaml"
    record = load_config(cfg_path, ["data.path=/nonexistent"])
    plan = get_method("rapt").mechanism.plan(record, 1000, 1e-6)
    tokens = 96 - 2 - 40  # max_length less [CLS]/[SEP] and the 40 plain tokens
    assert plan.params["rapt.ldp_tokens_per_record"] == tokens
    assert plan.params["rapt.ldp_eta_tokens_per_record"] == 100.0 * tokens
    assert "rapt.ldp_eta_tokens_per_unit" not in plan.params
    capped = load_config(cfg_path, ["data.privacy_unit=author", "data.max_records_per_unit=7"])
    plan = get_method("rapt").mechanism.plan(capped, 1000, 1e-6)
    assert plan.guarantee == "ldp" and plan.params["rapt.ldp_eta_tokens_per_unit"] == 100.0 * tokens * 7
    assert "no formal unit-level claim" in plan.note and plan.params["rapt.unit_claim"].startswith("none")
    uncapped = load_config(cfg_path, ["data.privacy_unit=author"])
    assert get_method("rapt").mechanism.plan(uncapped, 1000, 1e-6).params["rapt.ldp_eta_tokens_per_unit"].startswith("unbounded")


def test_dpopt_shadow_split_keeps_whole_units():
    """An audit shadow (no holdout) splits its pool rows into generation and selection rows by WHOLE
    units, with their units (DP-OPT's per-unit vote and count need them)."""
    from tasks.methods.base import PrivateRows
    from tasks.methods.dp_opt.text_prompts import split_validation

    units = [f"u{i // 3}" for i in range(60)]
    rows = PrivateRows([f"t{i}" for i in range(60)], ["a"] * 60, units=units)
    gen, val = split_validation(rows, 0.2, 0)
    assert set(gen.units).isdisjoint(val.units) and len(set(val.units)) == 4
    assert sorted(gen.texts + val.texts) == sorted(rows.texts)
    assert all(units[int(t[1:])] == u for t, u in zip(gen.texts + val.texts, gen.units + val.units))
