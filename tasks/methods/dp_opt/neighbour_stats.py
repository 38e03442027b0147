"""DP-OPT's pre-noise statistics for the neighbour harness (``tasks.neighbours``; issue 37).

* ``dp_opt_votes``: one LimitedDomain query's vote histogram. The members' demos come from the
  project's own :func:`member_demos`; each non-empty member votes for a token that is an arbitrary
  function of its demos (here a hash of them: any vote rule is covered, since the bound is on which
  members change). Under the coupling the accountant's proof uses — each row (each unit) keeps its
  own uniforms (u, v) in D and in D′ — adding or removing one record (one person) changes at most
  one member's demos, so at most one vote moves, appears or disappears: every count moves by ≤ 1
  (L∞; ``l0_sensitivity = 2`` counts). The harness draws those uniforms from a keyed hash of each
  row (unit), which IS that coupling.
* ``dp_opt_selection_counts``: the DP-argmax's correct-counts on the holdout through the project's
  :func:`per_unit_counts` (every row right: the largest counts), each moved by ≤ 1 per record or
  person (monotone, L∞).

Statistics of private data: run by the harness on synthetic rows only."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np

from ...neighbours import register_statistic, split_rows, training_rows

VOTE_BINS = 5
SAMPLE_RATE = 0.5  # a fixed rate: in a run q comes from the RELEASED size, the same on D and D′


class _KeyedDraws:
    """A stand-in for the sampling stream that gives row (unit) i the uniforms of its own key."""

    def __init__(self, key: bytes, names: list[str]):
        self.key, self.names = key, names

    def random(self, shape):
        assert shape == (len(self.names), 2), shape
        return np.array([[self._uniform(name, j) for j in (0, 1)] for name in self.names])

    def _uniform(self, name: str, j: int) -> float:
        digest = hmac.new(self.key, f"{name}\x1f{j}".encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64


def _names(rows) -> tuple[list[str], np.ndarray | None]:
    """(the key of each draw: a row's text and label, or a unit's id; the unit index per row or None)."""
    index = rows.unit_index()
    if index is None:
        return [f"{t}\x1e{l}" for t, l in zip(rows.texts, rows.labels)], None
    by_index = {i: u for u, i in zip(rows.units, index[0])}
    return [by_index[i] for i in range(index[1])], np.asarray(index[0], dtype=np.int64)


@register_statistic("dp_opt_votes", norm=np.inf)
def votes(source, cfg, key: bytes) -> np.ndarray:
    from .method import member_demos

    rows = training_rows(source, cfg, key)
    names, units = _names(rows)
    block = cfg.methods.dp_opt
    members = member_demos(_KeyedDraws(key, names), len(rows), SAMPLE_RATE, block.meta_prompts,
                           2 * block.demos, units)
    histogram = np.zeros(VOTE_BINS)
    for idx in members:
        if idx.size:
            demos = "\x1d".join(sorted(f"{rows.texts[i]}\x1e{rows.labels[i]}" for i in idx))
            histogram[int.from_bytes(hashlib.sha256(demos.encode()).digest()[:4], "big") % VOTE_BINS] += 1
    return histogram


@register_statistic("dp_opt_selection_counts", norm=np.inf)
def selection_counts(source, cfg, key: bytes) -> np.ndarray:
    from ..base import PrivateRows
    from .method import _unit_array
    from .text_prompts import per_unit_counts

    _, rows = split_rows(source, cfg, key)
    texts, labels, units = rows.holdout
    holdout = PrivateRows(texts, labels, units=units)
    candidates = 3
    return per_unit_counts(np.ones((candidates, len(holdout))), _unit_array(cfg, holdout))
