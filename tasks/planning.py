"""The budget plan of a config before anything runs (``privprompt plan``, sweeps): every run's
planned events per dataset, composed with what the ledger holds, writing nothing but the released
split sizes (drawn once per partition, kept under ``private/released-sizes/``, used by the runs):
to know them it reads the source and hashes its records as a partition would."""

from __future__ import annotations

import json
import re
from pathlib import Path

from privacy import accountant as acct
from privacy.ledger import Ledger

from .data import partition_key
from .errors import ConfigError
from .charge import charged_note, check_dataset_terms, source_dataset
from .preflight import preflight
from .run_plan import (fitting_hint, largest_fitting_target_epsilon, plan_for, planned_epsilon, planned_events,
                       resolve_delta)
from .state import default_data_root
from .estimate import format_seconds
from .statement import unit_phrase


_EXACT: dict[tuple[str, str], tuple] = {}  # (private dir, partition key) -> split_release_inputs, this process


def released_sizes(cfg, private_dir: Path, draw: bool = True):
    """The released split sizes (:class:`tasks.data.ReleasedSizes`) a run of ``cfg`` will plan
    with and publish: from its partition manifest when it exists, else drawn now — once, kept
    under ``private/released-sizes/`` for the run to use — from the exact sizes the split rule of
    ``partition_dataset`` gives (each source record's keyed hash, and the seeded canaries),
    computed without writing the partition. So the plan's events are the run's."""
    from .data import Partition, release_sizes

    data_root = default_data_root(cfg.data_root)
    key = partition_key(cfg.data, cfg.seed, data_root, private_dir)
    manifest = Path(private_dir) / "partitions" / f"{cfg.data.name}-{key}" / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        if data.get("released"):
            return Partition(**data).sizes
    membership, exact, planted, _ = _split_facts(cfg, private_dir)  # an exactly empty split is planned like any other
    return release_sizes(cfg.data, membership, private_dir, exact, planted, draw=draw)


def _split_facts(cfg, private_dir: Path) -> tuple:
    """:func:`tasks.data.split_facts` of ``cfg``'s partition, once per process (a sweep's variants share it)."""
    from .data import split_facts

    data_root = default_data_root(cfg.data_root)
    memo = (str(Path(private_dir).resolve()), partition_key(cfg.data, cfg.seed, data_root, private_dir))
    if memo not in _EXACT:
        _EXACT[memo] = split_facts(cfg.data, cfg.seed, private_dir, data_root)
    return _EXACT[memo]


def source_notes(cfg, private_dir: Path) -> list[str]:
    """The partition's notes for the operator's terminal (:func:`tasks.data.split_notes`): from its
    manifest when it is written, else computed as the partition would be."""
    from .data import Partition, partition_notes

    data_root = default_data_root(cfg.data_root)
    key = partition_key(cfg.data, cfg.seed, data_root, private_dir)
    manifest = Path(private_dir) / "partitions" / f"{cfg.data.name}-{key}" / "manifest.json"
    if manifest.is_file():
        return partition_notes(cfg.data, Partition(**json.loads(manifest.read_text())))
    return list(_split_facts(cfg, private_dir)[3])


def plan_runs(variants: list, state_paths, largest: bool | str = False, checks: bool = True,
              estimate: bool = False) -> dict:
    """``variants``: [(label, config)]. Returns {"runs": [...], "datasets": {key: preview}, "fits": bool}.

    The same rules and checks as a run, writing nothing but the released sizes: every check that needs no
    private data (:func:`tasks.preflight.preflight`: models, label words, templates, endpoints;
    ``checks=False``: a caller that ran them already),
    and the ledger's terms of each dataset (:func:`tasks.charge.check_dataset_terms`: its δ, a
    cap only lowered). With ``largest`` and one config per dataset, each dataset's preview also
    says the largest ``privacy.target_epsilon`` at which that config still fits
    (``largest_epsilon``, solved with the accountant; None: nothing fits); ``largest="over"``: only
    for a dataset the plan does not fit (a search of calibrated runs: seconds each; where the plan
    fits, ``largest_hint`` says how to ask for it)."""
    from .methods import get_method

    runs, events, meta = [], {}, {}
    ledger = state_paths.open_ledger() if state_paths.ledger_exists() else None
    checked: set[str] = set()
    pending: dict[str, set[bytes]] = {}  # sources new to the ledger that earlier variants register
    beside: list = []
    timed: list = []  # (row, cfg, method, plan, sizes): the time estimate, once the budget's verdict is known
    for label, cfg in variants:
        sizes = released_sizes(cfg, state_paths.private)
        key, dname, note = _charged_dataset(ledger, cfg, state_paths, pending, meta)
        delta = resolve_delta(cfg, sizes.n_for_delta)
        # the unit its dataset is stated for: data.privacy_unit, or data.person_field of a record-level run charged per person
        unit = cfg.data.charge_unit
        check_dataset_terms(ledger, key, dname, cfg.privacy.dataset_epsilon_cap, delta, unit)
        signature = cfg.model_dump_json(include={"models", "data", "method", "methods", "seed"})
        if checks and signature not in checked:  # the variants of a sweep mostly share their models
            preflight(cfg, None)
            checked.add(signature)
        _add_to_dataset(meta, key, dname, note, label, cfg, sizes, delta, unit)
        for name in cfg.run_methods:
            method, plan = get_method(name), plan_for(cfg, name, sizes, delta)
            row = _plan_row(label, cfg, method, sizes, delta, unit, events.setdefault(key, []), plan)
            timed.append((row, cfg, method, plan, sizes))
            if row.get("group"):  # a record-level run charged per person: a user-level run's per-person ε beside it
                beside.append((row, cfg, name, delta))
            runs.append(row)
    for row, cfg, name, delta in beside:  # after every variant: a user-level one of the sweep has drawn its sizes
        row["user_level"] = _user_level_beside(cfg, name, delta, state_paths.private)
    datasets = {key: _dataset_preview(ledger, key, m, events.get(key, []), largest) for key, m in meta.items()}
    fits = all(d["fits"] for d in datasets.values())
    if estimate and fits:  # a plan over the cap is refused as it is: no model is probed for its time
        for row, cfg, method, plan, sizes in timed:
            _estimate_row(row, cfg, method, plan, sizes)
    return {"runs": runs, "datasets": datasets, "fits": fits}


def budget_refusal(cfg, state_paths) -> str | None:
    """``privprompt run``'s budget check before its flow starts (before any baseline or evaluation):
    the plan of ``cfg`` composed with the ledger as ``privprompt plan`` does it (the model checks
    left to the caller). None when it fits; else one line saying what is over the cap."""
    plan = plan_runs([("", cfg)], state_paths, checks=False)
    for key, d in plan["datasets"].items():
        if not d["fits"]:
            hint = plan_runs([("", cfg)], state_paths, largest=True, checks=False)["datasets"][key].get("largest_hint")
            return (f"privacy budget for dataset {d['name']!r} (fingerprint {key[:12]}…) exhausted for this run: it "
                    f"would take the composed ε {unit_phrase(d.get('unit'))} from {d['spent_epsilon']:.4f} to "
                    f"{d['total_epsilon']:.4f}, over the cap ε={d['cap']:.4f} at δ={d['delta']:g}; "
                    f"{hint or 'privprompt plan CONFIG: the largest target_epsilon that fits'}; refused before any "
                    "baseline, evaluation or training")
    return None


def _charged_dataset(ledger, cfg, state_paths, pending: dict, meta: dict) -> tuple[str, str, str | None]:
    """(fingerprint, name, note) of the dataset a variant's source is charged to, as a run finds it
    (:func:`tasks.charge.ensure_dataset`), counting sources that earlier variants register
    (``pending``, updated with this one's records)."""
    from privacy.ledger import RecordOverlapError

    from .data import RECORD_DIGEST_BYTES, source_records

    records = source_records(cfg.data, default_data_root(cfg.data_root), state_paths.private, cfg.seed)
    match = source_dataset(ledger, records, cfg.data.name)
    key, dname, note = records.key, cfg.data.name, charged_note(match, cfg.data.name)
    mine = {records.digests[i:i + RECORD_DIGEST_BYTES] for i in range(0, len(records.digests), RECORD_DIGEST_BYTES)}
    if match is not None:
        key, dname = match["fingerprint"], match["name"]
    else:
        shared = [k for k, held in pending.items() if k == records.key or not held.isdisjoint(mine)]
        if len(shared) > 1:
            raise RecordOverlapError(
                f"data source {cfg.data.name!r} (records key {records.key[:12]}…) shares records with "
                f"{len(shared)} datasets that earlier runs of this plan register: "
                + ", ".join(f"{meta[k]['name']!r} (fingerprint {k[:12]}…)" for k in shared)
                + "; a run on it would draw on several budgets at once")
        if shared and shared[0] != records.key:
            key, dname = shared[0], meta[shared[0]]["name"]
            note = (f"data source {cfg.data.name!r} shares records with dataset {dname!r} (fingerprint "
                    f"{key[:12]}) that an earlier run of this plan registers: charged against its budget")
    pending.setdefault(key, set()).update(mine)  # what the dataset holds once this variant ran
    return key, dname, note


def _add_to_dataset(meta: dict, key: str, dname: str, note, label, cfg, sizes, delta: float, unit: str) -> None:
    """Count a variant under its dataset: one unit and one δ per dataset, the smallest cap."""
    meta.setdefault(key, {"name": dname, "delta": delta, "cap": cfg.privacy.dataset_epsilon_cap,
                          "unit": unit, "configs": [], "notes": []})
    if meta[key]["unit"] != unit:  # as a run would be, once an earlier one registered it
        from privacy.ledger import UnitMismatchError, unit_mismatch_message

        raise UnitMismatchError(f"{label or cfg.method}: " + unit_mismatch_message(
            dname, key, meta[key]["unit"], unit) + " (another run of this plan registers it)")
    if note and note not in meta[key]["notes"]:
        meta[key]["notes"].append(note)
    meta[key]["configs"].append((cfg, sizes))
    meta[key]["cap"] = min(meta[key]["cap"], cfg.privacy.dataset_epsilon_cap)
    if abs(meta[key]["delta"] - delta) > 1e-15:
        raise ConfigError(f"{label or cfg.method}: δ={delta:g} differs from δ={meta[key]['delta']:g} of another "
                          f"run on dataset {dname!r}; runs on one dataset compose at one δ")


def _plan_row(label, cfg, method, sizes, delta: float, unit: str, events: list, plan=None) -> dict:
    """Method ``method``'s row of the plan (its ``plan``, None: planned here; its event appended to
    its dataset's ``events``)."""
    name = method.name
    plan = plan_for(cfg, name, sizes, delta) if plan is None else plan
    row = {"variant": label, "method": name, "dataset": cfg.data.name,
           "guarantee": plan.guarantee, "delta": delta, "epsilon": None, "unit": unit}
    if plan.event is not None:
        row["epsilon"] = planned_epsilon(cfg, name, plan, delta)
        row["guarantee_epsilon"] = plan.guarantee_epsilon
        row["target_epsilon"] = plan.target_epsilon
        row["size_epsilon"] = plan.params.get("privacy.size_epsilon")
        if plan.record_event is not None:  # charged per person: the ledger composes the group event
            row["epsilon_per_record"], row["epsilon"] = row["epsilon"], acct.spend(plan.event, delta).epsilon
            row["group"] = f"{cfg.data.group_size} {unit}"
            row["group_accounting"] = plan.params.get("privacy.group_accounting")
        events.append(plan.event)
    if plan.no_prompt is not None:  # the comparison with no prompt: its share of the run's ε
        row["no_prompt"] = {"epsilon": plan.no_prompt.epsilon, "share": cfg.fallback.epsilon_share,
                            "sigma": plan.no_prompt.event.noise_multiplier, "fallback": cfg.fallback.enabled,
                            "method_epsilon": plan.method_epsilon,
                            "composed_epsilon": plan.guarantee_epsilon - plan.params.get("privacy.size_epsilon", 0.0)}
    if plan.event is not None:  # what the data's size allows (released sizes: the terminal's plan only)
        row["size"] = size_verdict(cfg, plan, sizes)
    if "selection" in plan.settings:  # the selection's ε beside one trial's (and naive composition)
        from .selection import describe_plan

        row["selection"] = describe_plan(cfg, method, plan, sizes, delta)
    return row


def _estimate_row(row: dict, cfg, method, plan, sizes) -> None:
    """A run's steps and wall-time estimate under its ``plan`` from a measured probe of its model
    (``tasks/estimate.py``)."""
    from . import estimate as est

    seen = None
    try:  # a model the probe cannot drive (an endpoint, a GGUF-only model): no estimate, never a failed plan
        source = method.extras.source_model(cfg, {})
        shape = (source, cfg.models.max_length, plan.settings.get("expected_batch") or est.PROBE_BATCH,
                 cfg.models.eval_batch_size)
        seen = est.observed(method.name, *shape, placement=cfg.models.placement_of(source))
        if seen is not None and seen.eval_s is not None and (seen.train_s is not None or not est.trains(plan)):
            measured = seen  # a run of this method on this machine: no probe
        else:
            measured = est.with_observed(est.probe(*shape, cfg.seed, placement=cfg.models.placement_of(source)), seen)
    except Exception:  # noqa: BLE001 - the estimate is advisory
        measured = est.with_observed(None, seen)
    if measured is not None and measured.measured_at:
        row["observed_at" if measured.observed else "probe_at"] = measured.measured_at
    if "selection" in plan.settings:  # its trials' own plans
        from .selection import trial_work

        row.update(est.selection_estimate(trial_work(cfg, method, plan), sizes, measured,
                                          cfg.data.max_records_per_unit))
    else:
        row.update(est.run_estimate(plan, sizes, measured, cfg.data.max_records_per_unit))


def user_level_config(cfg):
    """The same config as a user-level run: ``data.privacy_unit`` naming the person field of a
    record-level run charged per person (its cap ``data.max_records_per_unit`` kept)."""
    from .config import parse_config

    raw = cfg.model_dump(mode="json")
    raw["sweep"], raw["seeds"], raw["grid"], raw["sweep_dask"] = [], [], {}, None
    raw["data"]["privacy_unit"] = cfg.data.person_field
    return parse_config(raw)


def _user_level_beside(cfg, name: str, delta: float, private_dir) -> dict:
    """What a user-level run of the same method at the same target would charge one person
    (``epsilon``), or why it cannot be planned (``refused``, one line): shown beside a record-level
    run's exact per-person charge so a team can choose. It reads only released sizes, like the plan,
    and never draws them: a draw here would be a release no run charges; until a
    user-level variant is planned or run, it says how to see the number."""
    try:
        user_cfg = user_level_config(cfg)
        sizes = released_sizes(user_cfg, private_dir, draw=False)
        if sizes is None:
            return {"refused": f"plan a variant with data.privacy_unit: {cfg.data.person_field} to see it (its split "
                               "sizes are released by that plan, not by this one)"}
        plan = plan_for(user_cfg, name, sizes, delta)
        if plan.event is None:
            return {"refused": f"{name} makes no dp claim at user level"}
        return {"epsilon": planned_epsilon(user_cfg, name, plan, delta), "unit": cfg.data.person_field}
    except ValueError as exc:  # ConfigError / PlanError: one line
        return {"refused": str(exc).splitlines()[0]}


def _dataset_preview(ledger, key: str, m: dict, planned: list, largest: bool | str) -> dict:
    """The ledger's preview of a dataset with the plan's events (and, with ``largest``, the largest
    fitting target of its one config)."""
    if ledger is not None:
        d = ledger.preview(key, planned, m["delta"], cap=m["cap"], name=m["name"])
    else:
        d = Ledger.preview_new(planned, m["delta"], cap=m["cap"], name=m["name"])
    if m["cap"] < d["cap"]:  # a run lowers the stored cap to its config's (never raises it)
        d.update(cap=m["cap"], remaining_after=m["cap"] - d["total_epsilon"], fits=d["total_epsilon"] <= m["cap"])
    if largest == "over" and d["fits"] and len(m["configs"]) == 1:
        d["largest_hint"] = "privprompt plan --largest: the largest target_epsilon that still fits"
    elif largest and len(m["configs"]) == 1:
        cfg, sizes = m["configs"][0]
        if planned_events(cfg, sizes, m["delta"]):
            existing = ledger.counted_events(key) if ledger is not None and _registered(ledger, key) else []
            # spent above the cap (a lowered cap, or ε held from before a δ change): nothing fits
            d["largest_epsilon"] = (None if d["spent_epsilon"] > d["cap"] else
                                    largest_fitting_target_epsilon(cfg, sizes, m["delta"], existing, d["cap"]))
            d["largest_hint"] = fitting_hint(d["largest_epsilon"])
    d["notes"] = m["notes"]
    d["unit"] = m["unit"]
    return d


def _registered(ledger: Ledger, key: str) -> bool:
    from privacy.ledger import UnknownDatasetError

    try:
        ledger.dataset(key)
    except UnknownDatasetError:
        return False
    return True


_DOTTED_KEY = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)=")


def short_labels(labels: list[str]) -> list[str]:
    """Variant labels with every dotted key cut to its last part (``methods.rapt.eta=100.0`` →
    ``eta=100.0``), where that keeps distinct labels distinct; otherwise the labels as they are."""
    short = [_DOTTED_KEY.sub(r"\1=", label) for label in labels]
    return short if len(set(short)) == len(set(labels)) else list(labels)


# The stated rule of what a run's size allows (checked in bench/RESULTS.md, "A small team's own data"):
GAIN = 0.05  # the holdout comparison must tell a gain of 5 accuracy points ...
GAIN_SIGMAS = 2.0  # ... at 2σ of its noise: 0.05·n ≥ 2σ, n ≥ 40σ units
MIN_STEPS = 100  # DP-SGD-like training takes at least this many noisy steps
SIZE_SIGMAS = 3.0  # a released size is its true size within 3σ of its noise (99.87 %)


def size_verdict(cfg, plan, sizes) -> dict:
    """The plan's facts about what the data's size allows, and a verdict by the stated rule above:
    the comparison with no prompt needs a holdout of ≥ 40σ_comparison units, which the released
    holdout must show even at its lower bound ñ − 3σ_sizes (so the warning holds for the TRUE size);
    a trained method needs ≥ 100 noisy steps. ``needed``: the units the dataset would need (≈) for
    both, at the config's fractions and batch."""
    steps = plan.settings.get("steps")
    facts = {"unit": cfg.data.charge_unit, "n_train": sizes.n_train, "n_holdout": sizes.n_holdout,
             "size_sigma": sizes.sigma, "steps": steps, "batch": plan.settings.get("expected_batch"),
             "problems": [], "needed": 0}
    total = sizes.n_train + sizes.n_holdout
    if plan.no_prompt is not None:
        sigma = plan.no_prompt.event.noise_multiplier
        need = GAIN_SIGMAS * sigma / GAIN
        facts["comparison_sigma"] = sigma
        if sizes.n_holdout - SIZE_SIGMAS * sizes.sigma < need:
            facts["problems"].append(
                f"the comparison with no prompt adds noise σ = {sigma:.3g} to a holdout of ≈ {sizes.n_holdout:,} "
                f"(released, ± {sizes.sigma:g}): a gain of {GAIN:.0%} shows at {GAIN_SIGMAS:g}σ only on ≥ {need:,.0f}")
            facts["needed"] = max(facts["needed"], (need + SIZE_SIGMAS * sizes.sigma) / max(cfg.data.holdout_fraction,
                                                                                          1e-9))
    if steps is not None and steps < MIN_STEPS:
        facts["problems"].append(f"training takes {steps} noisy steps (fewer than {MIN_STEPS}) at an expected batch "
                                 f"of {facts['batch']:.3g}")
        facts["needed"] = max(facts["needed"], total * MIN_STEPS / max(steps, 1))
    return facts


def size_line(r: dict) -> str | None:
    """The plan's warning when the data is too small for the run by :func:`size_verdict`'s rule
    (None: it is not): released sizes, named as such (the terminal's plan only)."""
    s = r.get("size") or {}
    if not s.get("problems"):
        return None
    who = "people" if s["unit"] != "record" else "records"
    return (f"  WARNING: too few {who} for ε = {r['target_epsilon']:g} {unit_phrase(s['unit'])} (δ = {r['delta']:.3g}) "
            f"with this route: released.n_train ≈ "
            f"{s['n_train']:,}, released.n_holdout ≈ {s['n_holdout']:,} (noisy counts, σ = {s['size_sigma']:g}); "
            + "; ".join(s["problems"]) + f". It needs ≈ {s['needed']:,.0f} {who}, or: fallback.epsilon_share: 0 (no "
            "comparison; its ε goes to the method), more epochs or a smaller batch, a smaller "
            "data.size_noise_sigma, or a route for few examples (dp_fewshot, dp_icl: docs/routes.md)")


def no_prompt_line(c: dict) -> str:
    """The plan's line for a run's comparison with no prompt (``fallback``; tasks/no_prompt.py)."""
    then = ("no prompt is published if it loses" if c["fallback"] else "a loss is warned about (fallback.enabled: "
            "false)")
    line = (f"  of it, the comparison with no prompt on the holdout: ε = {c['epsilon']:.4f} (fallback.epsilon_share "
            f"{c['share']:g}; Gaussian noise σ = {c['sigma']:.3g} on the difference in holdout records right; {then}); "
            f"the method's share ε = {c['method_epsilon']:.4f} (each alone at its part of δ; the two composed by the "
            f"accountant: ε = {c['composed_epsilon']:.4f})")
    return line


def guarantee_line(r: dict) -> str:
    """The plan's line for a dp run's guarantee and how it is made up (``privacy/plan.py``)."""
    sizes = r.get("size_epsilon")
    how = (f"the split sizes' release (ε = {sizes:.4f}, δ/10) and the rest (9δ/10) by basic composition, which "
           "holds whatever the method chose from the released sizes" if sizes else "the method's releases composed")
    per = "per record" if r.get("group") else unit_phrase(r.get("unit"))
    charged = (f"; the ledger charges ε = {r['epsilon']:.4f} {unit_phrase(r.get('unit'))} (group privacy)"
               if r.get("group") else "; the ledger charges the same")
    return (f"  guarantee: ε = {r['guarantee_epsilon']:.4f} {per}, δ = {r['delta']:.3g}, of the target "
            f"{r['target_epsilon']:g} ({how}){charged}")


def format_plan(plan: dict, datasets: bool = True) -> str:
    """The plan as ``privprompt plan`` prints it. ``datasets=False``: without the per-dataset rows and
    notes (which registered dataset a source is charged to depends on its records): what the sweep
    logs to Prefect and MLflow."""
    labels = short_labels([r["variant"] or "(config)" for r in plan["runs"]])
    width = max([len("variant"), *map(len, labels)]) + 2
    # no n_train column: the sweep logs this table to Prefect (its server) before any run's charge
    # covers the release of the sizes
    timed = any("seconds" in r for r in plan["runs"])
    timing = lambda r: (f"{'-' if r.get('steps') is None else r['steps']:>7}  "  # noqa: E731
                        f"{('≤' if r.get('bound') else '') + format_seconds(r.get('seconds')):>10}  ") if timed else ""
    lines = [f"{'variant':<{width}}{'method':<16}{'guarantee':<10}{'planned ε':>12}  "
             + (f"{'steps':>7}  {'est. time':>10}  " if timed else "") + f"{'δ':<9}unit"]
    for r, label in zip(plan["runs"], labels):
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.4f}"
        delta, unit = ("-", "-") if r["epsilon"] is None else (f"{r['delta']:.3g}", unit_phrase(r.get("unit")))
        lines.append(f"{label:<{width}}{r['method']:<16}{r['guarantee']:<10}{eps:>12}  {timing(r)}{delta:<9}{unit}")
        if r.get("guarantee_epsilon") is not None:
            lines.append(guarantee_line(r))
        if r.get("group"):
            how = {"exact_mixture": "exact mixture of Gaussians"}.get(r.get("group_accounting"),
                                                                      r.get("group_accounting") or "group privacy")
            lines.append(f"  record-level: ε = {r['epsilon_per_record']:.4f} per record; charged per person (≤ "
                         f"{r['group']} records, {how}): ε = {r['epsilon']:.4f}")
            user = r.get("user_level") or {}
            if "epsilon" in user:
                lines.append(f"  beside it, a user-level run (data.privacy_unit: {user['unit']}) at the same target: "
                             f"ε = {user['epsilon']:.4f} per person")
            elif user:
                lines.append(f"  a user-level run at the same target cannot be planned: {user['refused']}")
        if r.get("why"):  # no time estimate for this run, and why
            lines.append(f"  est. time: - ({r['why']})")
        elif r.get("bound"):
            lines.append("  est. time: an upper bound (each person counted as data.max_records_per_unit records)")
        if r.get("no_prompt"):
            lines.append(no_prompt_line(r["no_prompt"]))
        if datasets and size_line(r):  # released sizes: on the terminal, never in what a sweep logs
            lines.append(size_line(r))
        if r.get("selection"):
            s = r["selection"]
            others = (f"the same trials by random stopping (E[K] = {s['expected_trials']:g}) ε = "
                      f"{s['random_stopping_epsilon']:.4f}" if s["mode"] == "every_candidate" else
                      f"every candidate once, composed, ε = {s['naive_candidates_epsilon']:.4f}")
            every = s["mode"] == "every_candidate"
            how = ("every candidate trained once" if every
                   else f"random stopping, E[K] = {s['expected_trials']:g} trials drawn among them")
            naive = ("" if every else f"{s['naive_trials']} trials (draws among the {s['candidates']} choices) "
                     f"composed naively ε = {s['naive_epsilon']:.4f}; ")
            lines.append(f"  selection among {s['candidates']} choices: {s['candidates'] - 1} candidate settings + no "
                         f"prompt ({how}, ranked by {s['metric']}, noise σ = {s['score_noise_multiplier']:.4g} records "
                         f"on each holdout count): ε = {s['selection_epsilon']:.4f} for the whole selection (one "
                         f"ledger entry); a single trial alone ε = {s['trial_epsilon']:.4f}; {naive}{others} (each "
                         "with the sizes' release, at the run's δ)")
    if timed:
        total = sum(r["seconds"] for r in plan["runs"] if r.get("seconds") is not None)
        cached = sorted({r["probe_at"] for r in plan["runs"] if r.get("probe_at")})
        seen = sorted({r["observed_at"] for r in plan["runs"] if r.get("observed_at")})
        probed = (f"a probe of the model on this machine measured {cached[0]} (privprompt plan --probe measures it "
                  "again)" if cached else "a probe of the model on this machine")
        if seen:
            probed = (f"the seconds per example of the last run of each method on this machine ({seen[-1]})"
                      + (f", else {probed}" if cached else ""))
        lines.append(f"est. time: {format_seconds(total)} of model work in all (training steps × expected batch and "
                     f"the test split, from {probed}; start-up, tracking and any audit "
                     "come on top; a selection's at its expected number of trials)")
    for key, d in (plan["datasets"] if datasets else {}).items():
        lines.append(f"dataset {d.get('name', '?')} ({key[:12]}): spent ε={d['spent_epsilon']:.4f}, "
                     f"with this plan ε={d['total_epsilon']:.4f} of cap ε={d['cap']:.4f}; "
                     f"remaining after ε={max(0.0, d['cap'] - d['total_epsilon']):.4f} "
                     f"({'fits' if d['fits'] else 'OVER THE CAP'}); every ε {unit_phrase(d.get('unit'))}, "
                     f"δ = {d['delta']:.3g}")
        for note in d.get("notes", []):
            lines.append(f"  {note}")
        if "largest_epsilon" in d:
            lines.append(f"  {d['largest_hint']} (this config, composed with what the dataset has spent)")
        elif d.get("largest_hint"):
            lines.append(f"  {d['largest_hint']}")
    return "\n".join(lines)
