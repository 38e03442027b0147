"""Per-person ε of configs/sweep_unit.yaml under the conservative group map (before issue 37) and
the exact mixture of Gaussians (after), on the SAME released sizes and planned events: every
variant planned once (tasks.run_plan.plan_for); a record-level run charged per person is charged
the plan's event (exact) and, for comparison, the old rule's event (rate 1 − (1 − q)^k, noise σ/k)
built from the same per-record event; the ledger's composition of the whole sweep both ways.

    PRIVPROMPT_HOME=<state> python docs/results/unit_exact/measure.py configs/sweep_unit.yaml \
        --set data.path=/tmp/sst2_users
"""

import argparse
import json

from privacy import events as ev
from privacy.accountant import spend
from privacy.group import grouped_rate
from tasks.config import load_config, sweep_variants
from tasks.planning import released_sizes
from tasks.run_plan import plan_for, resolve_delta
from tasks.state import config_state_paths


def conservative(event, k):
    """The rule charged before issue 37 (privacy/group.py at 5605f3c)."""
    if isinstance(event, ev.GaussianEvent):
        return ev.GaussianEvent(event.noise_multiplier / k)
    if isinstance(event, ev.PoissonSampledEvent):
        return ev.PoissonSampledEvent(grouped_rate(event.sampling_probability, k), conservative(event.event, k))
    if isinstance(event, ev.SelfComposedEvent):
        return ev.SelfComposedEvent(conservative(event.event, k), event.count)
    if isinstance(event, (ev.ComposedEvent, ev.ParallelEvent)):
        return ev.ComposedEvent(tuple(conservative(e, k) for e in event.events))
    raise TypeError(type(event).__name__)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    cfg0 = load_config(args.config, args.set)
    paths = config_state_paths(cfg0)
    rows, before, after = [], [], []
    for label, cfg in sweep_variants(cfg0):
        sizes = released_sizes(cfg, paths.private)
        delta = resolve_delta(cfg, sizes.n_for_delta)
        for name in cfg.run_methods:
            plan = plan_for(cfg, name, sizes, delta)
            if plan.event is None:
                continue
            k = cfg.data.group_size
            old = conservative(plan.record_event, k) if k else plan.event
            before.append(old)
            after.append(plan.event)
            if "seed=0" in label:
                rows.append({"variant": label, "method": name, "k": k,
                             "per_record": spend(plan.record_event or plan.event, delta).epsilon,
                             "before": spend(old, delta).epsilon, "after": spend(plan.event, delta).epsilon,
                             "group_accounting": plan.params.get("privacy.group_accounting")})
    out = {"rows": rows, "delta": delta,
           "composed_before": spend(ev.ComposedEvent(tuple(before)), delta).epsilon,
           "composed_after": spend(ev.ComposedEvent(tuple(after)), delta).epsilon}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
