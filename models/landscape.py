"""Loss landscape of a prompt on a frozen classifier: the mean loss and its gradient (no
clipping, no noise), Definition 1's box sharpness (Keskar et al., as Privacy-Flat uses it), and
flatness curves (loss along a random and an adversarial direction). Generic measures of any soft
prompt or prefix; on whatever data the caller passes (the diagnostics pass the TEST split)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.classifiers import PromptClassifier, select_rows


def mean_gradient(classifier: PromptClassifier, enc, labels, weight: torch.Tensor, batch_size: int = 64):
    """∇ of the mean cross-entropy over ``enc`` w.r.t. the prompt (no clipping, no noise)."""
    n = int(labels.shape[0])
    total = torch.zeros_like(weight, dtype=torch.float32)
    w = weight.detach().float().requires_grad_()
    for start in range(0, n, batch_size):
        rows = torch.arange(start, min(n, start + batch_size))
        with torch.enable_grad():
            loss = F.cross_entropy(classifier(select_rows(enc, rows), w).float(),
                                   labels[rows].to(classifier.device), reduction="sum") / n
            (g,) = torch.autograd.grad(loss, w)
        total += g
    return total


@torch.no_grad()
def mean_loss(classifier: PromptClassifier, enc, labels, weight: torch.Tensor, batch_size: int = 64) -> float:
    n = int(labels.shape[0])
    total = 0.0
    for start in range(0, n, batch_size):
        rows = torch.arange(start, min(n, start + batch_size))
        total += float(F.cross_entropy(classifier(select_rows(enc, rows), weight).float(),
                                       labels[rows].to(classifier.device), reduction="sum"))
    return total / n if n else 0.0  # no row: no loss (an empty batch or split)


STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the segment from w to the box's ascent corner is sampled
BOX = 0.1  # the side η of the box C_η, relative to the RMS of the trainable weights


def prefix_sharpness(loss_fn, grad_fn, weight: torch.Tensor, mask: torch.Tensor | None = None,
                     box: float = BOX, steps=STEPS) -> float:
    """Definition 1 (Keskar et al.'s box sharpness): max over w' in the box C_η of side η centred
    at w of (L(w') − L(w)) / (1 + L(w))², with η = ``box`` · RMS of the trainable weights
    (``mask``: the kept layers). The maximum is sampled on the segment from w to the box's corner
    in the ascent direction, w + t · (η/2) · sign(∇L(w)), t ∈ ``steps`` — the first-order
    maximiser of L over the box. (The paper writes the samples as w − η∇L(w), η ∈ [0, 1]: along
    the descent direction that maximum is 0 whenever the loss decreases, which it did in every
    run we measured, so nothing would ever be eliminated.)"""
    base = loss_fn(weight)
    m = torch.ones_like(weight) if mask is None else mask
    if float(m.sum()) == 0:
        return 0.0
    g = grad_fn(weight)
    rms = float(((weight * m) ** 2).sum() / m.sum()) ** 0.5
    corner = (box * rms / 2) * torch.sign(g) * m
    worst = max(0.0 if t == 0 else loss_fn(weight + t * corner) - base for t in steps)  # t = 0: L(w) − L(w)
    return worst / (1.0 + base) ** 2


@torch.no_grad()
def loss_along_direction(classifier: PromptClassifier, enc, labels, weight: torch.Tensor, direction: torch.Tensor,
                         radii, batch_size: int = 64) -> list[float]:
    """Mean loss at ``w + r · d/‖d‖ · ‖w‖`` for each radius ``r`` (the flatness plots, Figures 1 and 3)."""
    d = direction / direction.norm().clamp_min(1e-12) * weight.norm()
    return [mean_loss(classifier, enc, labels, weight + r * d, batch_size) for r in radii]


RADII = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)


def flatness_curves(classifier: PromptClassifier, enc, labels, weight: torch.Tensor, seed: int,
                    radii=RADII, batch_size: int = 64) -> dict:
    """Loss along a random (seeded Gaussian) and an adversarial (the loss gradient) direction at
    radii relative to ‖w‖, and Definition 1's sharpness — on whatever data is passed (the flows
    pass the TEST split)."""
    w = weight.detach().float().to(classifier.device)
    g = mean_gradient(classifier, enc, labels, w, batch_size)
    rand = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)).to(w.device)
    return {"radii": list(radii),
            "random": loss_along_direction(classifier, enc, labels, w, rand, radii, batch_size),
            "adversarial": loss_along_direction(classifier, enc, labels, w, g, radii, batch_size),
            "sharpness": prefix_sharpness(lambda p: mean_loss(classifier, enc, labels, p, batch_size),
                                          lambda p: g if p is w else mean_gradient(classifier, enc, labels, p, batch_size),
                                          w)}
