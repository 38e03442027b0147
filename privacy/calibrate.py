"""The one search behind every calibration: a privacy target in, a mechanism's parameter out.

A calibration looks for the point where a monotone test ``fits(x)`` changes — typically "the run
at parameter x spends ε(x) ≤ target": the smallest noise multiplier σ that fits (ε falls as σ
grows), the largest number of queries or the largest per-run target ε that fits (ε grows with
them), the γ of a trial-count law with a given mean. Every calibration of the project is made of
the two steps below (``privacy/accountant.py``, ``privacy/selection.py``, ``privacy/trials.py``,
``privacy/rdp.py``, ``privacy/audit.py``, and through them the methods and the selection of
``tasks/``):

1. :func:`walk` brackets the answer: from a first guess, step (×2, ÷2, …) while a test holds;
2. :func:`search` narrows the bracket: ``good`` (tested, fits) and ``bad`` (does not fit), a
   proposal between them (:func:`geometric`, :func:`arithmetic`, :func:`integer` midpoints, or an
   interpolation on a smooth ε(x): :func:`toward`, :func:`largest_within`) tested and made the new
   ``good`` or ``bad`` end, until a stopping rule says the bracket is narrow enough.

The answer is the ``good`` end: a point that was tested and fits, never an extrapolation, so a
calibration errs only on the safe side of its target (or, where a bracket end was given rather
than tested, on the side its caller proved: e.g. a σ the RDP bound accepts, which every accountant
of the project accepts too).

The midpoints and stopping rules are the exact floating-point forms each calibration has used
since it was written (``hi / lo > 1 + tol`` and ``hi > lo·(1 + tol)`` are kept apart: they can
differ in the last bit), so each calibrated number is the same, bit for bit, as before this module
gathered them. Pure Python: no accounting here, no import of the rest of ``privacy/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

Test = Callable[[float], bool]


# ---- step 1: bracket ------------------------------------------------------------------------

def walk(holds: Test, x, step: Callable[[float], Optional[float]]):
    """Test ``holds(x)``; while it holds, move to ``x = step(x)`` and test again. ``step`` returns
    None where no further point is allowed (a limit reached).

    Returns ``(last, first)``: the last point where the test held (None if it failed at once) and
    the first where it did not (None when the steps ran out while it still held)."""
    last = None
    while holds(x):
        last = x
        x = step(x)
        if x is None:
            return last, None
    return last, x


# ---- step 2: narrow -------------------------------------------------------------------------

@dataclass
class Bracket:
    """A search's state: ``good`` fits, ``bad`` does not (either None until one is found), the
    points tested so far in order with their outcome, and which end is the larger."""

    good: Optional[float]
    bad: Optional[float]
    good_is_high: bool
    tested: list = field(default_factory=list)  # [(x, fits)]

    @property
    def bracketed(self) -> bool:
        return self.good is not None and self.bad is not None

    @property
    def lo(self):
        return self.bad if self.good_is_high else self.good

    @property
    def hi(self):
        return self.good if self.good_is_high else self.bad

    @property
    def last(self):
        return self.tested[-1][0] if self.tested else None


Proposal = Callable[[Bracket], float]
Rule = Callable[[Bracket], bool]


def search(fits: Test, good=None, bad=None, *, good_is_high: bool, propose: Proposal,
           narrow: Rule | None = None, first=None, max_tests: int | None = None) -> Bracket:
    """Narrow ``[good, bad]`` around the point where ``fits`` changes.

    Each round: test the current point (``first``, if given, is the first one) and make it the new
    ``good`` or ``bad`` end; stop when ``narrow(bracket)`` says so; else ask ``propose(bracket)``
    for the next point (a proposal may refuse by raising) and stop there when ``max_tests`` points
    have been tested. ``good_is_high``: whether fitting points lie above the others (σ: larger
    noise fits; a number of queries: smaller ones fit). Returns the final :class:`Bracket`."""
    b = Bracket(good, bad, good_is_high)
    x = first
    while True:
        if x is not None:
            ok = bool(fits(x))
            b.tested.append((x, ok))
            if ok:
                b.good = x
            else:
                b.bad = x
        if narrow is not None and narrow(b):
            return b
        x = propose(b)
        if max_tests is not None and len(b.tested) >= max_tests:
            return b


# ---- proposals ------------------------------------------------------------------------------

def geometric(b: Bracket) -> float:
    """Bisection on a log scale (a noise multiplier, a target ε)."""
    return math.sqrt(b.lo * b.hi)


def arithmetic(b: Bracket) -> float:
    return 0.5 * (b.lo + b.hi)


def integer(b: Bracket) -> int:
    return (b.lo + b.hi) // 2


def toward(target: float, value: Callable[[float], float], rel_tol: float) -> Proposal:
    """Interpolation for the LARGEST x with ``value(x) ≤ target``, ``value`` smooth and increasing
    (the ε of a run composed with others, as a function of its target): the secant point of the
    bracket's values at the target; geometric bisection instead whenever the same end moved twice
    in a row, or the values do not bracket the target; kept a quarter of ``rel_tol`` inside the
    ends, so every test narrows the bracket."""

    def propose(b: Bracket) -> float:
        lo, hi = b.lo, b.hi
        t_lo, t_hi = value(lo), value(hi)
        same_end_twice = len(b.tested) >= 2 and b.tested[-1][1] == b.tested[-2][1]
        if same_end_twice or not math.isfinite(t_hi) or t_hi <= t_lo:
            x = math.sqrt(lo * hi)
        else:
            x = lo + (hi - lo) * (target - t_lo) / (t_hi - t_lo)
        return min(max(x, lo * (1.0 + rel_tol / 4)), hi / (1.0 + rel_tol / 4))

    return propose


# ---- stopping rules (each a caller's exact form) --------------------------------------------

def ratio_within(tol: float) -> Rule:
    """hi / lo ≤ 1 + tol."""
    return lambda b: not b.hi / b.lo > 1.0 + tol


def relative_within(tol: float) -> Rule:
    """hi ≤ lo·(1 + tol)."""
    return lambda b: not b.hi > b.lo * (1.0 + tol)


def width_within(tol: float) -> Rule:
    """hi − lo ≤ tol."""
    return lambda b: not b.hi - b.lo > tol


def width_within_fraction(tol: float) -> Rule:
    """hi − lo ≤ tol·hi."""
    return lambda b: not b.hi - b.lo > tol * b.hi


# ---- the largest x with value(x) ≤ target, by secant steps ------------------------------------

class BelowFloor(ValueError):
    """A search's next step fell below the floor it was given (nothing at or above it fits)."""


def largest_within(value: Callable[[float], float], target: float, first: float, *, tolerance: float,
                   floor: float, max_tests: int = 12) -> Optional[float]:
    """The largest x found with ``value(x) ≤ target``, stopping at the first x with
    ``target·(1 − tolerance) ≤ value(x) ≤ target`` — for a smooth, increasing ``value`` with slope
    ≈ 1 whose every evaluation is expensive (a selection's ε as a function of its trials' target:
    each evaluation calibrates every candidate).

    From ``first``: while only fitting points are known, step up by what is left to
    target·(1 − tolerance/2); while only points above the target are known, step down by 1.1 times
    the excess (a quarter of the lowest such point when that falls below ``floor``); once
    bracketed, the secant point toward target·(1 − tolerance/2), kept within the middle 80 % of the
    bracket, until the bracket is narrower than a factor 1 + tolerance/4. At most ``max_tests``
    evaluations. Raises :class:`BelowFloor` when a step falls below ``floor``; returns None when no
    tested point fits."""
    seen: dict[float, float] = {}

    def at(x: float) -> float:
        if x not in seen:
            seen[x] = value(x)
        return seen[x]

    aim = target * (1 - tolerance / 2)

    def done(b: Bracket) -> bool:
        if target * (1 - tolerance) <= at(b.last) <= target:
            return True
        return b.bracketed and b.hi / b.lo < 1 + tolerance / 4

    def propose(b: Bracket) -> float:
        if b.bracketed:
            lo, hi = b.lo, b.hi
            t = lo + (hi - lo) * (aim - at(lo)) / max(at(hi) - at(lo), 1e-12)
            t = min(max(t, lo + (hi - lo) * 0.1), lo + (hi - lo) * 0.9)
        elif b.bad is not None:  # overshoot only: step down by the excess (slope ≈ 1), a little further
            t = b.bad - 1.1 * (at(b.bad) - aim)
            if t < floor:
                t = b.bad / 4
        else:  # fits only: step up by what is left
            t = b.good + (aim - at(b.good))
        if t < floor:
            raise BelowFloor(f"the search for the largest x with value(x) ≤ {target:.4g} fell below x = {floor:.4g}")
        return t

    return search(lambda x: at(x) <= target, good_is_high=False, propose=propose, narrow=done, first=first,
                  max_tests=max_tests).good
