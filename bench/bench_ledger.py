"""Ledger throughput under concurrent runs: P processes reserve and commit small runs on one
dataset of one ledger (SQLite file, or a throwaway PostgreSQL cluster on localhost), as a team's
workers would. Prints reservations per second, the latency of a reservation (p50 / p99) and of a
commit, and checks the result: every run charged exactly once (no lost, no double entry), and the
dataset's composed spend equal to an independent recomputation with dp-accounting's own PLD
accountant (``dp_accounting.pld.PLDAccountant`` on ``GaussianDpEvent``s).

    .venv/bin/python bench/bench_ledger.py                      # SQLite and PostgreSQL, 8 x 25 runs
    .venv/bin/python bench/bench_ledger.py --backend sqlite --procs 8 --runs 50

Each run's event is one Gaussian release (σ = --sigma; with --distinct each run's own σ, as real runs
differ): a small run, planned before the clock starts (its ε alone, which a run's plan computes
before it reserves). The goal of the issue
"Spend the whole budget": ≥ 100 reservations per second on SQLite.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FP = "be" + "7" * 62
DELTA = 1e-5


def _sigma(sigma: float, distinct: bool, index: int, i: int, runs: int) -> float:
    """Run i of process index: σ, or with ``distinct`` a σ of its own (as real runs differ), within 2 %."""
    return sigma * (1.0 + 0.02 * (index * runs + i) / (8 * runs)) if distinct else sigma


def _worker(url: str, index: int, runs: int, sigma: float, distinct: bool, barrier, results) -> None:
    from privacy import events as ev
    from privacy.ledger import Ledger

    from privacy.accountant import spend

    led = Ledger(url)
    events = [ev.GaussianEvent(_sigma(sigma, distinct, index, i, runs)) for i in range(runs)]
    for event in set(events):  # planned first, as a run is: its ε alone (the plan's, before any reservation)
        spend(ev.ComposedEvent((event,)), DELTA)
    reserve_s, commit_s, errors = [], [], []
    barrier.wait(timeout=300)
    for i, event in enumerate(events):
        run_id = f"bench-{index}-{i}"
        try:
            t = time.perf_counter()
            led.reserve(FP, run_id, event, description="bench")
            reserve_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            led.commit(run_id, event)
            commit_s.append(time.perf_counter() - t)
        except Exception as exc:  # noqa: BLE001 - counted and printed by the parent
            errors.append(f"{run_id}: {exc!r}")
    results.put({"reserve": reserve_s, "commit": commit_s, "errors": errors})


def _independent_epsilon(sigmas: list[float]) -> float:
    """ε at δ of Gaussian releases of these σ by dp-accounting's PLD accountant alone (no code of ours)."""
    import collections

    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    # the grid the project's accountant uses for Gaussian-only compositions (privacy/pld.py)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=2e-4)
    for sigma, count in collections.Counter(sigmas).items():
        accountant.compose(dp_accounting.GaussianDpEvent(sigma), count)
    return accountant.get_epsilon(DELTA)


def run(url: str, procs: int, runs: int, sigma: float, distinct: bool = False, cap: float = 1e6) -> dict:
    from privacy.ledger import Ledger

    led = Ledger(url)
    led.register_dataset(FP, "bench", cap, DELTA)  # by default a cap nothing reaches: every reservation is admitted
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(url, i, runs, sigma, distinct, barrier, results)) for i in range(procs)]
    for p in workers:
        p.start()
    barrier.wait(timeout=300)
    t0 = time.perf_counter()
    outs = [results.get(timeout=1800) for _ in workers]
    wall = time.perf_counter() - t0
    for p in workers:
        p.join(timeout=60)
    reserve = sorted(x for o in outs for x in o["reserve"])
    commit = sorted(x for o in outs for x in o["commit"])
    errors = [e for o in outs for e in o["errors"]]
    entries = led.entries(FP)
    ids = [e["run_id"] for e in entries]
    expected = {f"bench-{i}-{j}" for i in range(procs) for j in range(runs)}
    spent = led.spent(FP).epsilon
    independent = _independent_epsilon([e["event"]["noise_multiplier"] for e in entries])

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {"runs": procs * runs, "wall_s": wall, "per_s": len(reserve) / wall,
            "reserve_p50_ms": 1e3 * statistics.median(reserve) if reserve else float("nan"),
            "reserve_p99_ms": 1e3 * pct(reserve, 0.99), "commit_p50_ms": 1e3 * statistics.median(commit) if commit else float("nan"),
            "commit_p99_ms": 1e3 * pct(commit, 0.99), "errors": errors,
            "lost": len(expected - set(ids)), "double": len(ids) - len(set(ids)),
            "uncommitted": sum(e["status"] != "committed" for e in entries),
            "spent": spent, "independent": independent,
            "on_bound": sum("spent_epsilon_at_most" in t["detail"] for t in led.trail(FP) if t["action"] == "reserve")}


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if found:
        return Path(found[-1])
    which = shutil.which("initdb")
    return Path(which).parent if which else None


class _Postgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (as scripts/team_servers.sh starts one)."""

    def __init__(self):
        self.bin = _pg_bin()
        if self.bin is None:
            raise RuntimeError("PostgreSQL binaries are absent (apt-get install postgresql)")
        self.run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.data = Path(tempfile.mkdtemp(prefix="privprompt-bench-pg-", dir="/var/tmp"))
        if self.run_as:
            shutil.chown(self.data, "postgres")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._pg("initdb", "-D", str(self.data / "db"), "-U", "privprompt", "--auth=trust")
        self._pg("pg_ctl", "-D", str(self.data / "db"), "-l", str(self.data / "db" / "log"), "-w", "-o",
                 f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1 -c max_connections=200", "start")

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run([*self.run_as, str(self.bin / tool), *args], check=True, capture_output=True)

    def database(self) -> str:
        name = f"ledger_{uuid.uuid4().hex[:10]}"
        self._pg("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "privprompt", name)
        return f"postgresql://privprompt@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data / "db"), "-m", "fast", "stop")
        shutil.rmtree(self.data, ignore_errors=True)


def _report(name: str, r: dict) -> None:
    # one composition of 200 PLDs in order against dp-accounting's self-composition: rounding apart
    rel = abs(r["spent"] - r["independent"]) / r["independent"]
    exact = rel <= 1e-5
    print(f"{name}: {r['runs']} runs by {args.procs} processes in {r['wall_s']:.1f} s: "
          f"{r['per_s']:.1f} reservations/s (each with its commit); reserve p50 {r['reserve_p50_ms']:.1f} ms, "
          f"p99 {r['reserve_p99_ms']:.1f} ms; commit p50 {r['commit_p50_ms']:.1f} ms, p99 {r['commit_p99_ms']:.1f} ms")
    print(f"{name}: lost {r['lost']}, double {r['double']}, uncommitted {r['uncommitted']}, errors {len(r['errors'])}; "
          f"composed spend ε = {r['spent']:.6f}, dp-accounting alone ε = {r['independent']:.6f} "
          f"(relative difference {rel:.1e}: {'equal' if exact else 'DIFFERENT'}); ratio reservations/s to the goal of 100: {r['per_s'] / 100:.2f}")
    print(f"{name}: {r['on_bound']} of {r['runs']} reservations admitted on the RDP bound, the others on the exact composition")
    for e in r["errors"][:5]:
        print(f"  error: {e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--runs", type=int, default=25, help="runs per process")
    ap.add_argument("--sigma", type=float, default=20.0, help="each run's Gaussian σ (a small run)")
    ap.add_argument("--distinct", action="store_true", help="every run a σ of its own (within 2 %%), as real runs differ")
    ap.add_argument("--cap", type=float, default=1e6, help="the dataset's ε cap (default: one nothing reaches)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="privprompt-bench-ledger-") as tmp:
        if args.backend in ("sqlite", "both"):
            _report("sqlite", run(f"sqlite:///{Path(tmp) / 'ledger.sqlite'}", args.procs, args.runs, args.sigma,
                                     args.distinct, args.cap))
        if args.backend in ("postgres", "both"):
            pg = _Postgres()
            try:
                _report("postgres", run(pg.database(), args.procs, args.runs, args.sigma, args.distinct, args.cap))
            finally:
                pg.stop()
