"""Privacy-Flat (Algorithm 1 of the Privacy-Flat paper): DP prefix tuning made flatter.

* **Within-layer** (§3.1, AWP): during the first ``awp_steps`` DP steps the per-example gradients
  are taken at ``w + v``, with ``v = γ · ‖w‖ · g / ‖g‖`` for the batch's *un-noised* mean gradient
  ``g`` (one ascent step: AWP's ``argmax_v L(w + v)`` in its usual one-step form, scaled per
  trainable layer as in Wu et al.); the DP noise is added to the final gradient only and the
  update is applied at ``w``. ``v`` reads private data without noise.
* **Cross-layer** (§3.1, Definition 1): prefix sharpness ``max_{w'∈C_η} (L(w') − L(w)) / (1 + L(w))²``
  over a box around w (sampled towards its ascent corner, see :func:`prefix_sharpness`) and greedy
  elimination of prefix layers:
  each round removes the layer whose removal gives the lowest sharpness, until ``keep`` layers
  remain or the sharpness stops decreasing. A removed layer is frozen at its initial value (its
  keys and values stay, untrained; see the README for why it is not deleted).
* **Cross-model** (§3.1, eq. 3.3–3.4): ``λ · ‖w − w_nor‖₂`` (not squared) to a non-privately
  trained copy; its gradient ``λ (w − w_nor) / ‖w − w_nor‖`` is added to the noised gradient.

No Prefect or MLflow; the honest privacy labels are the method's (``tasks/methods/privacy_flat.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.classifiers import PromptClassifier, select_rows


@dataclass
class FlatOptions:
    """What Privacy-Flat adds to a DP-SGD prefix step (all off: plain DP-SGD, step for step).

    ``layers``: indices of the trainable prefix layers (None: all); ``awp_steps``: DP steps with
    AWP (0: none); ``awp_gamma``: relative perturbation size; ``w_nor`` and ``lam``: the
    cross-model regulariser (None / 0: none). AWP draws no randomness (one deterministic ascent
    step), so switching it on never shifts the DP sampling and noise streams.
    """

    layers: list[int] | None = None
    awp_steps: int = 0
    awp_gamma: float = 0.01
    w_nor: torch.Tensor | None = None
    lam: float = 0.0
    physical_batch_size: int = 64

    def mask(self, shape, device) -> torch.Tensor | None:
        if self.layers is None:
            return None
        m = torch.zeros(shape, device=device)
        m[list(self.layers)] = 1.0
        return m

    def perturbed(self, step: int, classifier: PromptClassifier, enc, labels, idx, weight, q: float):
        """``w + v`` during the AWP steps, ``weight`` itself afterwards (and for empty batches)."""
        if step > self.awp_steps or idx.numel() == 0:
            return weight
        g = mean_gradient(classifier, select_rows(enc, idx), labels[idx], weight.detach(), self.physical_batch_size)
        mask = self.mask(weight.shape, weight.device)
        if mask is not None:
            g = g * mask
        return (weight.detach() + awp_perturbation(weight.detach(), g, self.awp_gamma)).detach()

    def regularizer_gradient(self, weight: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        if self.w_nor is None or not self.lam:
            return None
        diff = weight - self.w_nor.to(weight.device)
        if mask is not None:
            diff = diff * mask
        norm = diff.norm()
        if norm == 0:
            return torch.zeros_like(weight)
        return self.lam * diff / norm


def awp_perturbation(weight: torch.Tensor, grad: torch.Tensor, gamma: float) -> torch.Tensor:
    """One ascent step of AWP, per prefix layer: ``v_l = γ ‖w_l‖ g_l / ‖g_l‖`` (0 where g_l = 0)."""
    w = weight.flatten(1)
    g = grad.flatten(1)
    gn = g.norm(dim=1, keepdim=True)
    v = torch.where(gn > 0, gamma * w.norm(dim=1, keepdim=True) * g / gn.clamp_min(1e-12), torch.zeros_like(g))
    return v.view_as(weight)


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
    return total / n


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


def eliminate_layers(sharpness_of, n_layers: int, keep: int, progress=None) -> tuple[list[int], list[dict]]:
    """Greedy cross-layer flattening: ``sharpness_of(layers)`` for a set of kept layers. Each round
    drops the layer whose removal gives the lowest sharpness; stops at ``keep`` layers or when the
    best removal does not lower the sharpness. Returns (kept layers, rounds)."""
    if not 1 <= keep <= n_layers:
        raise ValueError(f"keep must lie in [1, {n_layers}], got {keep}")
    layers = list(range(n_layers))
    current = sharpness_of(layers)
    rounds = []
    while len(layers) > keep:
        trials = {i: sharpness_of([l for l in layers if l != i]) for i in layers}
        best = min(trials, key=lambda i: (trials[i], i))
        rounds.append({"kept_before": list(layers), "sharpness_before": current, "removed": best,
                       "sharpness_after": trials[best]})
        if progress is not None:
            progress(len(rounds), n_layers - keep)
        if not trials[best] < current:
            rounds[-1]["removed"] = None  # no decrease: stop
            break
        layers.remove(best)
        current = trials[best]
    return layers, rounds


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
