"""The prompt-tuning stages as plain functions (testable without Prefect).

Each stage reads private partitions from ``<state>/private``, calls ``models/`` and ``privacy/``,
writes its child run of the run record, and returns paths and numbers only — never text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from privacy import audit

from . import plots
from .config import PrivPromptConfig
from .data import Partition, read_partition_split
from .errors import ConfigError
from .methodkit.classifiers import encode_split, input_length, pool_indices, prompted
from .record import RunRecord, client
from .prompts import load_prompt_file
from .state import StatePaths, make_private_dir, state_paths

Progress = Callable[[int, int, float | None], None]

if TYPE_CHECKING:
    from .methods import MethodContext


@dataclass(frozen=True)
class StageContext:
    """What every stage of one flow run shares: the config the flow parsed once (frozen: read,
    never written, never parsed again by a stage), the state folder, the partition and the run
    ids. A task parameter: it pickles whole (a Dask worker gets the parsed config) and holds no
    private text (the partition's manifest: paths and its released sizes; Prefect stores no task
    parameter values, and hashes them only for its cache keys)."""

    cfg: PrivPromptConfig
    state_dir: str
    partition: dict
    parent_run_id: str
    flow_run_id: str
    outputs: dict = field(default_factory=dict)
    # the methods whose checks that need no private data the flow ran already, with what their
    # ``prepare`` returned (tasks.preflight): the door does not run them a second time
    preflighted: tuple[str, ...] = ()

    @classmethod
    def for_run(cls, cfg: PrivPromptConfig, paths: StatePaths, partition: dict, parent_run_id: str,
                flow_run_id: str) -> "StageContext":
        """The context of a flow run of ``cfg`` (its config parsed already: not parsed again)."""
        return cls(cfg=cfg, state_dir=str(paths.root), partition=partition, parent_run_id=parent_run_id,
                   flow_run_id=flow_run_id)

    @property
    def config(self) -> dict:
        """The config as JSON (what a run record or a private file keeps): a dump, not a parse."""
        return self.cfg.model_dump(mode="json")

    def method_context(self, prepared: dict, dataset_key: str | None = None) -> "MethodContext":
        """A method's view of this run (no tracking, no orchestration), its outputs under ``outputs/``."""
        from .methods import MethodContext
        from .randomness import for_config

        cfg = self.cfg
        return MethodContext(cfg, self.paths, prepared, for_config(cfg), cfg.seed, self.output_dir, dataset_key)

    @property
    def paths(self) -> StatePaths:
        return state_paths(self.state_dir, self.cfg.ledger.url)

    @property
    def part(self) -> Partition:
        return Partition(**self.partition)

    @property
    def parent(self) -> RunRecord:
        return RunRecord(client(self.paths), self.parent_run_id)

    @property
    def output_dir(self) -> Path:
        """Where this run's publishable (DP) outputs are kept locally."""
        return make_private_dir(self.paths.root / "outputs" / self.flow_run_id)

    @property
    def private_run_dir(self) -> Path:
        return make_private_dir(self.paths.private / "runs" / self.flow_run_id)


def model_alias(model_name: str) -> str:
    """A metric-safe short name of a model: the last path / hub-id component."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name.rstrip("/").split("/")[-1]) or "model"


# ---- models ----------------------------------------------------------------------------------

def _check_prompt_fits(classifier, prompt, model_name: str) -> None:
    import torch

    from models.prompts.lora import check_fits, is_lora
    from models.prompts.prefix import is_prefix, prefix_shape

    if is_lora(prompt):
        try:
            check_fits(classifier.backbone.model, prompt)
        except ValueError as exc:
            raise ConfigError(f"{exc}: it cannot be used with model {model_name!r}") from None
        return
    if is_prefix(prompt):
        expected = prefix_shape(classifier.backbone.model, prompt.shape[-2])
        if tuple(prompt.shape) != expected:
            raise ConfigError(f"a prefix of shape {tuple(prompt.shape)} cannot be used with model {model_name!r} "
                              f"(its prefixes are {expected}: layers, keys/values, tokens, key/value width)")
        return
    if isinstance(prompt, torch.Tensor) and prompt.shape[-1] != classifier.embed_dim:
        raise ConfigError(f"a soft prompt of width {prompt.shape[-1]} cannot be used with model "
                          f"{model_name!r} (embedding width {classifier.embed_dim})")


# ---- stages ----------------------------------------------------------------------------------

def evaluation_models(cfg: PrivPromptConfig) -> dict[str, str]:
    """Where a prompt is evaluated by default: the target, and the local model if different."""
    models = {"target": cfg.models.target_name}
    if cfg.models.target_name != cfg.models.local:
        models["local"] = cfg.models.local
    return models


def evaluate_stage(ctx: StageContext, prompt_path: str | None, name: str, guarantee: str,
                   models: dict[str, str] | None = None) -> dict:
    """Accuracy on the private test split of the prompt at ``prompt_path`` on ``models``
    (alias → model; default: the target, and the local model if different)."""
    from models.scoring import accuracy_by_class

    cfg = ctx.cfg
    started = time.perf_counter()
    out, aliases, by_class = {}, {}, {}
    own = _own_evaluation(ctx, name, prompt_path)
    if own is not None:  # the method evaluates its prompt its own way (RAPT: privatized inputs)
        out["target"] = aliases[model_alias(cfg.models.local)] = own
    else:
        prompt = load_prompt_file(prompt_path)
        for alias, model_name in (models or evaluation_models(cfg)).items():
            clf, forward_prompt = prompted(cfg, model_name, prompt)
            _check_prompt_fits(clf, forward_prompt, model_name)
            enc, y = encode_split(clf, ctx.part.test_path, cfg.data.labels, input_length(cfg, model_name, clf))
            scores = accuracy_by_class(clf, enc, y, forward_prompt, batch_size=cfg.models.eval_batch_size)
            out[alias] = aliases[model_alias(model_name)] = scores["accuracy"]
            if alias == "target":
                by_class = class_metrics(scores, cfg.data.labels)
    compute_s = time.perf_counter() - started
    child = ctx.parent.child(f"evaluate:{name}", {"method": name, "stage": "evaluate",
                                                   "privacy.guarantee": guarantee})
    child.log_metrics({"test.accuracy": out["target"], **{f"test.accuracy.{k}": v for k, v in aliases.items()},
                       **by_class})
    child.end()
    return {"target": out["target"], "per_model": aliases, "by_class": by_class, "compute_s": compute_s}


def class_metrics(scores: dict, labels: list[str]) -> dict[str, float]:
    """``test.balanced_accuracy`` and ``test.recall.<label>`` (each label present in the test split)
    of :func:`models.scoring.accuracy_by_class`'s answer."""
    return {"test.balanced_accuracy": scores["balanced_accuracy"],
            **{f"test.recall.{labels[c]}": r for c, r in sorted(scores["recall"].items())}}


def endpoint_evaluate_stage(ctx: StageContext, prompt_path: str, name: str, endpoint: dict) -> dict:
    """Accuracy of a text prompt on a remote OpenAI-compatible completions endpoint. It sends the
    TEST split only, and only when the config marks it shareable; training rows never leave."""
    import os

    from models.prompts.endpoint import CompletionsClient, predict_labels

    cfg = ctx.cfg
    if not cfg.data.test_shareable:  # also refused at config time; checked again where it is sent
        raise ConfigError("data.test_shareable is false: the test split may not be sent to an endpoint")
    private = ctx.paths.private.resolve()
    if Path(prompt_path).resolve().is_relative_to(private):  # also refused at config time (guarantee none)
        raise ConfigError(f"{name}: its prompt is kept on the private side (no formal guarantee): it is never sent "
                          "to an endpoint")
    prompt = load_prompt_file(prompt_path)
    if getattr(prompt, "kind", None) != "text":
        raise ConfigError(f"{name}: only a text prompt can be sent to an endpoint")
    texts, names = read_partition_split(ctx.part.test_path)
    template = prompt.template(cfg.models.template or "Input: {text}\n\nOutput:")
    key = os.environ.get(endpoint["api_key_env"]) if endpoint.get("api_key_env") else None
    client = CompletionsClient(endpoint["base_url"], endpoint["model"], api_key=key,
                               top_logprobs=endpoint.get("top_logprobs", 5),
                               label_token_ids=endpoint.get("label_token_ids"))
    started = time.perf_counter()
    picks = predict_labels(client.complete([template.replace("{text}", t) for t in texts]),
                           [" " + label for label in cfg.data.labels], text_first=client.biased)
    correct = sum(p is not None and cfg.data.labels[p] == y for p, y in zip(picks, names))
    acc = correct / len(texts)
    child = ctx.parent.child(f"evaluate:{name}@{endpoint['alias']}", {"method": name, "stage": "evaluate",
                                                                     "endpoint": endpoint["base_url"]})
    child.log_metrics({f"test.accuracy.{endpoint['alias']}": acc, "test.unparsed": float(picks.count(None))})
    child.end()
    return {"accuracy": acc, "compute_s": time.perf_counter() - started, "unparsed": picks.count(None)}


def own_evaluation(name: str):
    """Method ``name``'s own evaluation of its published prompt (``Extras.evaluate_published``:
    RAPT on privatized inputs); None for the generic one, or a name that is no registered method
    (a variant, a model alias)."""
    from .methods import METHODS

    return METHODS.items[name].extras.evaluate_published if name in METHODS.names() else None


def _own_evaluation(ctx: StageContext, name: str, prompt_path: str | None) -> float | None:
    own = own_evaluation(name)
    if prompt_path is None or own is None:
        return None
    return own(ctx, prompt_path, ctx.method_context({}, ctx.part.dataset_key))


def mia_pool_sizes(part: Partition, max_examples: int) -> tuple[int, int]:
    """(members, non-members) of the in-flow loss attack: ``mia.max_examples``, or fewer when a
    split's RELEASED size (``data.n_train`` with its canaries, ``data.n_holdout``; units with a user
    unit) is smaller: public numbers, so the published ``mia.loss.n_members`` /
    ``n_nonmembers`` / ``precision_base_rate`` (and the denominators of AUC and TPR) tell no exact
    split size. A split holding fewer rows than that gives copies (:func:`pool_indices`)."""
    sizes = part.sizes
    return min(max_examples, sizes.n_train), min(max_examples, sizes.n_holdout)


def supported_fprs(n_nonmembers: int, fprs=(0.01, 0.001)) -> tuple[float, ...]:
    """The FPRs a TPR can be reported at: at least 1/FPR non-members are needed."""
    return tuple(f for f in fprs if n_nonmembers * f >= 1)


def holds_no_row(path: str) -> bool:
    """Whether a partition split file is EXACTLY empty (private side: decides only an audit's "not run")."""
    import pyarrow.parquet as pq

    return pq.read_metadata(path).num_rows == 0


def loss_mia_stage(ctx: StageContext, prompt_path: str | None, name: str, guarantee: str,
                   model: str | None = None) -> dict:
    """Loss-threshold membership inference (Privacy-Flat §4.2): members = training partition,
    non-members = held-out examples; score = −loss. It reads training records without noise, so
    its statistics are AUDIT statistics (not DP): the ledger records the use as non-private and
    the child run is labelled so. Returns ``mia.loss.*`` metrics."""
    from models.scoring import per_example_loss

    started = time.perf_counter()
    cfg, part = ctx.cfg, ctx.part
    ctx.paths.open_ledger().record_nonprivate(
        part.dataset_key, f"{ctx.flow_run_id}:mia:{name}",
        f"loss-threshold membership inference on {name}'s prompt: audit statistics (not DP)")
    model = model or cfg.models.local
    if holds_no_row(part.train_path) or holds_no_row(part.holdout_path):
        # an EXACTLY empty member or non-member side: no attack, an audit statistic that
        # says so — never a failed flow, which would withhold the run's DP output on one record's bit
        child = ctx.parent.child(f"mia:{name}", {"method": name, "stage": "audit", "attack": "loss",
                                                 "privacy.guarantee": guarantee, "audit.not_run": "a split holds no row",
                                                 "statistic": "audit (not DP): computed on training records"})
        child.end()
        return {"metrics": {}, "roc_plot": None, "compute_s": time.perf_counter() - started}
    clf, prompt = prompted(cfg, model, load_prompt_file(prompt_path))
    rng = np.random.default_rng(cfg.seed + 17)
    n_in, n_out = mia_pool_sizes(part, cfg.mia.max_examples)  # released, never exact
    length = input_length(cfg, model, clf)
    enc_in, y_in = encode_split(clf, part.train_path, cfg.data.labels, length, rng=rng, size=n_in)
    enc_out, y_out = encode_split(clf, part.holdout_path, cfg.data.labels, length, rng=rng, size=n_out)
    loss_in = per_example_loss(clf, enc_in, y_in, prompt, cfg.models.eval_batch_size).numpy()
    loss_out = per_example_loss(clf, enc_out, y_out, prompt, cfg.models.eval_batch_size).numpy()
    scores = -np.concatenate([loss_in, loss_out])
    member = np.concatenate([np.ones(len(loss_in), bool), np.zeros(len(loss_out), bool)])
    stats = audit.mia_metrics(scores, member, rng=np.random.default_rng(cfg.seed),
                              fprs=supported_fprs(len(loss_out)))
    stats.update(audit.precision_at_lowest_loss(scores, member, 0.01))
    compute_s = time.perf_counter() - started
    metrics = {f"mia.loss.{k}": v for k, v in stats.items()}
    fpr, tpr, _ = audit.roc_curve(scores, member)
    child = ctx.parent.child(f"mia:{name}", {"method": name, "stage": "audit", "attack": "loss",
                                             "privacy.guarantee": guarantee,
                                             "statistic": "audit (not DP): computed on training records"})
    child.log_metrics(metrics)
    fig = plots.roc_curve_plot({f"{name} loss attack": (fpr, tpr, stats["auc"])}, f"loss-threshold MIA: {name}")
    child.log_figure(fig, "plots/roc_loss.png")
    fig_path = ctx.output_dir / f"{name}_roc_loss.png"
    fig.savefig(fig_path, dpi=120, bbox_inches="tight")
    plots.close(fig)
    child.end()
    return {"metrics": metrics, "roc_plot": str(fig_path), "compute_s": compute_s}
