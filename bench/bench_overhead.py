"""Where a small run's seconds go (issue 29): `privprompt run configs/smoke.yaml` with a timestamp
at every phase boundary, and the model work the CLI reports.

    .venv/bin/python bench/bench_overhead.py [--runs N] [--config configs/smoke.yaml] [--json OUT]
    .venv/bin/python bench/bench_overhead.py --child CONFIG   # one traced run (what each run spawns)
    .venv/bin/python bench/bench_overhead.py --worker [--runs N]  # in-process vs a warm `privprompt worker`

Each run is a fresh interpreter (``--child``); the first uses a fresh ``PRIVPROMPT_HOME`` (databases
created), the others the same one (warm: what a user's second run meets; ``--fresh-each`` for cold
runs only), and the median is over the warm ones. The parent measures
the subprocess wall (interpreter start to exit); the child wraps the CLI's phases (imports, config
and data checks, the checks before the reservation, the embedded Prefect server, the flow and its
tasks, server stop) with ``time.perf_counter`` stamps, taken relative to the interpreter's start
(``time.perf_counter`` at the first line of this file, plus the interpreter's own start-up read from
``-X importtime``-free ``python -c pass`` timing, reported separately). overhead = subprocess wall −
model work (the CLI's "s model work": the sum of each stage's compute seconds).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WALL_RE = re.compile(r"wall time:\s*([\d.]+) s \(([\d.]+) s model work")
STAMPS: list[tuple[str, float]] = []


def stamp(name: str) -> None:
    STAMPS.append((name, time.perf_counter() - T0))


def _wrap(module, attr: str, label: str) -> None:
    original = getattr(module, attr)

    def wrapped(*args, **kwargs):
        stamp(f"{label} start")
        try:
            return original(*args, **kwargs)
        finally:
            stamp(f"{label} end")

    setattr(module, attr, wrapped)


def child(config: str) -> int:
    """One traced `privprompt run CONFIG` in this process; stamps go to stderr as JSON."""
    sys.path.insert(0, str(REPO))
    stamp("interpreter up")
    import privprompt_cli
    import privprompt_commands.run

    stamp("privprompt_cli imported")
    import tasks.config as tconfig

    stamp("tasks.config imported")
    _wrap(privprompt_cli, "load_config", "load config") if hasattr(privprompt_cli, "load_config") else None
    _wrap(tconfig, "load_config", "load config")
    import tasks.lifecycle  # noqa: F401
    import tasks.preflight as preflight

    stamp("tasks.lifecycle imported")
    _wrap(preflight, "preflight", "preflight")
    server = privprompt_commands.run._local_prefect_server
    enter, exit_ = server.__enter__, server.__exit__

    def traced_enter(self):
        stamp("prefect server start")
        out = enter(self)
        stamp("prefect server up")
        return out

    def traced_exit(self, *exc):
        stamp("prefect server stop")
        out = exit_(self, *exc)
        stamp("prefect server stopped")
        return out

    server.__enter__, server.__exit__ = traced_enter, traced_exit
    run_flow = privprompt_commands.run._run_flow

    def traced_run_flow(cfg, config):
        stamp("flow call")
        import flows.method_flow  # noqa: F401

        stamp("flows.method_flow imported")
        import tasks.prefect_tasks as pt

        for name in ("partition_task", "prepare_task", "train_task", "evaluate_task", "loss_mia_task"):
            task = getattr(pt, name)
            fn = task.fn

            @functools.wraps(fn)  # Prefect binds parameters by the signature
            def timed(*a, _fn=fn, _n=name, **k):
                stamp(f"{_n} body start")
                try:
                    return _fn(*a, **k)
                finally:
                    stamp(f"{_n} body end")

            task.fn = timed
        out = run_flow(cfg, config)
        stamp("flow returned")
        return out

    privprompt_commands.run._run_flow = traced_run_flow
    import atexit

    # atexit runs last-registered first: this one before every handler registered during the run
    # (Prefect's, MLflow's, threads' joins), the one registered at the start after all of them
    atexit.register(lambda: print(f"EXIT atexit done {time.perf_counter() - T0:.3f}", file=sys.stderr, flush=True))
    rc = privprompt_cli.main(["run", config])
    stamp("cli returned")
    atexit.register(lambda: print(f"EXIT atexit start {time.perf_counter() - T0:.3f}", file=sys.stderr, flush=True))
    sys.stdout.flush()
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds: this process's, and its waited-for children's (the embedded Prefect server):
    # steadier than wall times on a shared, loaded machine
    print("CPU " + json.dumps({"main": own.ru_utime + own.ru_stime, "children": kids.ru_utime + kids.ru_stime}),
          file=sys.stderr, flush=True)
    print("STAMPS " + json.dumps(STAMPS), file=sys.stderr, flush=True)
    exit_now = getattr(privprompt_cli, "_exit_now", None)  # end as the console script does, where it can
    if exit_now is not None:
        exit_now(rc)
    return rc


def run_once(config: str, log_dir: Path, tag: str, home: str | None = None, repo: Path = REPO,
             extra_env: dict | None = None) -> dict:
    """One traced run of ``repo``'s code (another checkout: this file is copied into its bench/)."""
    home = home or tempfile.mkdtemp(prefix=f"privprompt-overhead-{tag}-")
    env = dict(os.environ, PRIVPROMPT_HOME=home, **(extra_env or {}))
    script = Path(__file__).resolve()
    if repo.resolve() != REPO:
        script = repo / "bench" / "bench_overhead_copy.py"
        script.write_bytes(Path(__file__).read_bytes())
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), "--child", config], cwd=str(repo), env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    (log_dir / f"{tag}.stdout").write_text(proc.stdout)
    (log_dir / f"{tag}.stderr").write_text(proc.stderr)
    out = {"tag": tag, "rc": proc.returncode, "wall_s": wall, "home": home}
    m = WALL_RE.search(proc.stdout)
    stamps = next((json.loads(line[7:]) for line in proc.stderr.splitlines() if line.startswith("STAMPS ")), None)
    if proc.returncode != 0 or m is None or stamps is None:
        out["error"] = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return out
    exits = dict(re.findall(r"^EXIT atexit (start|done) ([\d.]+)$", proc.stderr, re.M))
    if len(exits) == 2:  # the other handlers' time; the rest of the exit is the interpreter's teardown
        stamps += [["atexit handlers start", float(exits["start"])], ["atexit handlers done", float(exits["done"])]]
    out.update({"cli_wall_s": float(m.group(1)), "model_work_s": float(m.group(2)),
                "overhead_s": wall - float(m.group(2)), "stamps": stamps})
    cpu = next((json.loads(line[4:]) for line in proc.stderr.splitlines() if line.startswith("CPU ")), None)
    if cpu is not None:
        out.update({"cpu_main_s": cpu["main"], "cpu_children_s": cpu["children"]})
    return out


def interpreter_start() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - started


def phases(stamps: list) -> list[tuple[str, float]]:
    """Seconds between consecutive stamps (a phase may occur twice: the CLI's preflight and the flow's)."""
    out, prev = [], ("process start", 0.0)
    for name, t in stamps:
        out.append((f"{prev[0]} → {name}", t - prev[1]))
        prev = (name, t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default="configs/smoke.yaml")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fresh-each", action="store_true", help="a fresh PRIVPROMPT_HOME for every run")
    ap.add_argument("--home", default=None, help="this PRIVPROMPT_HOME (kept between calls: interleaved A/B runs)")
    ap.add_argument("--homes", default=None, metavar="A_HOME,B_HOME",
                    help="with --against: the two sides' state folders of an earlier comparison (warm: their first "
                         "run, not counted, is then a warm-up, not a cold start)")
    ap.add_argument("--against", default=None, help="a checkout of older code (e.g. `git worktree add /tmp/old REV`): "
                    "its runs and this code's alternate, each in a warm state folder of its own, and the ratio is printed")
    ap.add_argument("--worker", action="store_true", help="in-process runs (PRIVPROMPT_NO_WORKER=1) alternating with "
                    "runs handed to a warm `privprompt worker` of the same state folder; the ratio is printed")
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    if args.worker:
        return compare_worker(args.config, args.runs, args.json)
    if args.against:
        return compare(args.config, Path(args.against), args.runs, args.json,
                       args.homes.split(",") if args.homes else None)
    log_dir = Path(tempfile.mkdtemp(prefix="privprompt-overhead-logs-"))
    print(f"nproc={os.cpu_count()} loadavg={os.getloadavg()} logs: {log_dir}")
    results = {"loadavg_start": os.getloadavg(), "python_c_pass_s": interpreter_start(), "runs": []}
    home = args.home
    for i in range(args.runs):  # run 0 in a fresh state folder (cold: databases created), then warm reruns
        fresh = args.fresh_each or home is None or not Path(home).is_dir() or not any(Path(home).iterdir())
        if home:
            Path(home).mkdir(parents=True, exist_ok=True)
        r = run_once(args.config, log_dir, f"run{i}", None if args.fresh_each else home)
        home = r["home"]
        r["state"] = "fresh" if fresh else "warm (same state folder)"
        results["runs"].append(r)
        if "error" in r:
            print(f"run {i}: FAILED rc={r['rc']}: {r['error']}")
            continue
        print(f"\nrun {i} ({r['state']}): subprocess wall {r['wall_s']:.1f} s, model work {r['model_work_s']:.1f} s, "
              f"overhead {r['overhead_s']:.1f} s (CLI wall {r['cli_wall_s']:.1f} s)")
        for name, dt in phases(r["stamps"]):
            print(f"  {dt:7.2f} s  {name}")
        print(f"  {r['wall_s'] - r['stamps'][-1][1]:7.2f} s  cli returned → process exit (as the parent saw it)")
    ok = [r for r in results["runs"] if "error" not in r and (args.fresh_each or r["state"] != "fresh")] or \
        [r for r in results["runs"] if "error" not in r]
    if ok:
        results["median_wall_s"] = statistics.median(r["wall_s"] for r in ok)
        results["median_model_work_s"] = statistics.median(r["model_work_s"] for r in ok)
        results["median_overhead_s"] = statistics.median(r["overhead_s"] for r in ok)
        print(f"\nmedian over {len(ok)} {'warm ' if len(results['runs']) > 1 and not args.fresh_each else ''}runs: wall {results['median_wall_s']:.1f} s, model work "
              f"{results['median_model_work_s']:.1f} s, overhead {results['median_overhead_s']:.1f} s; "
              f"`python -c pass` {results['python_c_pass_s']:.2f} s")
    results["loadavg_end"] = os.getloadavg()
    print(f"loadavg at end: {results['loadavg_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


def compare(config: str, other: Path, runs: int, json_out: str | None, homes: list[str] | None = None) -> int:
    """Alternate runs of ``other``'s code (A) and this code (B) on one machine in one session, so
    both meet the same load: one cold run each first (not counted; a warm-up with ``homes``), then
    ``runs`` warm pairs. Prints the medians and the ratios A/B."""
    log_dir = Path(tempfile.mkdtemp(prefix="privprompt-overhead-ab-"))
    print(f"nproc={os.cpu_count()} loadavg={os.getloadavg()} logs: {log_dir}")
    homes = dict(zip("AB", homes)) if homes else {"A": None, "B": None}
    repos = {"A": other, "B": REPO}
    rows: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(runs + 1):
        for side in ("A", "B"):
            r = run_once(config, log_dir, f"{side}{i}", homes[side], repos[side])
            if "error" in r:
                print(f"{side} run {i}: FAILED rc={r['rc']}: {r['error']}")
                return 1
            homes[side] = r["home"]
            print(f"{side} run {i} ({'cold' if i == 0 else 'warm'}): wall {r['wall_s']:.1f} s, model work "
                  f"{r['model_work_s']:.1f} s, overhead {r['overhead_s']:.1f} s; CPU {r.get('cpu_main_s', 0):.1f} s "
                  f"(+ {r.get('cpu_children_s', 0):.1f} s server); loadavg {os.getloadavg()[0]:.1f}", flush=True)
            if i:
                rows[side].append(r)
    keys = ("wall_s", "model_work_s", "overhead_s", "cpu_main_s", "cpu_children_s")
    med = {side: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys} for side, rs in rows.items()}
    for side in ("A", "B"):
        print(f"{side} ({repos[side]}): median of {runs} warm runs: wall {med[side]['wall_s']:.1f} s, model work "
              f"{med[side]['model_work_s']:.1f} s, overhead {med[side]['overhead_s']:.1f} s, CPU "
              f"{med[side]['cpu_main_s']:.1f} s (+ {med[side]['cpu_children_s']:.1f} s server)")
    # per pair (A run i, B run i: the same load), the ratio; its median
    pairs = [a["overhead_s"] / b["overhead_s"] for a, b in zip(rows["A"], rows["B"])]
    cpu_pairs = [a.get("cpu_main_s", 0) / b["cpu_main_s"] for a, b in zip(rows["A"], rows["B"]) if b.get("cpu_main_s")]
    print(f"ratio A/B: wall x{med['A']['wall_s'] / med['B']['wall_s']:.2f}, overhead "
          f"x{med['A']['overhead_s'] / med['B']['overhead_s']:.2f} (pairwise median x{statistics.median(pairs):.2f})"
          + (f", main-process CPU pairwise median x{statistics.median(cpu_pairs):.2f}" if cpu_pairs else "")
          + f"; loadavg at end {os.getloadavg()}")
    if json_out:
        Path(json_out).write_text(json.dumps({"medians": med, "runs": rows}, indent=1, default=str))
    return 0



def run_plain(config: str, log_dir: Path, tag: str, home: str, extra_env: dict | None = None) -> dict:
    """One untraced ``privprompt run CONFIG`` (the console script's code path: ``privprompt_cli.py``
    as a script), its subprocess wall and the model work it reports. The traced child imports the
    lifecycle itself before the CLI starts, which a run handed to a worker would not."""
    env = dict(os.environ, PRIVPROMPT_HOME=home, **(extra_env or {}))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "privprompt_cli.py"), "run", config], cwd=str(REPO), env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    (log_dir / f"{tag}.stdout").write_text(proc.stdout)
    (log_dir / f"{tag}.stderr").write_text(proc.stderr)
    m = WALL_RE.search(proc.stdout)
    out = {"tag": tag, "rc": proc.returncode, "wall_s": wall, "home": home}
    if proc.returncode != 0 or m is None:
        out["error"] = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return out
    out.update({"cli_wall_s": float(m.group(1)), "model_work_s": float(m.group(2)),
                "overhead_s": wall - float(m.group(2))})
    return out


def compare_worker(config: str, runs: int, json_out: str | None) -> int:
    """Issue 29's warm worker: in one warm state folder, runs in-process (A, ``PRIVPROMPT_NO_WORKER=1``)
    alternate with runs handed to a ``privprompt worker`` of that folder (B), so both meet the same
    load. One cold in-process run first and one warm-up run through the worker (not counted), then
    ``runs`` pairs, each an untraced ``privprompt run`` (:func:`run_plain`). Overhead = the caller's
    subprocess wall − the model work the run reports."""
    log_dir = Path(tempfile.mkdtemp(prefix="privprompt-overhead-worker-"))
    home = tempfile.mkdtemp(prefix="privprompt-overhead-worker-home-")
    print(f"nproc={os.cpu_count()} loadavg={os.getloadavg()} logs: {log_dir}")
    first = run_plain(config, log_dir, "cold", home, extra_env={"PRIVPROMPT_NO_WORKER": "1"})
    if "error" in first:
        print(f"cold run FAILED: {first['error']}")
        return 1
    started = time.perf_counter()
    log = open(log_dir / "worker.log", "w")
    env = {k: v for k, v in os.environ.items() if k != "PRIVPROMPT_NO_WORKER"}
    worker = subprocess.Popen([sys.executable, str(REPO / "privprompt_cli.py"), "worker", "--idle-timeout", "900"],
                              cwd=str(REPO), env=dict(env, PRIVPROMPT_HOME=home), stdout=log, stderr=subprocess.STDOUT)
    sock = Path(home) / "worker.sock"
    while not sock.exists():
        if worker.poll() is not None:
            print(f"the worker exited: {(log_dir / 'worker.log').read_text()[-2000:]}")
            return 1
        time.sleep(0.2)
    print(f"worker up in {time.perf_counter() - started:.1f} s (paid once)")
    rows: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        for i in range(runs + 1):
            for side, extra in (("A", {"PRIVPROMPT_NO_WORKER": "1"}), ("B", {})):
                if i == 0 and side == "A":
                    continue  # the cold run above was A's
                r = run_plain(config, log_dir, f"{side}{i}", home, extra_env=extra)
                if "error" in r:
                    print(f"{side} run {i}: FAILED rc={r['rc']}: {r['error']}")
                    return 1
                print(f"{side} run {i} ({'in-process' if side == 'A' else 'worker'}{', warm-up' if i == 0 else ''}): "
                      f"wall {r['wall_s']:.1f} s, model work {r['model_work_s']:.1f} s, overhead {r['overhead_s']:.1f} s; "
                      f"loadavg {os.getloadavg()[0]:.1f}", flush=True)
                if i:
                    rows[side].append(r)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "model_work_s", "overhead_s")}
           for side, rs in rows.items()}
    pairs = [a["overhead_s"] / b["overhead_s"] for a, b in zip(rows["A"], rows["B"])]
    for side, name in (("A", "in-process"), ("B", "warm worker")):
        print(f"{side} ({name}): median wall {med[side]['wall_s']:.1f} s, model work {med[side]['model_work_s']:.1f} s, "
              f"overhead {med[side]['overhead_s']:.1f} s over {len(rows[side])} runs "
              f"(overheads {', '.join('%.1f' % r['overhead_s'] for r in rows[side])})")
    print(f"overhead A/B: x{med['A']['overhead_s'] / med['B']['overhead_s']:.2f} on the medians; pairwise "
          f"{', '.join(f'x{x:.2f}' for x in pairs)}; loadavg at end {os.getloadavg()}")
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "medians": med, "pairwise": pairs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
