"""A secret keyed-hash partition of private rows into disjoint subsets (dp_fewshot's per label,
DP-ICL's over all rows): each row goes to one subset by HMAC-SHA256 of (label, text) under a key drawn from the run's secret DP stream (never from the
logged seed, which would let anyone recompute the partition). A row's subset and its rank within
the subset depend on that row alone, so adding or removing one record changes exactly one subset
(it may push another row past the subset's cap of N: still that one subset)."""

from __future__ import annotations

import hashlib
import hmac


def _digest(key: bytes, label: str, text: str) -> bytes:
    return hmac.new(key, f"{label}\x00{text}".encode("utf-8"), hashlib.sha256).digest()


def keyed_subsets(texts: list[str], labels: list[str], label: str | None, key: bytes, subsets: int,
                  cap: int) -> list[list[int]]:
    """Row indices of ``label``'s rows (None: every row) in ``subsets`` disjoint subsets (some may
    be empty), each its first ``cap`` rows in keyed-hash order."""
    if len(key) < 16:
        raise ValueError("keyed_subsets: the key must have at least 128 secret bits")
    ranked: list[list[tuple[bytes, int]]] = [[] for _ in range(subsets)]
    for i, (text, y) in enumerate(zip(texts, labels)):
        if label is not None and y != label:
            continue
        d = _digest(key, y, text)
        ranked[int.from_bytes(d[:8], "big") % subsets].append((d[8:], i))
    return [[i for _, i in sorted(rows)[:cap]] for rows in ranked]
