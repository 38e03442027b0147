"""Argument checks shared by every privacy module.

Each check raises ``ValueError`` naming the argument and the offending value, so a bad config
fails before any private data is touched.
"""

from __future__ import annotations

import math
import warnings


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_epsilon(value, name: str = "epsilon") -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_nonnegative(value, name: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_delta(value, name: str = "delta", n: int | None = None) -> float:
    """δ must lie in the open interval (0, 1); δ ≥ 1/n is allowed but warned about."""
    if not _is_number(value) or not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    if n is not None and n > 0 and value >= 1.0 / n:
        warnings.warn(
            f"{name}={value:g} is >= 1/n = {1.0 / n:g} for a dataset of n={n} records: "
            "such a δ permits releasing whole records",
            stacklevel=3,
        )
    return float(value)


def check_rate(value, name: str = "sampling_probability") -> float:
    """A sampling probability q must lie in (0, 1]."""
    if not _is_number(value) or not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)


def check_count(value, name: str = "count", minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_positive(value, name: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
