"""Privacy-Flat (Algorithm 1 of the Privacy-Flat paper): DP prefix tuning made flatter.

* **Within-layer** (§3.1, AWP): during the first ``awp_steps`` DP steps the per-example gradients
  are taken at ``w + v``, with ``v = γ · ‖w‖ · g / ‖g‖`` for the batch's *un-noised* mean gradient
  ``g`` (one ascent step: AWP's ``argmax_v L(w + v)`` in its usual one-step form, scaled per
  trainable layer as in Wu et al.); the DP noise is added to the final gradient only and the
  update is applied at ``w``. ``v`` reads private data without noise.
* **Cross-layer** (§3.1, Definition 1): prefix sharpness ``max_{w'∈C_η} (L(w') − L(w)) / (1 + L(w))²``
  over a box around w (sampled towards its ascent corner, see ``models.landscape.prefix_sharpness``) and greedy
  elimination of prefix layers:
  each round removes the layer whose removal gives the lowest sharpness, until ``keep`` layers
  remain or the sharpness stops decreasing. A removed layer is frozen at its initial value (its
  keys and values stay, untrained; see the README for why it is not deleted).
* **Cross-model** (§3.1, eq. 3.3–3.4): ``λ · ‖w − w_nor‖₂`` (not squared) to a non-privately
  trained copy; its gradient ``λ (w − w_nor) / ‖w − w_nor‖`` is added to the noised gradient
  (``tasks.methodkit.training.cross_model_pull``, which DPZero's regulariser uses too).

No Prefect or MLflow; the honest privacy labels are the method's (``method.py``). The loss-landscape
measures it uses (mean loss and gradient, Definition 1's sharpness, flatness curves) are generic:
``models/landscape.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.classifiers import PromptClassifier, select_rows
from models.dp_prompt_training import DPStepHook
from models.landscape import mean_gradient

from ...methodkit.training import cross_model_pull


@dataclass
class FlatStepHook(DPStepHook):
    """What Privacy-Flat adds to a DP-SGD prefix step, at the generic step's hook points (all off:
    plain DP-SGD, step for step): the kept layers as the trainable mask, AWP's ``w + v`` as the
    gradient point, the cross-model regulariser added to the noised gradient.

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
        return cross_model_pull(weight, self.w_nor, self.lam, mask)

    # ---- the hook points of models.dp_prompt_training ------------------------------------------
    def trainable_mask(self, shape, device):
        return self.mask(shape, device)  # sparse prefix layers: the removed ones are frozen

    def gradient_point(self, step, classifier, encoded, labels, idx, weight, sample_rate):
        # AWP (first E epochs only): gradients are taken at w + v, v from the batch's un-noised
        # mean gradient; the noise is added only to the final gradient
        return self.perturbed(step, classifier, encoded, labels, idx, weight, sample_rate)

    def adjust_gradient(self, grad, weight, mask):
        pull = self.regularizer_gradient(weight, mask)
        return grad if pull is None else grad + pull  # cross-model flattening: added to the noised gradient


def awp_perturbation(weight: torch.Tensor, grad: torch.Tensor, gamma: float) -> torch.Tensor:
    """One ascent step of AWP, per prefix layer: ``v_l = γ ‖w_l‖ g_l / ‖g_l‖`` (0 where g_l = 0)."""
    w = weight.flatten(1)
    g = grad.flatten(1)
    gn = g.norm(dim=1, keepdim=True)
    v = torch.where(gn > 0, gamma * w.norm(dim=1, keepdim=True) * g / gn.clamp_min(1e-12), torch.zeros_like(g))
    return v.view_as(weight)


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
