"""Batched, gradient-free scoring of a (prompted) classifier."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.classifiers import PromptClassifier, num_examples, select_rows


@torch.no_grad()
def predict_logits(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """(N, n_labels) logits on CPU; ``prompt`` is None or (n, d)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    classifier.eval()
    N = num_examples(encoded)
    out = [
        classifier(select_rows(encoded, slice(i, i + batch_size)), prompt).float().cpu()
        for i in range(0, N, batch_size)
    ]
    return torch.cat(out) if out else torch.zeros((0, classifier.n_labels))


def accuracy(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    labels: torch.Tensor,
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> float:
    """Fraction of examples whose argmax logit is the label."""
    labels = torch.as_tensor(labels, dtype=torch.long).cpu()
    if labels.numel() == 0:
        raise ValueError("accuracy of an empty set")
    pred = predict_logits(classifier, encoded, prompt, batch_size).argmax(dim=1)
    return float((pred == labels).float().mean())


def per_example_loss(
    classifier: PromptClassifier,
    encoded: dict[str, torch.Tensor],
    labels: torch.Tensor,
    prompt: torch.Tensor | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """(N,) cross-entropy per example (for loss-threshold membership inference)."""
    labels = torch.as_tensor(labels, dtype=torch.long).cpu()
    logits = predict_logits(classifier, encoded, prompt, batch_size)
    return F.cross_entropy(logits, labels, reduction="none")
