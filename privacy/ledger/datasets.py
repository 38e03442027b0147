"""Datasets and their terms: registration with a cap (ε_cap, δ) and a privacy unit, recorded cap and
δ changes (a δ change never lowers what a dataset has spent; a raise is the explicit, recorded step
only), the migration that puts back δ raises made without that step, and the unit and δ checks a
run passes before it is charged."""

from __future__ import annotations

import json
import math
from typing import Any

import sqlalchemy as sa

from ..validation import check_delta, check_epsilon
from .base import LedgerBase
from .common import _check_text, _compose, _fmt, _held, _now, _q, _short
from .errors import DeltaMismatchError, UnitMismatchError, UnknownDatasetError, unit_mismatch_message


class DatasetsMixin(LedgerBase):
    def register_dataset(self, fingerprint: str, name: str, epsilon_cap: float, delta: float,
                         allow_cap_change: bool = False, unit: str = "record") -> dict[str, Any]:
        """Register a dataset with its budget cap (ε_cap, δ); returns its ``datasets()`` row.

        Re-registering with the same name, cap and δ is a no-op. Different values raise
        ``ValueError`` unless ``allow_cap_change=True``, which applies them and records the change
        (old and new values, the ε spent at the time) in the ``cap_changes`` table. Caps should
        only ever be *lowered*: raising a cap — or δ, which weakens what the same cap guarantees —
        after runs have spent against it is a policy decision, which is why this explicit call is
        the one way to do it and every change is kept in the record. Lowering a cap below what is
        already spent is allowed; the dataset then has no budget left. A δ change never lowers what
        the dataset has spent (:meth:`change_delta`). ``unit``: the privacy unit the cap is stated
        for (``record``, or the field naming a person); a registered dataset's unit is never changed
        here (:class:`UnitMismatchError`; :meth:`change_unit` while nothing is charged).
        """
        _check_text(fingerprint, "fingerprint")
        _check_text(name, "name")
        _check_text(unit, "unit")
        epsilon_cap = check_epsilon(epsilon_cap, "epsilon_cap")
        delta = check_delta(delta, "delta")
        if not isinstance(allow_cap_change, bool):
            raise ValueError(f"allow_cap_change must be a bool, got {allow_cap_change!r}")
        with self._write() as conn:
            row = _q(conn, "SELECT * FROM datasets WHERE fingerprint = ?", (fingerprint,)).fetchone()
            now = _now()
            if row is None:
                _q(conn,
                    "INSERT INTO datasets (fingerprint, name, epsilon_cap, delta, created_at, updated_at, unit)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)", (fingerprint, name, epsilon_cap, delta, now, now, unit))
                self._trail(conn, "register", fingerprint, name=name, epsilon_cap=epsilon_cap, delta=delta,
                            **({"unit": unit} if unit != "record" else {}))
            else:
                if row["unit"] != unit:
                    raise UnitMismatchError(unit_mismatch_message(row["name"], fingerprint, row["unit"], unit))
                same = (row["name"] == name
                        and math.isclose(row["epsilon_cap"], epsilon_cap, rel_tol=1e-12, abs_tol=0.0)
                        and math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0.0))
                if not same:
                    if not allow_cap_change:
                        raise ValueError(
                            f"dataset {row['name']!r} (fingerprint {_short(fingerprint)}) is already "
                            f"registered with epsilon_cap={row['epsilon_cap']!r}, delta={row['delta']!r}; "
                            f"refusing to change it to name={name!r}, epsilon_cap={epsilon_cap!r}, "
                            f"delta={delta!r} (pass allow_cap_change=True to change it; the change is "
                            "recorded, and caps should only be lowered)")
                    self._change(conn, row, name, epsilon_cap, delta, None, allow_raise=True)
        return self.dataset(fingerprint)

    def _change(self, conn: sa.Connection, row: Any, name: str, epsilon_cap: float, delta: float,
                reason: str | None, allow_raise: bool = False, undoing_raise: bool = False) -> None:
        """Apply a change of a dataset's name / cap / δ and record it (old and new values, the ε
        spent at the time, the reason) in ``cap_changes``.

        A δ change never lowers what the ledger says the dataset has spent: the ε spent at the old
        δ is kept in ``cap_changes.spent_epsilon_at_change`` and holds the dataset's spent ε from
        below from then on (:meth:`_delta_floor`), and each entry's ε becomes the larger of what it
        was charged and its ε at the new δ. A δ change is refused while a reservation is open (its
        run was planned at the old δ). A larger δ — under which the same events cost less ε, i.e. a
        raise of the budget — is refused unless ``allow_raise`` (the explicit step of a cap raise),
        and even then when the dataset's records are known and δ ≥ 1/n for them.
        ``undoing_raise``: the migration putting back a δ that an unrecorded raise enlarged
        (:meth:`_undo_unrecorded_delta_raises`): a lowering, made with reservations open too (they
        are then composed at the smaller δ, i.e. counted higher), and marked so in the trail."""
        fingerprint, now = row["fingerprint"], _now()
        spent_eps = _held(_compose(self._counted_events(conn, fingerprint), row["delta"]),
                          self._delta_floor(conn, fingerprint)).epsilon
        delta_changes = not math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0.0)
        raised = delta_changes and delta > row["delta"]
        if delta_changes and not undoing_raise:
            self._refuse_delta_change_while_open(conn, row)
        if raised:
            self._refuse_delta_raise(conn, row, delta, spent_eps, allow_raise)
        _q(conn,
            "INSERT INTO cap_changes (fingerprint, old_name, old_cap, old_delta, new_name,"
            " new_cap, new_delta, spent_epsilon_at_change, changed_at, reason)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (fingerprint, row["name"], row["epsilon_cap"], row["delta"], name, epsilon_cap,
             delta, spent_eps, now, reason))
        self._trail(conn, "cap_change", fingerprint, old_name=row["name"], old_cap=row["epsilon_cap"],
                    old_delta=row["delta"], new_name=name, new_cap=epsilon_cap, new_delta=delta,
                    spent_epsilon=spent_eps, reason=reason, **({"delta_raised": True} if raised else {}),
                    **({"undoes_unrecorded_delta_raise": True} if undoing_raise else {}))
        _q(conn,
            "UPDATE datasets SET name = ?, epsilon_cap = ?, delta = ?, updated_at = ?"
            " WHERE fingerprint = ?", (name, epsilon_cap, delta, now, fingerprint))
        if delta_changes:
            self._restate_entries_at(conn, fingerprint, delta)

    @staticmethod
    def _refuse_delta_change_while_open(conn: sa.Connection, row: Any) -> None:
        """A δ change waits until no reservation is open: their runs were planned at the old δ."""
        open_runs = [r["run_id"] for r in _q(conn,
            "SELECT run_id FROM entries WHERE fingerprint = ? AND kind = 'dp' AND status = 'reserved'",
            (row["fingerprint"],))]
        if open_runs:
            raise ValueError(f"dataset {row['name']!r} (fingerprint {_short(row['fingerprint'])}) has "
                             f"{len(open_runs)} open reservation(s) ({', '.join(open_runs)}) "
                             f"planned at δ={row['delta']:g}: change δ when none is open")

    def _refuse_delta_raise(self, conn: sa.Connection, row: Any, delta: float, spent_eps: float,
                            allow_raise: bool) -> None:
        """A larger δ is a budget raise: refused but for the explicit step, and always at δ ≥ 1/n."""
        where = f"dataset {row['name']!r} (fingerprint {_short(row['fingerprint'])})"
        if not allow_raise:
            raise ValueError(
                f"δ={delta:g} is above {where}'s δ={row['delta']:g}: a larger δ lets the same runs cost less ε, "
                f"so it raises the budget its cap ε={row['epsilon_cap']:g} states, and like a cap raise it is "
                f"refused here (its spent ε={_fmt(spent_eps)} stays spent either way); a raise is a policy "
                "decision made in code and recorded, as a cap raise is: Ledger.register_dataset(fingerprint, "
                "name, cap, delta, allow_cap_change=True)")
        n = self._record_count(conn, row["fingerprint"])
        if n is not None and delta >= 1.0 / n:  # n is not in the message (the rule of check_delta)
            raise ValueError(f"δ={delta:g} is >= 1/n for the n records {where} is known by: such a δ permits "
                             "releasing whole records; refused")

    @staticmethod
    def _restate_entries_at(conn: sa.Connection, fingerprint: str, delta: float) -> None:
        """Each dp entry's ε becomes the larger of what it was charged and its ε at the new δ."""
        for entry in _q(conn, "SELECT * FROM entries WHERE fingerprint = ? AND kind = 'dp'",
                        (fingerprint,)).fetchall():
            update = {}
            for column, event_column in (("epsilon_reserved", "reserved_event"),
                                         ("epsilon_committed", "committed_event")):
                if entry[event_column]:
                    at_new = _compose([entry[event_column]], delta).epsilon
                    update[column] = max(at_new, entry[column]) if entry[column] is not None else at_new
            if update:
                _q(conn, f"UPDATE entries SET {', '.join(f'{k} = ?' for k in update)} WHERE id = ?",
                   (*update.values(), entry["id"]))

    def _migrate_rows(self, conn: sa.Connection, version: int) -> None:
        """The row changes of a migration to the current schema (:meth:`Store.init_schema`)."""
        if version < 8:
            self._undo_unrecorded_delta_raises(conn, f"schema {version}")

    def _undo_unrecorded_delta_raises(self, conn: sa.Connection, origin: str) -> list[str]:
        """Put back every dataset whose ``cap_changes`` show a δ raise that the recorded raise step
        did not make (no ``cap_change`` trail row marked ``delta_raised`` for it: the ``set-delta`` /
        ``change_delta`` of schemas ≤ 6 raised δ with no such step) to the smallest δ it had before
        that raise. That is a lowering, always allowed: :meth:`_change` records it in ``cap_changes``
        and the trail (``undoes_unrecorded_delta_raise``), re-states each entry's ε at that δ, and
        the floor of every earlier δ change still holds its spent ε from below. Returns the
        fingerprints put back. ``origin``: what the rows came from (for the reason)."""
        recorded: dict[tuple, int] = {}
        for t in _q(conn, "SELECT fingerprint, detail FROM trail WHERE action = 'cap_change' ORDER BY id"):
            detail = json.loads(t["detail"])
            if detail.get("delta_raised"):
                k = (t["fingerprint"], float(detail["old_delta"]), float(detail["new_delta"]))
                recorded[k] = recorded.get(k, 0) + 1
        undone = []
        for ds in _q(conn, "SELECT * FROM datasets ORDER BY fingerprint").fetchall():
            fp, target, smallest = ds["fingerprint"], None, None
            for c in _q(conn, "SELECT * FROM cap_changes WHERE fingerprint = ? ORDER BY id", (fp,)).fetchall():
                old, new = float(c["old_delta"]), float(c["new_delta"])
                smallest = old if smallest is None else min(smallest, old)
                if new > old and not math.isclose(new, old, rel_tol=1e-12, abs_tol=0.0):
                    if recorded.get((fp, old, new), 0) > 0:
                        recorded[(fp, old, new)] -= 1
                    else:
                        target = smallest if target is None else min(target, smallest)
                smallest = min(smallest, new)
            if target is None or not ds["delta"] > target or math.isclose(ds["delta"], target, rel_tol=1e-12,
                                                                            abs_tol=0.0):
                continue
            self._change(conn, ds, ds["name"], ds["epsilon_cap"], target,
                         f"δ put back from {ds['delta']:g} to {target:g}, the smallest δ before a raise made without "
                         f"the recorded raise step (the set-delta of {origin}): a larger δ lets the same runs cost "
                         "less ε under the same cap", undoing_raise=True)
            undone.append(fp)
        return undone

    def lower_cap(self, fingerprint: str, epsilon_cap: float, reason: str) -> dict[str, Any]:
        """Lower the dataset's cap to ``epsilon_cap`` (recorded with ``reason``); raising is refused
        (a raise is a policy decision, made with ``register_dataset(..., allow_cap_change=True)``).
        Below what is spent, the dataset has no budget left. Returns its ``datasets()`` row."""
        _check_text(reason, "reason")
        epsilon_cap = check_epsilon(epsilon_cap, "epsilon_cap")
        with self._write() as conn:
            row = self._dataset_row(conn, fingerprint)
            if epsilon_cap > row["epsilon_cap"] * (1 + 1e-12):
                raise ValueError(f"ε cap {epsilon_cap:g} is above dataset {row['name']!r}'s cap ε={row['epsilon_cap']:g}: "
                                 "a cap is only lowered here")
            if epsilon_cap < row["epsilon_cap"]:
                self._change(conn, row, row["name"], epsilon_cap, row["delta"], reason)
        return self.dataset(fingerprint)

    def change_delta(self, fingerprint: str, delta: float, reason: str, allow_raise: bool = False
                     ) -> dict[str, Any]:
        """Compose the dataset at another δ from now on, deliberately, recorded with ``reason`` and
        the ε spent at the old δ. Refused while a reservation is open (its run was planned at the
        old δ). What the dataset has spent never drops: a smaller δ re-states every entry's ε at it
        (higher), and the spent ε at the old δ stays the floor of the dataset's spent ε. A larger δ
        raises the budget (the same events cost less ε under the same cap): refused unless
        ``allow_raise=True`` — the explicit, recorded step of a cap raise (as
        ``register_dataset(..., allow_cap_change=True)``) — and refused when δ ≥ 1/n for the
        dataset's known records. The cap stays."""
        _check_text(reason, "reason")
        delta = check_delta(delta, "delta")
        if not isinstance(allow_raise, bool):
            raise ValueError(f"allow_raise must be a bool, got {allow_raise!r}")
        with self._write() as conn:
            row = self._dataset_row(conn, fingerprint)
            if not math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0.0):
                self._change(conn, row, row["name"], row["epsilon_cap"], delta, reason, allow_raise=allow_raise)
        return self.dataset(fingerprint)

    def find_dataset(self, name_or_fingerprint: str) -> dict[str, Any]:
        """The one dataset whose fingerprint starts with, or whose name is, ``name_or_fingerprint``."""
        _check_text(name_or_fingerprint, "dataset")
        found = [d for d in self.datasets()
                 if d["fingerprint"].startswith(name_or_fingerprint) or d["name"] == name_or_fingerprint]
        if len(found) != 1:
            known = ", ".join(f"{d['name']} ({_short(d['fingerprint'])})" for d in self.datasets()) or "none"
            what = "no dataset" if not found else f"{len(found)} datasets"
            raise UnknownDatasetError(f"{what} named or with a fingerprint starting {name_or_fingerprint!r} in "
                                      f"ledger {self.location} (datasets: {known}); give a longer fingerprint prefix")
        return found[0]

    def cap_changes(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """Every recorded cap change (``register_dataset(..., allow_cap_change=True)``), oldest first."""
        with self._read() as conn:
            if fingerprint is None:
                rows = _q(conn, "SELECT * FROM cap_changes ORDER BY id").fetchall()
            else:
                self._dataset_row(conn, fingerprint)
                rows = _q(conn, "SELECT * FROM cap_changes WHERE fingerprint = ? ORDER BY id",
                                    (fingerprint,)).fetchall()
        return [{k: r[k] for k in r.keys() if k != "id"} for r in rows]

    def require_unit(self, fingerprint: str, unit: str) -> None:
        """Raise :class:`UnitMismatchError` when ``unit`` is not the dataset's privacy unit: its cap
        and every ε charged to it are stated for that unit. A record-level run on a dataset of a
        user unit is refused, not charged with a group-privacy bound: the number of records of the
        largest unit is a private statistic, and without a bound the group-privacy ε is unbounded (a
        run that bounds it — ``data.person_field`` with ``data.max_records_per_unit`` — comes here with
        the person's field as its unit and its group-privacy event: ``privacy.group``);
        so the ledger never under-counts a person."""
        row = self.dataset(fingerprint)
        if row["unit"] != unit:
            raise UnitMismatchError(unit_mismatch_message(row["name"], fingerprint, row["unit"], unit))

    def change_unit(self, fingerprint: str, unit: str, reason: str) -> dict[str, Any]:
        """Set the privacy unit of a dataset that nothing has been charged to yet (no dp entry in
        any status but released / aborted): its cap is then stated for ``unit``. Recorded in the
        trail with ``reason``. Refused once any ε is charged: that ε is stated for the old unit."""
        _check_text(unit, "unit")
        _check_text(reason, "reason")
        with self._write() as conn:
            row = self._dataset_row(conn, fingerprint)
            charged = _q(conn, "SELECT COUNT(*) AS n FROM entries WHERE fingerprint = ? AND kind = 'dp' "
                               "AND status IN ('reserved', 'committed')", (fingerprint,)).fetchone()["n"]
            if charged:
                raise ValueError(f"dataset {row['name']!r} (fingerprint {_short(fingerprint)}) has ε charged for its "
                                 f"privacy unit {row['unit']!r}: its unit is never changed after that")
            if row["unit"] != unit:
                _q(conn, "UPDATE datasets SET unit = ?, updated_at = ? WHERE fingerprint = ?", (unit, _now(), fingerprint))
                self._trail(conn, "unit_change", fingerprint, old_unit=row["unit"], new_unit=unit, reason=reason)
        return self.dataset(fingerprint)

    def require_delta(self, fingerprint: str, delta: float) -> None:
        """Raise :class:`DeltaMismatchError` when ``delta`` is not the dataset's δ: every entry of a
        dataset is composed at one δ, and a run planned at another would be mis-accounted."""
        row = self.dataset(fingerprint)
        if not math.isclose(row["delta"], delta, rel_tol=1e-9, abs_tol=0.0):
            raise DeltaMismatchError(
                f"this run's δ={delta:g} differs from δ={row['delta']:g} at which dataset {row['name']!r} "
                f"(fingerprint {_short(fingerprint)}) composes its budget; set privacy.target_delta: "
                f"{row['delta']:g} (or register the dataset anew with another δ deliberately)")

