"""The prompt-tuning stages as plain functions (testable without Prefect).

Each stage reads private partitions from ``<state>/private``, calls ``models/`` and ``privacy/``,
writes its child run of the run record, and returns paths and numbers only — never text.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from privacy import accountant as acct
from privacy import audit
from privacy import events as ev
from privacy.ledger import Ledger

from . import plots
from .config import PrivPromptConfig, parse_config
from .data import Partition, read_partition_split
from .errors import ConfigError
from .record import RunRecord, client
from .state import StatePaths, state_paths

Progress = Callable[[int, int, float | None], None]


@dataclass
class StageContext:
    """What every stage of one flow run shares (JSON-able: it is a task parameter)."""

    config: dict
    state_dir: str
    partition: dict
    parent_run_id: str
    flow_run_id: str
    outputs: dict = field(default_factory=dict)

    @property
    def cfg(self) -> PrivPromptConfig:
        return parse_config(self.config)

    @property
    def paths(self) -> StatePaths:
        return state_paths(self.state_dir)

    @property
    def part(self) -> Partition:
        return Partition(**self.partition)

    @property
    def parent(self) -> RunRecord:
        return RunRecord(client(self.paths), self.parent_run_id)

    @property
    def output_dir(self) -> Path:
        """Where this run's publishable (DP) outputs are kept locally."""
        d = self.paths.root / "outputs" / self.flow_run_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def private_run_dir(self) -> Path:
        d = self.paths.private / "runs" / self.flow_run_id
        d.mkdir(parents=True, exist_ok=True)
        return d


def model_alias(model_name: str) -> str:
    """A metric-safe short name of a model: the last path / hub-id component."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name.rstrip("/").split("/")[-1]) or "model"


def resolve_delta(cfg: PrivPromptConfig, n_train: int) -> float:
    return cfg.privacy.target_delta or min(1e-5, 1.0 / (10 * n_train))


# ---- models ----------------------------------------------------------------------------------

_CLASSIFIERS: dict = {}


def classifier_for(cfg: PrivPromptConfig, model_name: str):
    """The frozen classifier of ``model_name`` for the config's labels (cached per process)."""
    from models.classifiers import build_classifier
    from models.registry import load_backbone

    key = (model_name, tuple(cfg.data.labels), json.dumps(cfg.models.label_descriptions, sort_keys=True),
           cfg.models.template, cfg.seed)
    if key not in _CLASSIFIERS:
        backbone = load_backbone(model_name, seed=cfg.seed)
        _CLASSIFIERS[key] = build_classifier(backbone, list(cfg.data.labels),
                                             cfg.models.label_descriptions or None, cfg.models.template)
    return _CLASSIFIERS[key]


def label_indices(names: list[str], labels: list[str]):
    """Label names → a long tensor of their indices in the config's ``labels``."""
    import torch

    index = {name: i for i, name in enumerate(labels)}
    return torch.tensor([index[n] for n in names], dtype=torch.long)


def encode_split(classifier, path: str, labels: list[str], max_length: int, limit: int | None = None,
                 rng: np.random.Generator | None = None):
    texts, names = read_partition_split(path)
    idx = np.arange(len(texts))
    if limit is not None and len(idx) > limit:
        idx = np.sort((rng or np.random.default_rng(0)).choice(len(idx), size=limit, replace=False))
    y = label_indices([names[i] for i in idx], labels)
    return classifier.encode([texts[i] for i in idx], max_length=max_length), y


def _load_prompt(path: str | None):
    if path is None:
        return None
    from models.soft_prompt import load_prompt

    tensor, _ = load_prompt(path)
    return tensor


def _check_prompt_fits(classifier, prompt, model_name: str) -> None:
    if prompt is not None and prompt.shape[-1] != classifier.embed_dim:
        raise ConfigError(f"a soft prompt of width {prompt.shape[-1]} cannot be used with model "
                          f"{model_name!r} (embedding width {classifier.embed_dim})")


# ---- stages ----------------------------------------------------------------------------------

def ensure_dataset(ledger: Ledger, part: Partition, cap: float, delta: float) -> dict:
    """Register the partition's dataset in the ledger. A lower cap in the config lowers the
    stored one (recorded); a higher cap is refused: raising a budget is a deliberate act."""
    from privacy.ledger import UnknownDatasetError

    try:
        row = ledger.dataset(part.fingerprint)
    except UnknownDatasetError:
        return ledger.register_dataset(part.fingerprint, part.dataset, cap, delta)
    if cap < row["epsilon_cap"]:
        return ledger.register_dataset(part.fingerprint, row["name"], cap, row["delta"], allow_cap_change=True)
    if cap > row["epsilon_cap"] + 1e-12:
        raise ConfigError(
            f"privacy.dataset_epsilon_cap={cap:g} is above the cap ε={row['epsilon_cap']:g} already set for "
            f"dataset {part.dataset!r} (fingerprint {part.fingerprint[:12]}); caps are only lowered from a run")
    return row


def evaluate_stage(ctx: StageContext, prompt_path: str | None, name: str, guarantee: str) -> dict:
    """Accuracy on the private test split, on the target model (and the local one if different)."""
    from models.scoring import accuracy

    cfg = ctx.cfg
    prompt = _load_prompt(prompt_path)
    started = time.perf_counter()
    out = {}
    models = {"target": cfg.models.target_name}
    if cfg.models.target_name != cfg.models.local:
        models["local"] = cfg.models.local
    aliases = {}
    for alias, model_name in models.items():
        clf = classifier_for(cfg, model_name)
        _check_prompt_fits(clf, prompt, model_name)
        enc, y = encode_split(clf, ctx.part.test_path, cfg.data.labels, cfg.models.max_length)
        out[alias] = accuracy(clf, enc, y, prompt, batch_size=cfg.models.eval_batch_size)
        aliases[model_alias(model_name)] = out[alias]
    compute_s = time.perf_counter() - started
    child = ctx.parent.child(f"evaluate:{name}", {"method": name, "stage": "evaluate",
                                                   "privacy.guarantee": guarantee})
    child.log_metrics({"test.accuracy": out["target"], **{f"test.accuracy.{k}": v for k, v in aliases.items()}})
    child.end()
    return {"target": out["target"], "per_model": aliases, "compute_s": compute_s}


@dataclass
class TrainingPlan:
    """How a method trains on ``n`` examples: its settings and, for DP-SGD, the calibrated
    noise and the event the accountant composes."""

    method: str
    n: int
    delta: float
    steps: int | None = None
    sample_rate: float | None = None
    noise_multiplier: float | None = None

    @property
    def private(self) -> bool:
        return self.noise_multiplier is not None

    @property
    def event(self):
        return ev.dpsgd_event(self.sample_rate, self.noise_multiplier, self.steps) if self.private else None


def plan_training(cfg: PrivPromptConfig, method: str, n: int, delta: float) -> TrainingPlan:
    mcfg = getattr(cfg.methods, method)
    if method != "prompt_dpsgd":
        return TrainingPlan(method, n, delta)
    q = min(1.0, mcfg.batch_size / n)
    steps = max(1, math.ceil(mcfg.epochs / q))
    sigma = acct.calibrate_noise_multiplier(cfg.privacy.target_epsilon, delta, q, steps)
    return TrainingPlan(method, n, delta, steps=steps, sample_rate=q, noise_multiplier=sigma)


def fit_prompt(cfg: PrivPromptConfig, plan: TrainingPlan, classifier, encoded, labels,
               progress: Progress | None = None, seed: int | None = None):
    """Train the method's soft prompt on already-encoded examples (the one training routine
    that target runs and audit shadows share). Returns ``models`` ``TrainResult``."""
    from models.dp_prompt_training import DPConfig, PromptTrainingConfig, train_prompt

    mcfg = getattr(cfg.methods, plan.method)
    tc = PromptTrainingConfig(n_tokens=mcfg.n_tokens, lr=mcfg.lr, epochs=mcfg.epochs,
                              batch_size=mcfg.batch_size, max_length=cfg.models.max_length,
                              seed=cfg.seed if seed is None else seed, init_words=mcfg.init)
    dp = None
    if plan.private:
        dp = DPConfig(noise_multiplier=plan.noise_multiplier, max_grad_norm=cfg.privacy.max_grad_norm,
                      sample_rate=plan.sample_rate)
        tc.steps = plan.steps
    result = train_prompt(classifier, encoded, labels, tc, dp=dp, progress=progress, seed=tc.seed)
    if plan.private and result.steps != plan.steps:
        raise RuntimeError(f"DP training took {result.steps} steps, {plan.steps} were accounted")
    return result


def train_stage(ctx: StageContext, method: str, progress: Progress | None = None) -> dict:
    """Train a soft prompt: ``prompt_dpsgd`` (DP-SGD, ledger-charged) or ``prompt_sgd``
    (non-private: recorded in the ledger as such, its prompt stays under private/)."""
    from models.soft_prompt import save_prompt

    cfg, part, paths = ctx.cfg, ctx.part, ctx.paths
    run_key = f"{ctx.flow_run_id}:{method}"
    ledger = Ledger(paths.ledger)
    delta = resolve_delta(cfg, part.n_train)
    ensure_dataset(ledger, part, cfg.privacy.dataset_epsilon_cap, delta)
    plan = plan_training(cfg, method, part.n_train, delta)
    child = ctx.parent.child(method, {"method": method, "stage": "train",
                                      "privacy.guarantee": "dp" if plan.private else "none"})
    try:
        if plan.private:
            # reserve the declared spend BEFORE private data is read; a retry reuses this entry
            reservation = ledger.reserve(part.fingerprint, run_key, plan.event,
                                         description=f"{method} flow run {ctx.flow_run_id}")
        else:
            ledger.record_nonprivate(part.fingerprint, run_key, f"{method}: non-private training, no DP")

        started = time.perf_counter()
        clf = classifier_for(cfg, cfg.models.local)
        enc, y = encode_split(clf, part.train_path, cfg.data.labels, cfg.models.max_length)
        result = fit_prompt(cfg, plan, clf, enc, y, progress=progress)
        compute_s = time.perf_counter() - started
        history = result.history

        metrics = {"train.steps": result.steps, "train.empty_batches": result.empty_batches}
        info = {"method": method, "steps": result.steps, "compute_s": compute_s, "private": plan.private}
        if plan.private:
            ledger.commit(run_key, plan.event)
            spend = acct.spend(plan.event, delta)
            prompt_path = ctx.output_dir / f"{method}.safetensors"
            save_prompt(prompt_path, result.prompt, {
                "method": method, "model": cfg.models.local, "privacy.epsilon": f"{spend.epsilon:.6f}",
                "privacy.delta": f"{delta:.3g}", "dataset.fingerprint": part.fingerprint})
            params = {"dpsgd.sample_rate": plan.sample_rate, "dpsgd.noise_multiplier": plan.noise_multiplier,
                      "dpsgd.steps": plan.steps, "dpsgd.max_grad_norm": cfg.privacy.max_grad_norm}
            child.log_params(params)
            metrics.update({"privacy.epsilon": spend.epsilon, "privacy.delta": delta,
                            "privacy.epsilon_rdp": spend.epsilon_rdp})
            child.log_file(prompt_path, "prompt")
            fig = plots.training_curve(history, f"{method}: batch loss (private data, not noised)")
            child.log_figure(fig, "plots/training_curve.png")
            fig_path = ctx.output_dir / f"{method}_training_curve.png"
            fig.savefig(fig_path, dpi=120, bbox_inches="tight")
            plots.close(fig)
            info.update({"prompt_path": str(prompt_path), "params": params, "spend": spend.to_dict(),
                         "event": ev.event_to_dict(plan.event), "reserved_new": reservation.new,
                         "training_curve": str(fig_path)})
        else:
            # non-private: the prompt stays under private/, only metrics are published
            prompt_path = ctx.private_run_dir / f"{method}.safetensors"
            save_prompt(prompt_path, result.prompt, {"method": method, "privacy.guarantee": "none"})
            info["prompt_path"] = str(prompt_path)
        losses = [h["loss"] for h in history if h.get("loss") is not None]
        if losses:
            metrics["train.loss_last10"] = float(np.mean(losses[-10:]))
        child.log_metrics(metrics)
        child.end()
        return info
    except BaseException:
        child.end(ok=False)
        raise


def loss_mia_stage(ctx: StageContext, prompt_path: str | None, name: str, guarantee: str) -> dict:
    """Loss-threshold membership inference (Privacy-Flat §4.2): members = training partition,
    non-members = held-out examples; score = −loss. Returns ``mia.loss.*`` metrics."""
    from models.scoring import per_example_loss

    started = time.perf_counter()
    cfg, part = ctx.cfg, ctx.part
    clf = classifier_for(cfg, cfg.models.local)
    prompt = _load_prompt(prompt_path)
    rng = np.random.default_rng(cfg.seed + 17)
    n = cfg.mia.max_examples
    enc_in, y_in = encode_split(clf, part.train_path, cfg.data.labels, cfg.models.max_length, n, rng)
    enc_out, y_out = encode_split(clf, part.holdout_path, cfg.data.labels, cfg.models.max_length, n, rng)
    loss_in = per_example_loss(clf, enc_in, y_in, prompt, cfg.models.eval_batch_size).numpy()
    loss_out = per_example_loss(clf, enc_out, y_out, prompt, cfg.models.eval_batch_size).numpy()
    scores = -np.concatenate([loss_in, loss_out])
    member = np.concatenate([np.ones(len(loss_in), bool), np.zeros(len(loss_out), bool)])
    stats = audit.mia_metrics(scores, member, rng=np.random.default_rng(cfg.seed))
    compute_s = time.perf_counter() - started
    metrics = {f"mia.loss.{k}": v for k, v in stats.items()}
    fpr, tpr, _ = audit.roc_curve(scores, member)
    child = ctx.parent.child(f"mia:{name}", {"method": name, "stage": "audit", "attack": "loss",
                                             "privacy.guarantee": guarantee})
    child.log_metrics(metrics)
    fig = plots.roc_curve_plot({f"{name} loss attack": (fpr, tpr, stats["auc"])}, f"loss-threshold MIA: {name}")
    child.log_figure(fig, "plots/roc_loss.png")
    fig_path = ctx.output_dir / f"{name}_roc_loss.png"
    fig.savefig(fig_path, dpi=120, bbox_inches="tight")
    plots.close(fig)
    child.end()
    return {"metrics": metrics, "roc_plot": str(fig_path), "compute_s": compute_s}
