"""DPZero's pre-noise statistic for the neighbour harness (``tasks/neighbours.py``), registered by name."""

from __future__ import annotations

import numpy as np

from ...neighbours import OVER_CLIP, SourceData, register_statistic, training_rows


@register_statistic("clipped_difference_sum")
def clipped_difference_sum(source: SourceData, cfg, key: bytes) -> np.ndarray:
    """DPZero's pre-noise scalar: per row, or per unit (``unit_means``), two-point differences
    clipped to 1 and summed (``noisy_clipped_sum`` at noise 0)."""
    import torch  # the registry imports this package: torch only when the statistic is computed

    from ...methodkit.training import unit_tensor
    from .training import noisy_clipped_sum, unit_means

    rows = training_rows(source, cfg, key)
    diffs = torch.full((len(rows),), OVER_CLIP, dtype=torch.float64)
    units = unit_tensor(cfg, rows).get("units")
    if units is not None and len(rows):
        diffs = unit_means(diffs, units)
    zero = torch.Generator().manual_seed(0)
    return np.array([float(noisy_clipped_sum(diffs, 1.0, 0.0, zero))])
