"""DPZero (Zhang et al. 2023; Privacy-Flat eq. 3.5): black-box DP prompt tuning with a
two-point zeroth-order gradient estimate. Only losses are queried, never gradients:

    z ~ N(0, I)                                   (a public direction: independent of the data)
    d_i = (L(w + μz; x_i) − L(w − μz; x_i)) / 2μ   (one scalar per example of the Poisson batch)
    s = Σ_i clip(d_i, C) + N(0, σ²C²)             (the only private release of the step)
    w ← w − lr · (s / (q·N)) · z

Adding or removing one example moves ``Σ clip(d_i, C)`` by at most C, so each step is the
Poisson-subsampled Gaussian mechanism with noise multiplier σ — the event
``privacy.events.dpzero_event(q, σ, steps)``.

Per privacy unit (``units``: the person of each example): the Poisson sample is of units; a unit's
examples' differences are averaged into ONE scalar d_u, clipped to C, so adding or removing a unit
moves the sum by at most C and the same event holds with q and steps over units. The direction ``z`` may come from any generator
(it carries no private information); the Poisson sampling and the noise must come from secret
generators (the caller passes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from models.classifiers import PromptClassifier, num_examples, select_rows


@dataclass
class DPZeroConfig:
    steps: int
    sample_rate: float
    noise_multiplier: float
    clip: float = 1.0        # C: bound on each example's two-point difference
    mu: float = 1e-3         # perturbation scale of the two-point estimate
    lr: float = 1e-3
    physical_batch_size: int = 64
    expected_batch: float | None = None  # planned q·n (released n); None: q·N of the rows given

    def __post_init__(self):
        if self.steps < 1 or not 0 < self.sample_rate <= 1:
            raise ValueError(f"steps must be >= 1 and sample_rate in (0, 1], got {self.steps}, {self.sample_rate}")
        if self.noise_multiplier < 0 or self.clip <= 0 or self.mu <= 0 or self.lr <= 0:
            raise ValueError("noise_multiplier must be >= 0 and clip, mu, lr > 0")


@dataclass
class DPZeroResult:
    prompt: torch.Tensor
    steps: int
    empty_batches: int
    history: list[dict] = field(default_factory=list)  # exact private statistics: local only


def physical_batch(cfg, classifier: PromptClassifier, prompt: torch.Tensor) -> int:
    """``models.physical_batch_size``, or (null) the size chosen for the device from a probe of two
    forward passes (:func:`models.memory.choose`; DPZero takes no gradient) on PUBLIC rows of
    ``models.max_length`` tokens, never on private ones (an out-of-memory decided by
    one long record)."""
    from models.memory import choose

    length = cfg.models.max_length

    def probe(n: int) -> None:
        public = classifier.encode(["the " * length] * n, max_length=length)
        per_example_losses(classifier, public, torch.zeros(n, dtype=torch.long), prompt, n)

    return choose(cfg.models.physical_batch_size, classifier.device, probe)


@torch.no_grad()
def per_example_losses(classifier: PromptClassifier, batch: dict, labels: torch.Tensor, prompt: torch.Tensor,
                       physical_batch_size: int = 64) -> torch.Tensor:
    """(B,) cross-entropy per example: the black-box query (forward passes only)."""
    out = []
    B = num_examples(batch)
    for start in range(0, B, physical_batch_size):
        rows = slice(start, start + physical_batch_size)
        logits = classifier(select_rows(batch, rows), prompt)
        out.append(F.cross_entropy(logits.float(), labels[rows].to(logits.device), reduction="none").cpu())
    return torch.cat(out) if out else torch.zeros(0)


def two_point_differences(loss_fn: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor,
                          z: torch.Tensor, mu: float) -> torch.Tensor:
    """(B,) per-example (L(w + μz) − L(w − μz)) / 2μ."""
    return (loss_fn(prompt + mu * z) - loss_fn(prompt - mu * z)) / (2 * mu)


def noisy_clipped_sum(differences: torch.Tensor, clip: float, noise_multiplier: float,
                      noise_generator: torch.Generator) -> torch.Tensor:
    """Σ clip(d_i, C) + N(0, (σC)²): the step's only private release (a scalar). A non-finite d_i
    (one example's loss overflowing in reduced precision; a unit's mean over it) contributes 0, as
    DP-SGD's overflowing example does: clamp keeps NaN, and one record would otherwise decide
    whether the run fails, and at which step."""
    clipped = torch.where(torch.isfinite(differences), differences, torch.zeros_like(differences)).clamp(-clip, clip)
    noise = torch.normal(0.0, noise_multiplier * clip, size=(), generator=noise_generator)
    return clipped.sum() + noise


def unit_means(values: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """(U_b,) the mean of ``values`` over each unit present in ``units`` (same length)."""
    uniq, pos = torch.unique(units, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=values.dtype).index_add_(0, pos, values)
    counts = torch.zeros(len(uniq), dtype=values.dtype).index_add_(0, pos, torch.ones_like(values))
    return sums / counts


def train_dpzero(classifier: PromptClassifier, encoded: dict, labels: torch.Tensor, init_prompt: torch.Tensor,
                 config: DPZeroConfig, *, sample_generator: torch.Generator, noise_generator: torch.Generator,
                 direction_generator: torch.Generator, progress: Callable[[int, int], None] | None = None,
                 regularizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 units: torch.Tensor | None = None) -> DPZeroResult:
    """DPZero on a soft prompt. ``regularizer(w)`` (optional) returns a gradient added to the
    noised estimate (Privacy-Flat's λ·‖w − w_nor‖₂ in the black-box setting; it reads a
    non-privately trained copy, so a run using it has no formal guarantee). ``units``: (N,) unit
    index 0..U-1 per example for user-level DPZero (module docstring)."""
    labels = torch.as_tensor(labels, dtype=torch.long).cpu()
    N = num_examples(encoded)
    if labels.shape != (N,):
        raise ValueError(f"need one label per example (N={N}, labels {tuple(labels.shape)})")
    # an EXACTLY empty training set still takes the planned steps (every batch empty: noise alone):
    # refusing it would be a 0-vs-1 test of one record outside ε
    if N == 0:
        units = None
    if units is not None:
        units = torch.as_tensor(units, dtype=torch.long).cpu()
        if units.shape != (N,) or units.min() < 0 or torch.unique(units).numel() != int(units.max()) + 1:
            raise ValueError(f"units must be ({N},) unit indices 0..U-1, each with at least one example")
    U = N if units is None else int(units.max()) + 1
    classifier.eval()
    prompt = init_prompt.detach().float().to(classifier.device).clone()
    expected = config.expected_batch if config.expected_batch is not None else config.sample_rate * U
    history, empty = [], 0
    for step in range(1, config.steps + 1):
        drawn = torch.rand(U, generator=sample_generator) < config.sample_rate  # of units (examples without)
        idx = (drawn if units is None else drawn[units]).nonzero().squeeze(1)
        z = torch.randn(prompt.shape, generator=direction_generator).to(prompt.device)
        if idx.numel():
            batch, y = select_rows(encoded, idx), labels[idx]
            diffs = two_point_differences(
                lambda w: per_example_losses(classifier, batch, y, w, config.physical_batch_size), prompt, z, config.mu)
            if units is not None:
                diffs = unit_means(diffs, units[idx])  # one scalar per sampled unit, clipped below
        else:
            empty += 1  # still step: noise only (skipping would reveal the empty batch)
            diffs = torch.zeros(0)
        released = noisy_clipped_sum(diffs, config.clip, config.noise_multiplier, noise_generator)
        grad = (released / expected) * z
        if regularizer is not None:
            grad = grad + regularizer(prompt)
        prompt = prompt - config.lr * grad
        if not torch.isfinite(prompt).all():
            raise RuntimeError(f"the prompt became non-finite at DPZero step {step}")
        history.append({"step": step, "batch_size": int(diffs.numel()),  # units sampled (examples without units)
                        "clipped_frac": float((diffs.abs() > config.clip).float().mean()) if idx.numel() else None})
        if progress is not None and (step % 10 == 0 or step == config.steps):
            progress(step, config.steps)
    return DPZeroResult(prompt.cpu(), config.steps, empty, history)
