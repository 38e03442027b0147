"""What every part of the ledger shares: the SQL helper ``_q``, times, names of the machine and user,
and the composition of stored events by the accountant (``privacy.accountant``: no SQL there)."""

from __future__ import annotations

import dataclasses
import functools
import getpass
import math
import os
import socket
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from .. import events as ev
from ..accountant import PrivacySpend, spend, spend_by
from ..accountants import DEFAULT_ACCOUNTANT

# Relative slack when comparing a committed ε with the reserved one (the accountant is
# deterministic; this only absorbs float noise).
_EPS_RTOL = 1e-9
EXPORT_FORMAT = "privprompt-ledger"
_TABLES = ("datasets", "entries", "cap_changes", "trail")


def _q(conn: sa.Connection, sql: str, params: tuple = ()):
    """Run ``sql`` with ``?`` placeholders bound to ``params`` in order; rows as mappings."""
    parts = sql.split("?")
    if len(parts) - 1 != len(params):
        raise AssertionError(f"{len(parts) - 1} placeholders, {len(params)} parameters: {sql}")
    named = parts[0] + "".join(f":p{i}{part}" for i, part in enumerate(parts[1:]))
    return conn.execute(sa.text(named), {f"p{i}": v for i, v in enumerate(params)}).mappings()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _host() -> str:
    return socket.gethostname() or "unknown"


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER: the numeric id
        return f"uid {os.getuid()}"


def _short(fingerprint: str, n: int = 12) -> str:
    return fingerprint if len(fingerprint) <= n else fingerprint[:n] + "…"


def _check_text(value, name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        kind = "a string" if allow_empty else "a non-empty string"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def _event_json(event, name: str = "event") -> str:
    try:
        return ev.event_to_json(event)
    except TypeError as exc:
        raise ValueError(f"{name} must be a privacy event (privacy.events), got {event!r}") from exc


def _counted_event_json(row: Any) -> str | None:
    """The event an entry counts with: committed if committed, reserved if reserved, else none
    (aborted and released entries cost nothing)."""
    if row["kind"] != "dp" or row["status"] in ("aborted", "released"):
        return None
    if row["status"] == "committed":
        return row["committed_event"]
    return row["reserved_event"]


@functools.lru_cache(maxsize=4096)
def _counted(text: str) -> ev.DpEvent:
    """A stored event as the ledger counts it: one recorded before runs marked their sizes release
    as adaptive (:class:`privacy.events.AdaptiveEvent`) has that release — the first Gaussian of
    its composition, into each parallel branch — split off, as a new run's is. Splitting any part
    off a composition is basic composition, valid whichever part it is, so this never under-counts."""
    event = ev.event_from_json(text)
    if ev.holds_adaptive(event):
        return event
    peeled = _peel(event)
    return event if peeled is None else ev.AdaptiveEvent(*peeled)


def _peel(event: ev.DpEvent) -> tuple[ev.DpEvent, ev.DpEvent] | None:
    """(the first Gaussian release, the rest) of a legacy run's event, None when it has none."""
    def joined(parts):
        return parts[0] if len(parts) == 1 else ev.ComposedEvent(tuple(parts))

    if isinstance(event, ev.ComposedEvent) and len(event.events) >= 2:
        head, others = event.events[0], list(event.events[1:])
        if isinstance(head, ev.GaussianEvent):
            return head, joined(others)
        inner = _peel(head)
        return None if inner is None else (inner[0], joined([inner[1]] + others))
    if isinstance(event, ev.ParallelEvent):
        branches = [_peel(b) for b in event.events]
        if all(b is not None for b in branches) and len({b[0] for b in branches}) == 1:
            return branches[0][0], ev.ParallelEvent(tuple(b[1] for b in branches))
    return None


def _compose(event_jsons: list[str], delta: float) -> PrivacySpend:
    events = tuple(_counted(text) for text in event_jsons)
    return spend(ev.ComposedEvent(events), delta)


def _built_in_accountants() -> bool:
    """The default and the RDP accountant are the built-in ones (a plugin may replace either by
    name: ``register_accountant(..., force=True)``), whose answers the bound compares."""
    from .. import accountants

    return (DEFAULT_ACCOUNTANT == "min_pld_rdp" and accountants._ACCOUNTANTS.get("min_pld_rdp") is accountants.MinPldRdp
            and accountants._ACCOUNTANTS.get("rdp") is accountants.RdpAccountant)


def _bound(event_jsons: list[str], delta: float) -> float | None:
    """An upper bound on ``_compose(event_jsons, delta).epsilon`` that costs a sum of cached RDP
    curves instead of a PLD composition: the RDP accountant's ε of the same composition (with the
    same adaptive split). The default accountant answers min(PLD, RDP) wherever the RDP curve is
    proven and PLD alone where it is not (``accountants.MinPldRdp``), so where this is finite the
    ledger's ε is never above it. None where RDP proves nothing (the exact composition decides)."""
    if not _built_in_accountants():  # the bound holds for those two accountants' answers only
        return None
    events = tuple(_counted(text) for text in event_jsons)
    epsilon = spend_by("rdp", ev.ComposedEvent(events), delta).epsilon
    return epsilon if math.isfinite(epsilon) else None


def _held(s: PrivacySpend, floor: float) -> PrivacySpend:
    """``s`` (the composition at the dataset's δ) held at ``floor``, the largest ε the dataset was
    recorded as having spent when its δ changed (:meth:`Ledger._delta_floor`): a δ change never
    lowers what the ledger says a dataset has spent."""
    if not floor > s.epsilon:
        return s
    return dataclasses.replace(s, epsilon=float(floor),
                               accountant=f"{s.accountant}, held at the ε spent before a δ change")


def _preview(existing: list[str], events: list[ev.DpEvent], delta: float, cap: float, name: str,
             floor: float = 0.0) -> dict:
    planned = [_event_json(e) for e in events]
    spent_eps = max(floor, _compose(existing, delta).epsilon)
    total = max(floor, _compose(existing + planned, delta).epsilon)
    return {"name": name, "cap": cap, "delta": delta, "spent_epsilon": spent_eps,
            "planned_epsilon": [_compose([p], delta).epsilon for p in planned], "total_epsilon": total,
            "remaining_after": cap - total, "fits": bool(total <= cap)}


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.4f}"
