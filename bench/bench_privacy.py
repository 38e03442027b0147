"""Speed benchmark of the privacy core (issue: privacy/).

Requirements (2 CPU cores):
  (a) ε for a 10,000-step DP-SGD run in < 1 s
  (b) ε for 2,000 DP-OPT token queries in < 1 s
  (c) calibrating σ for a target ε in < 5 s

Each setting is timed once with time.perf_counter, after clearing the accountant's
functools.lru_caches, so every call starts from the state of a fresh process
(modules already imported; import time is reported separately).

Run:  cd /work/main && .venv/bin/python bench/bench_privacy.py
Always exits 0; a setting over its limit is reported as MISS.
"""

from __future__ import annotations

import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_t0 = time.perf_counter()
from privacy import accountant, events, pld, rdp  # noqa: E402
from tasks.methods.dp_opt import events as dp_opt_events  # noqa: E402
IMPORT_SECONDS = time.perf_counter() - _t0


def clear_caches() -> None:
    rdp._rdp_cached.cache_clear()
    rdp._sampled_gaussian_rdp_one.cache_clear()
    pld.clear_caches()


def timed(fn):
    clear_caches()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def verdict(ratio: float) -> str:
    return "pass" if ratio <= 1.0 else "MISS"


def main() -> int:
    rows = []  # (req, setting, seconds, limit, ratio, verdict, result)
    print(f"python {platform.python_version()}, nproc={os.cpu_count()}, "
          f"import privacy: {IMPORT_SECONDS:.3f} s (not counted)")

    # (a) DP-SGD, 10,000 steps
    print("\n(a) DP-SGD ε, 10,000 steps, δ=1e-5, limit 1 s")
    cross = []
    for q, sigma in [(0.01, 1.0), (0.004, 0.8), (0.02, 0.7), (0.001, 0.6)]:
        secs, sp = timed(lambda: accountant.spend(events.dpsgd_event(q, sigma, 10000), 1e-5))
        ratio = secs / 1.0
        setting = f"DP-SGD q={q} σ={sigma} T=10000"
        print(f"  {setting:32s} {secs:8.3f} s  limit 1 s  ratio {ratio:6.3f} {verdict(ratio)}  ε={sp.epsilon:.4f}")
        rows.append(("a", setting, secs, 1.0, ratio, verdict(ratio), f"ε={sp.epsilon:.4f}"))
        cross.append((setting, sp.epsilon_pld, sp.epsilon_rdp))

    print("\n  PLD vs RDP ε (DP-SGD):")
    for setting, e_pld, e_rdp in cross:
        r = (e_pld / e_rdp) if (e_pld is not None and e_rdp not in (0, float("inf"))) else float("nan")
        print(f"  {setting:32s} ε_pld={e_pld:.4f}  ε_rdp={e_rdp:.4f}  pld/rdp={r:.3f}")

    # (b) DP-OPT token queries
    print("\n(b) DP-OPT ε, ε0=1.8, δ0=5e-7, q=205*5/66674, δ=1/66674, limit 1 s")
    for n in (2000, 1600):
        secs, sp = timed(lambda: accountant.spend(
            dp_opt_events.generation_event(1.8, 5e-7, 205 * 5 / 66674, n), 1 / 66674))
        ratio = secs / 1.0
        setting = f"DP-OPT {n} queries"
        print(f"  {setting:32s} {secs:8.3f} s  limit 1 s  ratio {ratio:6.3f} {verdict(ratio)}  "
              f"ε={sp.epsilon:.4f} (pld={sp.epsilon_pld}, rdp={sp.epsilon_rdp:.4f})")
        rows.append(("b", setting, secs, 1.0, ratio, verdict(ratio),
                     f"ε={sp.epsilon:.4f} (pld {sp.epsilon_pld:.4f}, rdp {sp.epsilon_rdp:.4f})"
                     if sp.epsilon_pld is not None else f"ε={sp.epsilon:.4f}"))

    # (c) calibration
    print("\n(c) calibrate σ for ε=8, δ=1e-5, limit 5 s")
    for q, steps in [(0.01, 3000), (0.004, 10000), (0.02, 1000)]:
        secs, sigma = timed(lambda: accountant.calibrate_noise_multiplier(8.0, 1e-5, q, steps))
        ratio = secs / 5.0
        setting = f"calibrate q={q} T={steps}"
        # Check (untimed) what the calibrated σ spends.
        clear_caches()
        eps = accountant.spend(events.dpsgd_event(q, sigma, steps), 1e-5).epsilon
        print(f"  {setting:32s} {secs:8.3f} s  limit 5 s  ratio {ratio:6.3f} {verdict(ratio)}  "
              f"σ={sigma:.4f} (spends ε={eps:.4f})")
        rows.append(("c", setting, secs, 5.0, ratio, verdict(ratio), f"σ={sigma:.4f} (ε={eps:.4f})"))

    print("\n## Summary\n")
    print("| req | setting | seconds | limit (s) | ratio | verdict | result |")
    print("|---|---|---:|---:|---:|---|---|")
    for req, setting, secs, limit, ratio, v, res in rows:
        print(f"| {req} | {setting} | {secs:.3f} | {limit:g} | {ratio:.3f} | {v} | {res} |")
    misses = sum(1 for r in rows if r[5] == "MISS")
    print(f"\n{len(rows) - misses}/{len(rows)} settings within their limit"
          + (f"; {misses} MISS" if misses else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
