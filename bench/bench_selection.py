"""Private selection (issue 30): what best-of-K costs against naive composition of the same trials.

For DP-SGD trials (q = 0.01, 1,000 steps) calibrated to a single-trial ε at δ = 1e-5, prints the
selection's ε (Papernot & Steinke RDP bound, ``privacy/selection.py``) for geometric (η = 1),
logarithmic (η = 0), η = −0.5 and Poisson trial counts at E[K] = 2…50, next to naive composition of
⌈E[K]⌉ trials (PLD, the tight accountant). Then a calibration: the σ and single-trial ε that fit a
whole selection into ε = 2 with E[K] = 10 and 12 candidates (noisy holdout count, σ_s = 30).

Run:  cd /work/main && .venv/bin/python bench/bench_selection.py
"""

from __future__ import annotations

import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from privacy import accountant as acct  # noqa: E402
from privacy import events as ev  # noqa: E402
from privacy import selection as sel  # noqa: E402

DELTA, Q, STEPS = 1e-5, 0.01, 1000


def distributions(mean: float):
    yield "geometric η=1", sel.TruncatedNegativeBinomial(1.0, 1.0 / mean)
    yield "logarithmic η=0", sel.TruncatedNegativeBinomial(0.0, sel.gamma_for_mean(0.0, mean))
    yield "TNB η=-0.5", sel.TruncatedNegativeBinomial(-0.5, sel.gamma_for_mean(-0.5, mean))
    yield "Poisson", sel.PoissonTrials(mean)


def main() -> None:
    t0 = time.perf_counter()
    for trial_eps in (1.0, 2.0):
        sigma = acct.calibrate_noise_multiplier(trial_eps, DELTA, Q, STEPS)
        trial = ev.dpsgd_event(Q, sigma, STEPS)
        print(f"\nDP-SGD trial: q={Q}, steps={STEPS}, σ={sigma:.4f}, ε={acct.spend(trial, DELTA).epsilon:.3f} "
              f"at δ={DELTA:g}")
        print(f"{'E[K]':>5} {'naive ⌈E[K]⌉ (PLD)':>20} " + " ".join(f"{name:>16}" for name, _ in distributions(2.0)))
        for mean in (2, 3, 5, 10, 20, 50):
            naive = acct.spend(ev.SelfComposedEvent(trial, math.ceil(mean)), DELTA).epsilon
            cells = [acct.spend(sel.selection_event([trial], d), DELTA).epsilon for _, d in distributions(float(mean))]
            print(f"{mean:>5} {naive:>20.3f} " + " ".join(f"{c:>16.3f}" for c in cells))
    plan = sel.plan_dpsgd_selection(2.0, DELTA, sel.TruncatedNegativeBinomial(1.0, 0.1), Q, STEPS,
                                    score_noise_multiplier=30.0, n_candidates=12)
    print("\ncalibration (target ε=2, geometric E[K]=10, 12 candidates, score σ=30):")
    for key, value in plan.to_dict().items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
