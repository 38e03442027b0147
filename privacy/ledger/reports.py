"""What the ledger says: the audit trail, each dataset's composed spent ε and counts, each entry, and
the plain-text summary of ``privprompt ledger``."""

from __future__ import annotations

import json
from typing import Any

from ..accountant import PrivacySpend
from .base import LedgerBase
from .common import _counted_event_json, _fmt, _q, _short


class ReportsMixin(LedgerBase):
    """Reads only: :meth:`trail`, :meth:`spent`, :meth:`entries`, :meth:`datasets`, :meth:`summary_table`."""

    def trail(self, fingerprint: str | None = None, run_id: str | None = None) -> list[dict[str, Any]]:
        """The audit trail, oldest first (of one dataset and/or run): every change to the ledger with
        its time, action, details, machine (``host``), OS user and process id."""
        clauses, params = [], []
        if fingerprint is not None:
            clauses.append("fingerprint = ?")
            params.append(fingerprint)
        if run_id is not None:
            clauses.append("run_id = ?")
            params.append(run_id)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._read() as conn:
            rows = _q(conn, f"SELECT * FROM trail{where} ORDER BY id", tuple(params)).fetchall()
        return [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]

    def spent(self, fingerprint: str) -> PrivacySpend:
        """Composed spend of all reserved and committed DP entries at the dataset's δ."""
        with self._read() as conn:
            return self._spent_in(conn, fingerprint)[1]

    def remaining(self, fingerprint: str) -> float:
        """ε_cap − spent ε, never below 0."""
        with self._read() as conn:
            ds, s = self._spent_in(conn, fingerprint)
        return max(0.0, ds["epsilon_cap"] - s.epsilon)

    @staticmethod
    def _entry_dict(row: Any, name: str) -> dict[str, Any]:
        counted = _counted_event_json(row)
        if row["kind"] != "dp":
            epsilon = None  # no DP guarantee
        elif row["status"] in ("aborted", "released"):
            epsilon = 0.0
        elif row["status"] == "committed":
            epsilon = row["epsilon_committed"]
        else:
            epsilon = row["epsilon_reserved"]
        shown = counted or row["reserved_event"]
        return {
            "run_id": row["run_id"],
            "fingerprint": row["fingerprint"],
            "dataset": name,
            "kind": row["kind"],
            "status": row["status"],
            "epsilon": epsilon,
            "epsilon_reserved": row["epsilon_reserved"],
            "epsilon_committed": row["epsilon_committed"],
            "over_reservation": bool(row["over_reservation"]),
            "event": json.loads(shown) if shown else None,
            "reserved_event": json.loads(row["reserved_event"]) if row["reserved_event"] else None,
            "committed_event": json.loads(row["committed_event"]) if row["committed_event"] else None,
            "description": row["description"],
            "abort_reason": row["abort_reason"],
            "created_at": row["created_at"],
            "committed_at": row["committed_at"],
            "aborted_at": row["aborted_at"],
            "read_started_at": row["read_started_at"],
            "released_at": row["released_at"],
            "release_reason": row["release_reason"],
        }

    def _entry_dict_for(self, run_id: str) -> dict[str, Any]:
        with self._read() as conn:
            row = self._entry_row(conn, run_id)
            name = self._dataset_row(conn, row["fingerprint"])["name"]
        return self._entry_dict(row, name)

    def entry(self, run_id: str) -> dict[str, Any]:
        """One entry, as in :meth:`entries`."""
        return self._entry_dict_for(run_id)

    def entries(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """All entries (of one dataset, or all), oldest first.

        ``epsilon`` is what the entry costs alone at its dataset's δ: the committed ε if
        committed, the reserved ε if reserved, 0 if aborted, ``None`` for non-private uses
        (no guarantee). ``event`` is the event it is composed with (JSON dict).
        """
        with self._read() as conn:
            names = {r["fingerprint"]: r["name"] for r in _q(conn, "SELECT fingerprint, name FROM datasets")}
            if fingerprint is None:
                rows = _q(conn, "SELECT * FROM entries ORDER BY id").fetchall()
            else:
                self._dataset_row(conn, fingerprint)
                rows = _q(conn, "SELECT * FROM entries WHERE fingerprint = ? ORDER BY id",
                                    (fingerprint,)).fetchall()
        return [self._entry_dict(r, names[r["fingerprint"]]) for r in rows]

    def _dataset_dicts(self, fingerprint: str | None) -> list[dict[str, Any]]:
        with self._read() as conn:
            if fingerprint is None:
                rows = _q(conn, "SELECT * FROM datasets ORDER BY created_at, fingerprint").fetchall()
            else:
                rows = [self._dataset_row(conn, fingerprint)]
            known = {r["fingerprint"] for r in _q(conn, "SELECT fingerprint FROM record_sets")}
            out = []
            for ds in rows:
                fp = ds["fingerprint"]
                s = self._spent_in(conn, fp)[1]
                counts = {(r["kind"], r["status"]): r["n"] for r in _q(conn,
                    "SELECT kind, status, COUNT(*) AS n FROM entries WHERE fingerprint = ? GROUP BY kind, status",
                    (fp,))}
                releases = [json.loads(r["committed_event"])["eta"] for r in _q(conn,
                    "SELECT committed_event FROM entries WHERE fingerprint = ? AND kind = 'ldp' "
                    "AND committed_event IS NOT NULL", (fp,))]
                out.append({
                    "fingerprint": fp,
                    "name": ds["name"],
                    "epsilon_cap": ds["epsilon_cap"],
                    "delta": ds["delta"],
                    "unit": ds["unit"],  # the privacy unit the cap and every charge are stated for
                    "spent_epsilon": s.epsilon,
                    "remaining_epsilon": max(0.0, ds["epsilon_cap"] - s.epsilon),
                    "reserved_runs": counts.get(("dp", "reserved"), 0),
                    "committed_runs": counts.get(("dp", "committed"), 0),
                    "aborted_runs": counts.get(("dp", "aborted"), 0),
                    "released_runs": counts.get(("dp", "released"), 0),
                    "nonprivate_uses": counts.get(("nonprivate", "committed"), 0),
                    "ldp_uses": counts.get(("ldp", "committed"), 0) - len(releases),
                    "ldp_releases": len(releases),
                    "ldp_eta_bound": float(sum(releases)) if releases else None,
                    "records_known": fp in known,  # its keyed record digests are kept (schema 5)
                    "created_at": ds["created_at"],
                    "updated_at": ds["updated_at"],
                })
        return out

    def dataset(self, fingerprint: str) -> dict[str, Any]:
        """One dataset, as in :meth:`datasets`."""
        return self._dataset_dicts(fingerprint)[0]

    def datasets(self) -> list[dict[str, Any]]:
        """Every registered dataset with its cap, δ, composed spent ε, remaining ε and run counts
        (``nonprivate_uses``: uses without any DP guarantee; ``ldp_uses``: runs on locally
        privatised inputs, ``ldp_releases`` the d_X draws they released and ``ldp_eta_bound`` the
        composed η of a record in all of them, None when none was recorded)."""
        return self._dataset_dicts(None)

    def summary_table(self, largest: dict[str, str] | None = None) -> str:
        """Plain-text summary (for ``privprompt ledger``): one line per dataset, what its columns
        mean, then every non-private use, which carries no DP guarantee and is not part of the ε
        column. ``largest``: fingerprint → a line saying the largest target ε of a config that
        still fits (computed by the caller, which knows the config)."""
        datasets = self.datasets()
        out = self._summary_grid(datasets)
        if datasets:
            out += ["",
                    "unit: what every ε of the dataset protects (record, or the field naming a person: ε per person);",
                    "eps_spent: the composed ε (accountant, at the dataset's δ) of every committed and reserved DP run;",
                    "  eps_left = eps_cap − eps_spent is no bound on one run's ε: ε composes sub-additively",
                    "  (privprompt plan CONFIG / privprompt ledger --config CONFIG: the largest target_epsilon that fits).",
                    "Counts of DP runs: reserved = holding a reservation (running, or stopped after reading private",
                    "  data: counted in full; privprompt budget reservations), committed = finished (their actual ε",
                    "  counts), released = failed before reading any private record (cost nothing), aborted = cancelled",
                    "  before any private read (cost nothing). local-DP / non-private: uses without an (ε, δ) claim."]
        for d in datasets:
            if not d["records_known"]:
                out.append(f"{d['name']} ({_short(d['fingerprint'])}): its records are not known yet (registered before the "
                           "ledger kept record digests, or without them): its next run on the same files keeps them; "
                           "until then a copy of its records in another export is not recognised")
        for d in datasets:
            if largest and d["fingerprint"] in largest:
                out.append(f"{d['name']} ({_short(d['fingerprint'])}): {largest[d['fingerprint']]}")
        out.append("")
        out += self._summary_uses(datasets, self.entries())
        return "\n".join(out) + "\n"

    def _summary_grid(self, datasets: list[dict[str, Any]]) -> list[str]:
        """The title and one aligned line per dataset."""
        header = ("dataset", "fingerprint", "unit", "delta", "eps_cap", "eps_spent", "eps_left",
                  "reserved", "committed", "released", "aborted", "local-DP", "non-private")
        rows = [(d["name"], _short(d["fingerprint"]), d["unit"] or "record", f"{d['delta']:g}",
                 _fmt(d["epsilon_cap"]),
                 _fmt(d["spent_epsilon"]), _fmt(d["remaining_epsilon"]), str(d["reserved_runs"]),
                 str(d["committed_runs"]), str(d["released_runs"]), str(d["aborted_runs"]), str(d["ldp_uses"]),
                 str(d["nonprivate_uses"]))
                for d in datasets]
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

        def line(cells):
            return "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        out = [f"privacy ledger {self.location}", line(header), line(["-" * w for w in widths])]
        return out + ([line(r) for r in rows] if rows else ["(no datasets registered)"])

    @staticmethod
    def _summary_uses(datasets: list[dict[str, Any]], entries: list[dict[str, Any]]) -> list[str]:
        """The local-DP releases and uses, and every non-private use (no DP guarantee)."""
        out = []
        ldp = [e for e in entries if e["kind"] == "ldp"]
        nonprivate = [e for e in entries if e["kind"] == "nonprivate"]
        for d in datasets:
            if d["ldp_releases"]:
                out.append(f"local-DP releases of {d['name']} ({_short(d['fingerprint'])}): {d['ldp_releases']} d_X "
                           f"draws; a record in all of them is private at η ≤ {d['ldp_eta_bound']:g} (η adds up)")
        if ldp:
            out.append(f"local-DP uses ({len(ldp)}; inputs privatised locally (d_X), no (ε, δ) claim):")
            for e in ldp:
                out.append(f"  {e['dataset']} ({_short(e['fingerprint'])})  run {e['run_id']}  "
                           f"{e['created_at']}  {e['description']}")
        if nonprivate:
            out.append(f"non-private uses ({len(nonprivate)}; no DP guarantee, not composed into eps):")
            for e in nonprivate:
                out.append(f"  {e['dataset']} ({_short(e['fingerprint'])})  run {e['run_id']}  "
                           f"{e['created_at']}  {e['description']}")
        else:
            out.append("non-private uses: none")
        return out
