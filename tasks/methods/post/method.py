"""POST (Wang et al. 2024): distil the target model into a small student on public text,
DP soft-prompt tuning on the student with the private data, transfer the prompt back to the
target with public data only.

* ``prepare``: the student for (teacher, settings, public data), cached in the MLflow model
  registry and reused (public data only).
* ``train``: DP-SGD on the student — the only stage that reads private rows.
* ``post_process``: transfer on public texts (a fixed number of steps, or selection on held-out
  public texts): a function of the DP prompt and public data alone, so it keeps the guarantee.
* ``variants`` (an extra): Full ZS, Compressed PT, Direct Transfer and (opt-in) Full PT for the paper's table,
  which the platform's variants table shows.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

from pydantic import Field

from ...methodkit.prompt_methods import NON_PRIVATE_SOFT_PROMPT, NonPrivateSoftPrompt
from ...methodkit.transfer import transfer_on_public
from ...schema import Block, DPSGDConfig
from ...state import digest_key
from .. import register_method
from ..base import (Extras, Mechanism, MethodPlan, MethodSpec, PostProcessed, Trained, Traits, Variant, budget,
                    dp_unless_debug, settings_of)

STUDENT_TAG = "privprompt.student_key"
NAMES = {"full_zs": "Full ZS", "full_pt": "Full PT", "compressed_pt": "Compressed PT",
         "direct_transfer": "Direct Transfer"}


class DistillConfig(Block):
    student_layers: int = Field(2, gt=0)
    steps: int = Field(300, gt=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(5e-4, gt=0)
    alpha_ce: float = Field(0.5, ge=0)
    alpha_lm: float = Field(0.5, ge=0)
    alpha_cos: float = Field(1.0, ge=0)


class TransferConfig(Block):
    steps: int = Field(200, gt=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(1e-3, gt=0)
    alpha: float = Field(0.5, ge=0, le=1, description="weight of the Δ-logit KL term")
    select_every: int = Field(0, ge=0, description="0: keep the prompt after `steps`; N: every N steps score "
                              "it by the transfer loss on held-out PUBLIC texts and keep the best")
    select_size: int = Field(200, gt=0, description="public texts held out for that selection")


class PostConfig(Block):
    enabled: bool = False
    tuning: DPSGDConfig = Field(default_factory=DPSGDConfig, description="DP soft-prompt tuning on the student")
    distill: DistillConfig = Field(default_factory=DistillConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    full_pt: bool = Field(False, description="non-private tuning on the target (an upper bound; opt-in; "
                                             "settings of methods.prompt_sgd)")


# ---- public data and the student ---------------------------------------------------------------

def student_key(cfg, public: list[str]) -> str:
    d = cfg.methods.post.distill
    return digest_key({"teacher": cfg.models.target_name, "distill": d.model_dump(), "seed": cfg.seed,
                       "max_length": cfg.models.max_length,
                       "public": hashlib.sha256("\x1e".join(public).encode()).hexdigest()})


def distill_student(ctx, progress=None) -> dict:
    """The student for (teacher, settings, public data): reused when a registered version with
    the same key exists, else built from the teacher's first and last layers and distilled."""
    from mlflow.exceptions import MlflowException

    from .distill import DistillConfig as ModelDistillConfig
    from .distill import build_student, distill, freeze, save_student
    from models.backbones import load_backbone

    from ...data import public_texts

    cfg, paths = ctx.cfg, ctx.paths
    texts = public_texts(cfg, paths.private)
    key = student_key(cfg, texts)
    directory = paths.root / "models" / "students" / key
    model_name = f"privprompt-student-{cfg.models.target_name.replace('/', '_')}"
    mlflow = ctx.parent.mlflow
    if (directory / "privprompt_student.json").is_file():
        versions = mlflow.search_model_versions(f"name = '{model_name}' and tags.`{STUDENT_TAG}` = '{key}'")
        if versions:
            return {"student_dir": str(directory), "cached": True, "compute_s": 0.0, "key": key,
                    "registered": f"{model_name}/{versions[0].version}"}
    started = time.perf_counter()
    d = cfg.methods.post.distill
    teacher = load_backbone(cfg.models.target_name, seed=cfg.seed,
                            placement=cfg.models.placement_of(cfg.models.target_name))
    student = build_student(teacher, d.student_layers, seed=cfg.seed)
    result = distill(teacher, student, texts, ModelDistillConfig(
        steps=d.steps, batch_size=d.batch_size, lr=d.lr, max_length=cfg.models.max_length,
        alpha_ce=d.alpha_ce, alpha_lm=d.alpha_lm, alpha_cos=d.alpha_cos, seed=cfg.seed),
        progress=None if progress is None else (lambda step, total, *_: progress(step, total)))
    freeze(student)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_student(student, tmp)
    shutil.rmtree(directory, ignore_errors=True)  # an unregistered leftover of an interrupted run
    tmp.replace(directory)  # atomic: a student folder is complete or absent
    compute_s = time.perf_counter() - started
    run = ctx.parent.child("distill", {"method": "post", "stage": "distill", "privacy.guarantee": "none",
                                       "data": "public only"})
    losses = [h["loss"] for h in result.history if h.get("loss") is not None]  # public-data losses
    run.log_params({"distill.student_layers": d.student_layers, "distill.steps": d.steps,
                    "distill.public": cfg.public.name, "distill.key": key})
    run.log_metrics({"distill.loss_first": losses[0] if losses else None,
                     "distill.loss_last": losses[-1] if losses else None, "distill.compute_s": compute_s})
    mlflow.log_artifacts(run.run_id, str(directory), "student")
    try:
        mlflow.create_registered_model(model_name)
    except MlflowException as err:
        if "already exists" not in str(err).lower() and "RESOURCE_ALREADY_EXISTS" not in str(err):
            raise
    source = f"{mlflow.get_run(run.run_id).info.artifact_uri}/student"
    version = mlflow.create_model_version(model_name, source, run_id=run.run_id, tags={STUDENT_TAG: key})
    run.end()
    return {"student_dir": str(directory), "cached": False, "compute_s": compute_s, "key": key,
            "registered": f"{model_name}/{version.version}"}


# ---- transfer --------------------------------------------------------------------------------

def transfer_stage(mctx, student_dir: str, source_prompt, texts: list[str], progress=None):
    """Train the target prompt to behave on the target like the DP prompt on the student, on
    public texts only. Returns (``models.prompt_transfer``'s result, the ``transfer`` child run to log)."""
    from ...data import assert_public
    from ...methodkit.classifiers import classifier_for

    cfg = mctx.cfg
    assert_public(student_dir, mctx.paths.private)
    moved = transfer_on_public(cfg, cfg.methods.post, classifier_for(cfg, student_dir), source_prompt,
                               classifier_for(cfg, cfg.models.target_name), texts, progress=progress,
                               key="methods.post.transfer")
    t = cfg.methods.post.transfer
    losses = [h["loss"] for h in moved.history if h.get("loss") is not None]  # public-data losses
    child = {"name": "transfer", "tags": {"method": "post", "stage": "transfer", "data": "public only"},
             "params": {"transfer.steps": t.steps, "transfer.alpha": t.alpha, "transfer.lr": t.lr,
                        "transfer.public": cfg.public.name, "transfer.select_every": t.select_every},
             "metrics": {"transfer.loss_first": losses[0] if losses else None,
                         "transfer.loss_last": losses[-1] if losses else None,
                         "transfer.selected_step": moved.best_step},
             "series": {"transfer.public_select_loss": [(p["step"], -p["score"]) for p in moved.selection]}}
    return moved, child


# ---- the method --------------------------------------------------------------------------------

def validate(cfg, published: bool) -> None:
    block, public = cfg.methods.post, cfg.public
    t = block.transfer
    if public is not None and t.select_every and public.size is not None and t.select_size >= public.size:
        raise ValueError(f"methods.post.transfer.select_size = {t.select_size} holds out all "
                         f"{public.size} public texts (public.size): none left to train on")
    if block.full_pt and not cfg.allow_nonprivate_baselines:
        raise ValueError("methods.post.full_pt is non-private tuning on the target: set "
                         "allow_nonprivate_baselines: true to opt in")
    if block.full_pt:
        from .. import get_method

        try:
            trainer = get_method(NON_PRIVATE_SOFT_PROMPT).mechanism
        except KeyError:
            trainer = None
        if not isinstance(trainer, NonPrivateSoftPrompt):
            raise ValueError(f"methods.post.full_pt runs the non-private soft-prompt trainer registered as "
                             f"{NON_PRIVATE_SOFT_PROMPT!r}, and no such method is registered")


def uses_public_data(cfg) -> bool:
    return True


def teacher(cfg, prepared) -> str:
    return cfg.models.target_name


def student(cfg, prepared) -> str:
    return prepared.get("student_dir", cfg.models.local)


def missing_prepared(prepared) -> str:
    student = prepared.get("student_dir")
    return "" if student and Path(student).is_dir() else f"the run's POST student, not found at {student}"


def variants(ctx, result, prepared, run_method) -> list[Variant]:
    """Full ZS, Compressed PT, Direct Transfer and (opt-in) Full PT: the paper's table."""
    cfg, target, student = ctx.cfg, ctx.cfg.models.target_name, prepared["student_dir"]
    eps = result.epsilon
    guarantee = result.guarantee
    out = [Variant("full_zs", None, target, "none", label=NAMES["full_zs"])]
    if result.source_prompt_path is not None:  # none after a fallback to no prompt: nothing to score under ε
        out += [Variant("compressed_pt", result.source_prompt_path, student, guarantee, eps, NAMES["compressed_pt"]),
                Variant("direct_transfer", result.source_prompt_path, target, guarantee, eps,
                        NAMES["direct_transfer"])]
    if cfg.methods.post.full_pt:  # non-private tuning on the target: an upper bound, opt-in
        # the toolkit's non-private trainer, through the lifecycle (which records its non-private
        # use of the private rows in the ledger): the method it is registered as, by its mechanism
        full = run_method(NON_PRIVATE_SOFT_PROMPT)
        out.append(Variant("full_pt", full.prompt_path, target, "none", label=NAMES["full_pt"]))
    return out


class Post(Mechanism):
    def guarantee(self, cfg):
        return dp_unless_debug(cfg)

    def plan(self, cfg, n_train, delta, epsilon=None):
        from ...methodkit.training import dpsgd_event, dpsgd_params, dpsgd_settings

        block = settings_of(cfg, self)
        settings = dpsgd_settings(block.tuning, n_train, budget(cfg, epsilon), delta, cfg.data.privacy_unit)
        guarantee = self.guarantee(cfg)
        return MethodPlan(
            self.spec.name, guarantee, n_train, delta, event=dpsgd_event(settings) if guarantee == "dp" else None,
            params={**dpsgd_params(settings), "post.student_layers": block.distill.student_layers,
                    "post.transfer_steps": block.transfer.steps, "post.transfer_alpha": block.transfer.alpha},
            settings=settings, note="distillation: public data only (no privacy cost); transfer: public data "
                                    "and the DP prompt only (post-processing)")

    def preflight(self, cfg, prepared) -> None:
        """The target (teacher) classifier builds; in a run, also the distilled student's (its
        tokenizer is the teacher's, so ``privprompt plan`` checks the label words on the teacher)."""
        from ..base import check_classifier

        n_tokens = settings_of(cfg, self).tuning.n_tokens  # the soft prompt's positions, on the student and the target
        check_classifier(cfg, cfg.models.target_name, "models.target", n_tokens)
        if prepared and prepared.get("student_dir"):
            check_classifier(cfg, prepared["student_dir"], "the POST student", n_tokens)

    def prepare(self, ctx, progress=None):
        student = distill_student(ctx, progress=progress)
        return {**student, "tags": {"model.local": student["student_dir"], "post.student": student["registered"],
                                    "post.public": ctx.cfg.public.name}}

    def train(self, mctx, plan, rows, progress=None):
        from ...methodkit.training import dpsgd_event, fit_soft_prompt

        cfg = mctx.cfg
        result = fit_soft_prompt(cfg, settings_of(cfg, self).tuning, mctx.prepared["student_dir"], rows, mctx.seed,
                                 dp=plan.settings, randomness=mctx.randomness, progress=progress)
        metrics = {"train.steps": result.steps}
        return Trained(result.prompt, dpsgd_event(plan.settings) if plan.guarantee == "dp" else None,
                       result.steps, metrics, result.history)

    def post_process(self, mctx, plan, prompt, progress=None):
        from ...data import cached_public_texts

        texts = cached_public_texts(mctx.cfg, mctx.paths)  # public data only
        moved, child = transfer_stage(mctx, mctx.prepared["student_dir"], prompt, texts, progress)
        return PostProcessed(moved.prompt, moved.steps, child)


POST = register_method(MethodSpec(
    name="post", config_class=PostConfig, mechanism=Post(), label="POST",
    # the student's DP tuning is the per-unit DP-SGD of models.dp_prompt_training; its one private
    # release: that DP-SGD's clipped sum (fit_soft_prompt, units handed as prompt_dpsgd's)
    traits=Traits(unit_level=True, neighbour_statistics=("clipped_gradient_sum",),
                  stage_names={"prepare": "distill", "train": "tune", "post_process": "transfer"},
                  # the DP tuning's learning rate × epochs on the student (the transfer uses public
                  # data only and is not selected)
                  selection_grid=[{"tuning.lr": lr, "tuning.epochs": epochs}
                                  for lr in (0.02, 0.1) for epochs in (1.0, 3.0)],
                  test_settings={"tuning": {"n_tokens": 2, "epochs": 1, "batch_size": 8},
                                 "distill": {"steps": 2, "batch_size": 8},
                                 "transfer": {"steps": 2, "batch_size": 8}}),
    extras=Extras(validate=validate, uses_public_data=uses_public_data, published_model=teacher,
                  source_model=student, missing_prepared=missing_prepared, variants=variants)))
