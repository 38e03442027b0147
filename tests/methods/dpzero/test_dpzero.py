"""DPZero's mechanism, not only its event: each example's two-point difference is clipped to C,
the sum gets Gaussian noise of std σ·C, empty Poisson batches still step, and the prompt moves
only along the public direction."""

import math

import pytest
import torch

from tasks.methods.dpzero.training import DPZeroConfig, noisy_clipped_sum, train_dpzero, two_point_differences


def test_differences_are_clipped_to_c_and_noise_has_std_sigma_c():
    d = torch.tensor([5.0, -7.0, 0.3, -0.2])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([noisy_clipped_sum(d, clip=1.0, noise_multiplier=2.0, noise_generator=g) for _ in range(20000)])
    # clipped sum = 1 - 1 + 0.3 - 0.2 = 0.1; noise std = σ·C = 2
    assert draws.mean().item() == pytest.approx(0.1, abs=0.06)
    assert draws.std().item() == pytest.approx(2.0, rel=0.03)
    g = torch.Generator().manual_seed(1)
    no_noise = noisy_clipped_sum(d, clip=0.25, noise_multiplier=0.0, noise_generator=g)
    assert no_noise.item() == pytest.approx(0.25 - 0.25 + 0.25 - 0.2)


def test_a_non_finite_difference_contributes_nothing():
    """Review 6, F2: one example whose loss overflowed (NaN, ±inf) adds 0 — the release stays finite
    and within C of its neighbour's — instead of failing the run at the step that sampled it."""
    g = torch.Generator()
    finite = torch.tensor([0.3, -0.2])
    for bad in (float("nan"), float("inf"), float("-inf")):
        with_bad = noisy_clipped_sum(torch.tensor([0.3, bad, -0.2]), 1.0, 0.0, g)
        assert torch.isfinite(with_bad) and with_bad.item() == pytest.approx(noisy_clipped_sum(finite, 1.0, 0.0, g).item())
    assert torch.isfinite(noisy_clipped_sum(torch.tensor([float("nan")] * 3), 1.0, 2.0, g))


def test_two_point_difference_of_a_quadratic_is_its_directional_derivative():
    w = torch.tensor([[1.0, -2.0]])
    z = torch.tensor([[0.5, 1.0]])
    losses = lambda p: torch.stack([(p ** 2).sum(), (3 * p).sum()])  # two "examples"
    d = two_point_differences(losses, w, z, mu=1e-3)
    assert d[0].item() == pytest.approx((2 * w * z).sum().item(), rel=1e-4)
    assert d[1].item() == pytest.approx((3 * z).sum().item(), rel=1e-4)


def test_one_example_moves_the_release_by_at_most_c():
    """Sensitivity: neighbouring batches (one example removed) differ by ≤ C before noise."""
    torch.manual_seed(0)
    d = torch.randn(50) * 10
    for i in range(50):
        without = torch.cat([d[:i], d[i + 1:]])
        gap = (noisy_clipped_sum(d, 1.5, 0.0, torch.Generator()) - noisy_clipped_sum(without, 1.5, 0.0, torch.Generator()))
        assert abs(gap.item()) <= 1.5 + 1e-6


def test_train_dpzero_steps_and_moves_along_public_directions():
    from models.classifiers import build_classifier
    from models.backbones import load_backbone

    clf = build_classifier(load_backbone("tiny-bert", seed=0), ["negative", "positive"])
    enc = clf.encode(["good", "bad", "fine film", "awful"] * 4, max_length=12)
    y = torch.tensor([1, 0, 1, 0] * 4)
    init = torch.zeros(2, clf.embed_dim)
    cfg = DPZeroConfig(steps=6, sample_rate=0.05, noise_multiplier=1.0, clip=1.0, lr=0.1)
    gens = lambda s: dict(sample_generator=torch.Generator().manual_seed(s), noise_generator=torch.Generator().manual_seed(s + 1),
                          direction_generator=torch.Generator().manual_seed(7))
    a = train_dpzero(clf, enc, y, init, cfg, **gens(0))
    b = train_dpzero(clf, enc, y, init, cfg, **gens(0))
    c = train_dpzero(clf, enc, y, init, cfg, **gens(10))
    assert a.steps == 6 and torch.equal(a.prompt, b.prompt) and not torch.equal(a.prompt, c.prompt)
    assert a.empty_batches + sum(h["batch_size"] > 0 for h in a.history) == 6
    # the update lies in the span of the public directions z_1..z_6
    g = torch.Generator().manual_seed(7)
    zs = torch.stack([torch.randn(init.shape, generator=g).flatten() for _ in range(6)])
    coef = torch.linalg.lstsq(zs.T, (a.prompt - init).flatten()).solution
    assert torch.allclose(zs.T @ coef, (a.prompt - init).flatten(), atol=1e-4)


def test_the_memory_probe_runs_on_public_rows_of_max_length(monkeypatch):
    """Review 8b, R3: DPZero sized its physical batch by forward passes on the first PRIVATE rows (on
    CUDA an out-of-memory decided by one long record); the probe now runs on public rows of
    ``models.max_length`` tokens."""
    from types import SimpleNamespace

    import torch

    import models.memory as mem
    import tasks.methods.dpzero.training as dz
    from models.backbones import load_backbone
    from models.classifiers import build_classifier

    seen = []
    real = dz.per_example_losses
    monkeypatch.setattr(dz, "per_example_losses", lambda c, batch, labels, prompt, n=64:
                        (seen.append(batch["input_ids"]), real(c, batch, labels, prompt, n))[1])
    monkeypatch.setattr(mem, "choose", lambda requested, device, probe=None: (probe(mem.PROBE_EXAMPLES), 7)[1])
    clf = build_classifier(load_backbone("tiny-bert", "cpu"), ["negative", "positive"])
    cfg = SimpleNamespace(models=SimpleNamespace(physical_batch_size=None, max_length=30))
    assert dz.physical_batch(cfg, clf, torch.zeros(3, clf.embed_dim)) == 7
    (ids,) = seen
    assert ids.shape == (mem.PROBE_EXAMPLES, 30)  # public rows, as long as any private row may be
