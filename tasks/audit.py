"""Membership-inference audit of a published prompt, as plain functions (Prefect-free).

* Pool: members (from the audited run's training partition) and non-members (its held-out
  examples). Each of K shadow prompts is trained by the *same* method and settings on a random
  half of the pool, so that every pool example is "in" for exactly K/2 shadows. For POST a
  shadow is the whole private pipeline after distillation: DP tuning on the (public, cached)
  student, then transfer to the audited model on the public data; the student is not retrained,
  because it never saw private data.
* Attacks on the pool: loss threshold, LiRA online / offline (Carlini et al. 2022) on the
  true-label logit, Min-K% prob for causal LMs.
* Canary audit (Steinke, Nasr, Jagielski 2023): the partition's canaries were each planted with
  probability ½; their scores give a one-run lower bound on ε. A bound above the run's claimed ε
  means the DP implementation is broken, and the audit fails loudly.

Shadows and pools are private working data: they stay under ``<state>/private/audits``; only
attack statistics are published (they are not DP, and the ledger records the audit as a
non-private use of the dataset).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from privacy import audit as stats

from . import plots
from .attacks import PoolScoring, Shadows, chosen_attacks
from .config import AuditConfig, PrivPromptConfig, parse_config
from .data import Partition, read_partition_split
from .errors import PrivPromptError
from .record import RunRecord, client
from . import randomness
from .methods import MethodContext, PrivateRows, get_method
from .methodkit.classifiers import classifier_for, input_length, label_indices, prompted
from .run_plan import shadow_plan
from .state import make_private_dir, private_file, state_paths


class AuditError(PrivPromptError, ValueError):
    """The audit cannot run as asked (unknown run, no artifact, pool too small)."""


class AuditFailure(RuntimeError):
    """The audit measured more leakage than the run's DP claim allows: the implementation is broken."""


@dataclass
class AuditTarget:
    """What is audited: a trained prompt, the config and partition it was trained with."""

    config: dict
    partition: dict
    prompt_path: str
    method: str
    epsilon: float | None
    delta: float | None
    run_id: str          # the audited MLflow run
    flow_run_id: str
    state_dir: str
    prepared: dict = field(default_factory=dict)  # what the method's prepare returned (POST: the student)

    @property
    def model(self) -> str:
        """The model the audited prompt is used on."""
        return self.spec.extras.published_model(self.cfg, self.prepared)

    @property
    def spec(self):
        """The audited method as registered."""
        return get_method(self.method)

    @cached_property
    def cfg(self) -> PrivPromptConfig:
        return parse_config(self.config)

    @property
    def part(self) -> Partition:
        return Partition(**self.partition)

    def to_dict(self) -> dict:
        return asdict(self)


def audit_dir(target: AuditTarget, audit_id: str) -> Path:
    return make_private_dir(state_paths(target.state_dir).private / "audits" / audit_id)


def check_audit(target: AuditTarget, acfg: AuditConfig) -> dict:
    """Everything that can be checked before any training; returns the pool's sizes."""
    if not Path(target.prompt_path).is_file():
        raise AuditError(f"run {target.run_id} has no prompt artifact to audit (looked for {target.prompt_path})")
    missing = target.spec.extras.missing_prepared(target.prepared)
    if missing:
        raise AuditError(f"run {target.run_id}: the audit's shadows need {missing}")
    if target.cfg.selection.enabled:
        raise AuditError(f"run {target.run_id} selected its settings privately (selection:); the audit's shadows "
                         "would train the configured settings, not the selection, and the audit of a selection is "
                         "not implemented")
    return check_pool_size(target.part, acfg)


def check_pool_size(part: Partition, acfg: AuditConfig) -> dict:
    """The pool's member / non-member counts — of records, or with a user privacy unit of UNITS
    (membership of a person: all their records were in training) —; an error if too few
    non-members for the FPRs.

    From the RELEASED sizes (the training one without its planted canaries, a function of the
    logged seed), never the exact ones: the counts are published (``audit.pool_members``,
    ``mia.*.n_members``, the denominators of every rate). A split holding fewer rows (units) than
    its count gives copies, each copy of a row (unit) in the same shadows (:func:`build_pool`)."""
    sizes = part.sizes
    planted = part.n_canary_units_planted if part.unit != "record" else part.n_canaries_planted
    half = min(sizes.n_train - planted, sizes.n_holdout)
    if acfg.pool_size is not None:
        half = min(half, acfg.pool_size // 2)
    needed = max(math.ceil(1.0 / f) for f in acfg.fprs)
    if half < needed:
        # no count in the message: it is the exact size of a private split (min of train and
        # holdout), and this refusal comes before any charge or audit label
        raise AuditError(
            f"audit pool too small: a TPR at FPR ≤ {min(acfg.fprs):g} needs at least {needed} non-members, more "
            "than the pool holds (audit.pool_size, or the run's training / holdout split; lower audit.fprs, or "
            "give the run more held-out examples)")
    return {"n_members": half, "n_nonmembers": half}


def has_empty_side(part: Partition) -> bool:
    """Whether the audit pool's member side (training rows that are no canary) or its non-member side
    (holdout rows) is EXACTLY empty: the audit then does not run — its absence is an
    audit statistic, like its numbers; a failed flow would withhold the run's DP output on that bit."""
    from .stages import holds_no_row

    if holds_no_row(part.holdout_path):
        return True
    texts, _ = read_partition_split(part.train_path)
    canaries = set(pq.read_table(part.canaries_path).column("text").to_pylist()) if part.n_canaries_planted else set()
    return not any(t not in canaries for t in texts)


def build_pool(target: AuditTarget, acfg: AuditConfig, directory: Path, seed: int) -> dict:
    """Pool parquet (text, label, member) and the shadows' in-mask (K × pool, each column K/2)."""
    sizes = check_audit(target, acfg)
    part = target.part
    rng = np.random.default_rng(seed)
    if part.unit != "record":
        return _build_unit_pool(part, acfg, directory, rng, sizes)
    texts, labels = read_partition_split(part.train_path)
    canaries = set()
    if part.n_canaries_planted:
        canaries = set(pq.read_table(part.canaries_path).column("text").to_pylist())
    candidates = [i for i, t in enumerate(texts) if t not in canaries]  # canaries have their own audit
    members = np.asarray(candidates)[_pool_draw(len(candidates), sizes["n_members"], rng)]
    h_texts, h_labels = read_partition_split(part.holdout_path)
    nonmembers = _pool_draw(len(h_texts), sizes["n_nonmembers"], rng)
    pool_texts = [texts[i] for i in members] + [h_texts[i] for i in nonmembers]
    pool_labels = [labels[i] for i in members] + [h_labels[i] for i in nonmembers]
    member = np.r_[np.ones(len(members), bool), np.zeros(len(nonmembers), bool)]
    n, k = len(pool_texts), acfg.shadows
    # balanced design: for each example a random half of the shadows include it (its copies with it)
    copy_of = _first_copies(list(zip(member.tolist(), [*members.tolist(), *nonmembers.tolist()])))
    mask = (np.argsort(rng.random((k, n)), axis=0) < k // 2)[:, copy_of]
    pool_path, mask_path = directory / "pool.parquet", directory / "shadow_in.npy"
    pq.write_table(pa.table({"text": pool_texts, "label": pool_labels, "member": member.tolist(),
                             "copy_of": copy_of.tolist()}), pool_path)
    np.save(mask_path, mask)
    private_file(pool_path), private_file(mask_path)
    return {"pool_path": str(pool_path), "mask_path": str(mask_path), "n_pool": n, "shadows": k, **sizes}


def _build_unit_pool(part: Partition, acfg: AuditConfig, directory: Path, rng: np.random.Generator,
                     sizes: dict) -> dict:
    """The pool at the unit level: ``n_members`` training units (canary units aside) and
    ``n_nonmembers`` holdout units, each with ALL its records; each UNIT is in a random half of the
    shadows (its records together: a shadow trains on whole units, per unit). The pool file adds
    the column ``unit`` (the pool's own unit index 0..U-1, members first; no digest, no id)."""
    from .data import read_partition_units

    texts, labels = read_partition_split(part.train_path)
    units = read_partition_units(part.train_path)
    h_texts, h_labels = read_partition_split(part.holdout_path)
    h_units = read_partition_units(part.holdout_path)
    train_units = sorted({u for u in units if not u.startswith("canary-")})  # canaries: their own audit
    members = _pool_draw(len(train_units), sizes["n_members"], rng)
    holdout_units = sorted(set(h_units))
    nonmembers = _pool_draw(len(holdout_units), sizes["n_nonmembers"], rng)
    # pool unit j (members first): a unit of the split, or a copy of one (a split with fewer units)
    picked = [(True, train_units[i]) for i in members] + [(False, holdout_units[i]) for i in nonmembers]
    rows_of: dict[tuple[bool, str], list] = {}
    for side, (ts, ys, us) in ((True, (texts, labels, units)), (False, (h_texts, h_labels, h_units))):
        for t, y, u in zip(ts, ys, us):
            rows_of.setdefault((side, u), []).append((t, y))
    rows = [(t, y, j) for j, key in enumerate(picked) for t, y in rows_of[key]]
    pool_units = np.array([r[2] for r in rows], dtype=np.int64)
    member = pool_units < len(members)
    n_units, k = len(members) + len(nonmembers), acfg.shadows
    copy_of = _first_copies(picked)  # per pool unit: the first pool unit of its split's unit
    unit_mask = (np.argsort(rng.random((k, n_units)), axis=0) < k // 2)[:, copy_of]  # each unit in half the shadows
    mask = unit_mask[:, pool_units]  # per row: its unit's
    pool_path, mask_path = directory / "pool.parquet", directory / "shadow_in.npy"
    pq.write_table(pa.table({"text": [r[0] for r in rows], "label": [r[1] for r in rows], "member": member.tolist(),
                             "unit": pool_units.tolist(), "copy_of": copy_of[pool_units].tolist()}), pool_path)
    np.save(mask_path, mask)
    private_file(pool_path), private_file(mask_path)
    return {"pool_path": str(pool_path), "mask_path": str(mask_path), "n_pool": len(rows), "shadows": k,
            "unit_level": True, **sizes}


def _pool_draw(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` of ``n`` rows (units) of a split, in the order drawn: without replacement when the
    split holds enough, else with copies (:func:`tasks.stages.pool_indices`)."""
    from .stages import pool_indices

    return rng.choice(n, size=size, replace=False) if n >= size else pool_indices(n, size, rng)


def _first_copies(keys: list) -> np.ndarray:
    """Per pool item: the index of the first item with the same key (itself when it has no copy
    before it): copies share their shadows, so each row or unit of the split is in half of them."""
    first: dict = {}
    return np.array([first.setdefault(key, i) for i, key in enumerate(keys)], dtype=np.int64)


def _pool_units(pool_path: str) -> np.ndarray | None:
    table = pq.read_table(pool_path)
    return np.asarray(table.column("unit").to_pylist(), dtype=np.int64) if "unit" in table.column_names else None


_POOLS: dict = {}


def _encoded_pool(cfg: PrivPromptConfig, pool_path: str, model: str, template: str | None = None):
    """The pool encoded for ``model`` (and a text prompt's template) once per process (a Dask
    worker reuses it across its shadows)."""
    key = (pool_path, model, cfg.models.max_length, template)
    if key not in _POOLS:
        clf = classifier_for(cfg, model, template)
        table = pq.read_table(pool_path)
        texts, labels = table.column("text").to_pylist(), table.column("label").to_pylist()
        y = label_indices(labels, cfg.data.labels)
        _POOLS[key] = (clf, clf.encode(texts, max_length=input_length(cfg, model, clf)), y,
                       np.asarray(table.column("member").to_pylist(), bool))
    return _POOLS[key]


def pool_scores(cfg: PrivPromptConfig, pool_path: str, model: str, prompt, acfg: AuditConfig) -> dict:
    """Per-example statistics of one prompt on the pool that the chosen attacks read (higher = looks
    like a member): each attack's own (:meth:`tasks.attacks.Attack.statistics`)."""
    clf, prompt = prompted(cfg, model, prompt)
    _, enc, y, _ = _encoded_pool(cfg, pool_path, model, clf.template)
    scoring = PoolScoring(classifier=clf, encoded=enc, labels=y, prompt=prompt,
                          batch_size=cfg.models.eval_batch_size, audit=acfg)
    out = {}
    for attack in chosen_attacks(acfg.attacks):
        out.update(attack.statistics(scoring))
    return out


def method_shadow(config: dict, method_name: str, prepared: dict, state_dir: str, rows: PrivateRows,
                  shadow_seed: int, sizes=None):
    """An audit shadow: the audited method's own ``train`` + ``post_process`` on ``rows`` (pool
    rows), no ledger, no tracking (shadows are private working data). Returns (prompt, steps).

    Calibrated as the audited run was (:func:`tasks.run_plan.shadow_plan` on its released
    ``sizes``, the partition's): the run's noise and sampling rate, not a fresh calibration to
    the whole target on the pool."""
    cfg = parse_config(config)  # its seed stays: models and splits are the audited run's
    method = get_method(method_name)
    index = rows.unit_index()
    plan = shadow_plan(cfg, method_name, sizes, len(rows) if index is None else index[1])
    mctx = MethodContext(cfg, state_paths(state_dir), prepared, randomness.for_shadow(cfg, shadow_seed), shadow_seed)
    trained = method.mechanism.train(mctx, plan, rows)
    post = method.mechanism.post_process(mctx, plan, trained.prompt)
    return post.prompt, trained.steps + post.steps


def shadow_prompt(target: AuditTarget, pool_path: str, idx: np.ndarray, seed: int):
    """A shadow of the audited prompt trained on pool rows ``idx`` by the audited method's own
    ``train`` + ``post_process`` (through the registry): (prompt, training steps)."""
    table = pq.read_table(pool_path)
    texts, labels = table.column("text").to_pylist(), table.column("label").to_pylist()
    units = _pool_units(pool_path)
    if "copy_of" in table.column_names:  # a row (unit) of the split once, whatever copies the pool holds
        copy_of = np.asarray(table.column("copy_of").to_pylist(), dtype=np.int64)
        own = np.arange(len(texts)) if units is None else units
        idx = [i for i in idx if copy_of[i] == own[i]]
    rows = PrivateRows([texts[i] for i in idx], [labels[i] for i in idx],
                       units=None if units is None else [str(units[i]) for i in idx])
    return method_shadow(target.config, target.method, target.prepared, target.state_dir, rows, seed,
                         sizes=target.part.sizes)


def train_shadow(target: AuditTarget, acfg: AuditConfig, pool: dict, index: int, audit_run_id: str) -> dict:
    """Train shadow ``index`` on its half of the pool (:func:`shadow_prompt`), score the whole
    pool, save the scores under private/, log a child run."""
    cfg = target.cfg
    started, started_at = time.perf_counter(), time.time()
    idx = np.flatnonzero(np.load(pool["mask_path"])[index])
    prompt, steps = shadow_prompt(target, pool["pool_path"], idx, seed=cfg.seed * 1000 + 1 + index)
    scores = pool_scores(cfg, pool["pool_path"], target.model, prompt, acfg)
    path = Path(pool["pool_path"]).parent / f"shadow_{index:03d}.npz"
    np.savez(path, **scores)
    private_file(path)
    compute_s = time.perf_counter() - started
    run = RunRecord(client(state_paths(target.state_dir)), audit_run_id).child(
        f"shadow-{index}", {"method": target.method, "stage": "audit-shadow", "shadow": index,
                            "privacy.guarantee": "none"})
    # not len(idx): with copies drawn for a split smaller than its released half, or a person's records
    # under a user unit, the rows a shadow trains on count the exact private sizes; the pool's half is public
    run.log_metrics({"train.steps": steps, "shadow.pool_half": pool["n_members"], "shadow.compute_s": compute_s})
    run.end()
    import os

    from models.backbones import LOAD_COUNTS

    return {"index": index, "scores_path": str(path), "steps": steps, "compute_s": compute_s,
            "started_at": started_at, "ended_at": time.time(), "pid": os.getpid(), "model_loads_in_process": LOAD_COUNTS.get(target.model, 0),
            "pool_encodings_in_process": len(_POOLS)}


def attack_metrics(target: AuditTarget, acfg: AuditConfig, pool: dict, shadow_paths: list[str],
                   out_dir: Path, seed: int) -> tuple[dict, dict]:
    """``mia.<attack>.*`` metrics (with CIs) and ROC curves of every attack on the pool."""
    from .prompts import load_prompt_file

    cfg = target.cfg
    prompt = load_prompt_file(target.prompt_path)
    tgt = pool_scores(cfg, pool["pool_path"], target.model, prompt, acfg)
    member = _encoded_pool(cfg, pool["pool_path"], target.model)[3]
    attacks = chosen_attacks(acfg.attacks)
    shadows = None
    if any(a.needs_shadows for a in attacks):
        in_mask = np.load(pool["mask_path"])[[int(Path(p).stem.split("_")[1]) for p in shadow_paths]]
        shadows = Shadows(statistics=[dict(np.load(p)) for p in shadow_paths], in_mask=in_mask)
    per_attack, reduction = {}, {}
    for attack in attacks:
        for name, scores in attack.scores(tgt, shadows).items():
            per_attack[name], reduction[name] = scores, attack.unit_reduction
    units = _pool_units(pool["pool_path"])
    what = "pool examples"
    if units is not None:  # membership of a unit: its records' log-likelihood ratios summed, other scores averaged
        per_attack = {name: stats.unit_scores(s, units, reduction[name]) for name, s in per_attack.items()}
        member, what = stats.unit_labels(member, units), "pool units"
    metrics, curves, report = {}, {}, {}
    rng = np.random.default_rng(seed)
    for name, scores in per_attack.items():
        m = stats.mia_metrics(scores, member, rng=rng, fprs=tuple(acfg.fprs), confidence=acfg.confidence)
        metrics.update({f"mia.{name}.{k}": v for k, v in m.items()})
        fpr, tpr, _ = stats.roc_curve(scores, member)
        curves[name] = (fpr, tpr, m["auc"])
        report[name] = m
    fig = plots.roc_curve_plot(curves, f"membership inference: {target.method} ({len(member)} {what})")
    roc_path = out_dir / "roc_attacks.png"
    fig.savefig(roc_path, dpi=120, bbox_inches="tight")
    plots.close(fig)
    private_file(roc_path)
    return metrics, {"report": report, "roc_path": str(roc_path)}


def canary_audit(target: AuditTarget, acfg: AuditConfig) -> dict | None:
    """One-run ε lower bound from the partition's canaries (None when it planted none)."""
    from models.scoring import per_example_loss

    from .prompts import load_prompt_file

    part = target.part
    if not Path(part.canaries_path).is_file():
        return None
    cfg = target.cfg
    table = pq.read_table(part.canaries_path)
    texts, labels = table.column("text").to_pylist(), table.column("label").to_pylist()
    planted = np.asarray(table.column("planted").to_pylist(), bool)
    clf, prompt = prompted(cfg, target.model, load_prompt_file(target.prompt_path))
    y = label_indices(labels, cfg.data.labels)
    enc = clf.encode(texts, max_length=input_length(cfg, target.model, clf))
    scores = -per_example_loss(clf, enc, y, prompt, cfg.models.eval_batch_size).numpy()
    if "unit" in table.column_names:  # canary UNITS (a user unit): a unit's score is its records' mean
        units = np.asarray(table.column("unit").to_pylist(), dtype=np.int64)
        scores, planted = stats.unit_scores(scores, units, "mean"), stats.unit_labels(planted, units)
    m = len(scores)
    ks = [(k, k) for k in sorted({max(1, m // 20), max(1, m // 10), max(1, m // 4)}) if 2 * k <= m]
    delta = target.delta or 0.0
    result = stats.best_one_run_audit(scores, planted, ks=ks, delta=delta, confidence=acfg.confidence)
    result.update({"num_canaries": m, "num_planted": int(planted.sum()), "delta": delta})
    claimed = target.epsilon
    result["claimed_epsilon"] = claimed
    if claimed is not None and result["epsilon_lower_bound"] > claimed:
        raise AuditFailure(
            f"canary audit of run {target.run_id}: empirical ε lower bound {result['epsilon_lower_bound']:.3f} "
            f"exceeds the claimed ε = {claimed:.3f} at significance {1 - acfg.confidence:g}: "
            "the DP implementation is broken")
    return result


def write_results(target: AuditTarget, audit_run: RunRecord, metrics: dict, details: dict,
                  canary: dict | None, shadows: list[dict]) -> dict:
    """Publish the statistics to the audit child run and to the audited run's record."""
    out = dict(metrics)
    if canary is not None:
        out["audit.epsilon_lower_bound"] = canary["epsilon_lower_bound"]
    for run in (audit_run, RunRecord(audit_run.mlflow, target.run_id)):
        run.log_metrics(out)
    audit_run.log_json({"attacks": details.get("report", {}), "canary_audit": canary,
                        "shadows": [{k: s[k] for k in ("index", "steps", "compute_s", "started_at", "ended_at",
                                                       "pid", "model_loads_in_process",
                                                       "pool_encodings_in_process")} for s in shadows]},
                       "audit/audit.json")
    if details.get("roc_path"):
        audit_run.log_file(details["roc_path"], "plots")
        RunRecord(audit_run.mlflow, target.run_id).log_file(details["roc_path"], "plots")
    return out
