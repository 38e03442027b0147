"""The deterministic pre-noise statistics of a run's releases, by name (issue 37).

A :class:`privacy.plan.Release` names its statistics (``Release.statistics``: the sizes release
``released_sizes``; a method's own release what its class declares in
``Traits.neighbour_statistics``; a selection adds ``selection_counts``). Each statistic here is
computed by the project's own code for that release — the split rule and its counts
(``tasks.data``), the per-unit combination and clipping of DP-SGD (``models.dp_prompt_training``)
and DPZero (``tasks.methods.dpzero.training``), the holdout weights and count vectors of selection
(``tasks.selection``) — on a SOURCE dataset, with no noise, so that the neighbour harness
(tests/claims/test_neighbour_harness.py) can compute it on D and on D′ (one record, or one person, added
or removed) and check that it moves by at most the release's declared sensitivity (L2, in units of
the mechanism's clip bound).

Where a statistic needs what a model computes (a gradient, a two-point difference, a prediction),
it takes the worst case the mechanism must bound: every row's contribution far above the clip bound
and aligned with every other (the largest a sum of clipped parts can move), every holdout row
predicted right. These are statistics of private data: the harness runs them on synthetic data
only; nothing here is logged or published.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

Statistic = Callable[["SourceData", object, bytes], np.ndarray]
_STATISTICS: dict[str, Statistic] = {}

# a row's contribution before clipping, in units of the clip bound: far above it, so clipping binds
OVER_CLIP = 50.0


@dataclass(frozen=True)
class SourceData:
    """A source dataset: (texts, labels, person ids or None) of its train and test splits."""

    train: tuple
    test: tuple


_NORMS: dict[str, float] = {}


def register_statistic(name: str, norm: float = 2.0):
    """Register a pre-noise statistic ``fn(source, cfg, key) -> vector`` under ``name``; ``norm``:
    the norm its mechanism's sensitivity is stated in (2: a Gaussian's L2; ``inf``: the per-count
    bound of a vote histogram or a count vector, LimitedDomain's and the DP-argmax's)."""
    def add(fn: Statistic) -> Statistic:
        _STATISTICS[name] = fn
        _NORMS[name] = float(norm)
        return fn

    return add


def unregister_statistic(name: str) -> None:
    _STATISTICS.pop(name, None)
    _NORMS.pop(name, None)


def norm_of(name: str) -> float:
    """The norm (``ord`` of ``numpy.linalg.norm``) the statistic ``name`` moves are measured in."""
    return _NORMS.get(name, 2.0)


def statistic(name: str) -> Statistic | None:
    """The statistic registered under ``name`` (None: none is)."""
    return _STATISTICS.get(name)


def split_rows(source: SourceData, cfg, key: bytes):
    """The partition's rows of ``source`` (train, holdout, test: (texts, labels, units)), by the
    partition's own split rule and row assembly (no canaries: a neighbour differs in source records)."""
    from .data import _partition_rows, split_source

    split = split_source(cfg.data, key, source.train, source.test)
    return split, _partition_rows(cfg.data.model_copy(update={"canaries": 0}), 0, key, split, source.train, source.test)


@register_statistic("released_sizes")
def released_sizes(source: SourceData, cfg, key: bytes) -> np.ndarray:
    """The exact counts the sizes release adds noise to: (n_train, n_holdout, n_test), records or,
    with a user unit, distinct units (``tasks.data.release_inputs``)."""
    from .data import release_inputs

    split, _ = split_rows(source, cfg, key)
    _, exact, _ = release_inputs(cfg.data, key, split, source.train, source.test, 0)
    return np.array([exact["n_train"], exact["n_holdout"], exact["n_test"]], dtype=float)


def training_rows(source: SourceData, cfg, key: bytes):
    from .methods.base import PrivateRows

    _, rows = split_rows(source, cfg, key)
    texts, labels, units = rows.train
    return PrivateRows(texts, labels, units=units)


@register_statistic("clipped_gradient_sum")
def clipped_gradient_sum(source: SourceData, cfg, key: bytes) -> np.ndarray:
    """DP-SGD's pre-noise sum over a batch holding every training row (the sum each sampled batch
    is a part of): per row, or — as the trainer is handed units (``methodkit.training.unit_tensor``)
    — per unit combined (``combine_per_unit`` / ``finish_per_unit``) and clipped once
    (``_ClippedSum.add_clipped``), clip bound 1."""
    import torch

    from models.dp_prompt_training import _ClippedSum, combine_per_unit, finish_per_unit

    from .methodkit.training import unit_tensor

    rows = training_rows(source, cfg, key)
    grads = torch.zeros((len(rows), 3), dtype=torch.float64)
    grads[:, 0] = OVER_CLIP
    out = _ClippedSum(torch.zeros(3, dtype=torch.float64))
    units = unit_tensor(cfg, rows).get("units")
    if units is None:
        out.add_clipped(grads, 1.0)
    elif len(rows):
        n_units = int(units.max()) + 1
        summed, counts = combine_per_unit(grads, units, n_units)
        out.add_clipped(finish_per_unit(summed, counts, "mean"), 1.0)
    return out.summed.numpy()


@register_statistic("selection_counts")
def selection_counts(source: SourceData, cfg, key: bytes) -> np.ndarray:
    """A candidate's holdout count vector (per class (right, wrong)), every row predicted right:
    rows counted once, or with a person unit one vote per person (``tasks.selection.holdout_weights``)."""
    from .methods.base import PrivateRows
    from .selection import holdout_weights, per_class_counts

    _, rows = split_rows(source, cfg, key)
    texts, labels, units = rows.holdout
    holdout = PrivateRows(texts, labels, units=units)
    y = np.array([list(cfg.data.labels).index(label) for label in labels], dtype=int)
    return np.asarray(per_class_counts(y, y, len(cfg.data.labels), holdout_weights(cfg, holdout)), dtype=float)


@register_statistic("no_prompt_difference", norm=2.0)
def no_prompt_difference(source: SourceData, cfg, key: bytes) -> np.ndarray:
    """The comparison with no prompt's pre-noise D (``tasks.no_prompt.exact_difference``, the run's
    own code) on the partition's holdout, every row right with the prompt and wrong without it (the
    largest D: each row +1, or with a person unit each person's rows 1/n each): one record (person)
    moves it by ≤ 1, the sensitivity its Gaussian states (a record-level run charged per person: ≤ k)."""
    from .methods.base import PrivateRows
    from .no_prompt import exact_difference

    _, rows = split_rows(source, cfg, key)
    texts, labels, units = rows.holdout
    holdout = PrivateRows(texts, labels, units=units)
    n_labels = len(cfg.data.labels)
    y = np.array([list(cfg.data.labels).index(label) for label in labels], dtype=int)

    def predict(prompt, _rows):
        return y if prompt is not None else (y + 1) % n_labels

    return np.array([exact_difference(cfg, predict, "the prompt", holdout)])
