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


def check_delta(value, name: str = "delta", n: int | None = None,
                allow_at_least_one_over_n: bool = True) -> float:
    """δ must lie in the open interval (0, 1). With ``n`` (the number of records), δ ≥ 1/n —
    which (ε, δ)-DP lets a mechanism spend on publishing whole records — raises ``ValueError``
    when ``allow_at_least_one_over_n`` is False, and is warned about when it is True (the default
    here: a library call states it; the run lifecycle passes False unless the config opts in)."""
    if not _is_number(value) or not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    if not isinstance(allow_at_least_one_over_n, bool):
        raise ValueError(f"allow_at_least_one_over_n must be a bool, got {allow_at_least_one_over_n!r}")
    if n is not None:
        n = check_count(n, "n", minimum=1)
        if value >= 1.0 / n:
            # n is not in the message: a run's n is a released size, and a message (a Prefect
            # state, a log) is published before any charge covers it
            message = (f"{name}={value:g} is >= 1/n for this dataset's n records: "
                       "such a δ permits releasing whole records")
            if not allow_at_least_one_over_n:
                raise ValueError(f"{message}; use δ <= 1/(10 n), or leave privacy.target_delta unset for the default")
            warnings.warn(message, stacklevel=3)
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


def check_open_interval(value, low: float, high: float, name: str) -> float:
    """A finite number in the open interval (low, high) (``high`` may be ``math.inf``)."""
    if not _is_number(value) or math.isnan(value) or not (low < value < high):
        raise ValueError(f"{name} must lie in ({low:g}, {high:g}), got {value!r}")
    return float(value)
