"""POST stages (Wang et al. 2024) as plain functions: distil the target model into a small
student on public text (the provider's side), and transfer a DP soft prompt from the student
back to the target with public data only. DP tuning on the student reuses ``stages.train_stage``.

The transferred prompt is a function of the DP prompt and public data alone: post-processing,
so it carries the DP prompt's guarantee. ``transfer_stage`` receives public texts only and
asserts that none of its inputs lives under ``<state>/private``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from .config import PrivPromptConfig
from .data import assert_public, read_public_texts
from .errors import ConfigError
from .record import RunRecord
from .stages import StageContext, classifier_for
from .state import default_data_root

STUDENT_TAG = "privprompt.student_key"


def public_texts(cfg: PrivPromptConfig, private_dir: str | Path) -> list[str]:
    p = cfg.methods.post.public
    return read_public_texts(p.name, p.path, p.split, p.text_field, default_data_root(cfg.data_root),
                             private_dir, p.size, cfg.seed)


def student_key(cfg: PrivPromptConfig, public: list[str]) -> str:
    d = cfg.methods.post.distill
    payload = json.dumps({"teacher": cfg.models.target_name, "distill": d.model_dump(), "seed": cfg.seed,
                          "max_length": cfg.models.max_length,
                          "public": hashlib.sha256("\x1e".join(public).encode()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def distill_stage(ctx: StageContext, progress=None) -> dict:
    """The student for (teacher, settings, public data): reused when a registered version with
    the same key exists, else built from the teacher's first and last layers and distilled."""
    from models.distill import DistillConfig, build_student, distill, freeze, save_student
    from models.registry import load_backbone

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
    teacher = load_backbone(cfg.models.target_name, seed=cfg.seed)
    student = build_student(teacher, d.student_layers, seed=cfg.seed)
    result = distill(teacher, student, texts, DistillConfig(
        steps=d.steps, batch_size=d.batch_size, lr=d.lr, max_length=cfg.models.max_length,
        alpha_ce=d.alpha_ce, alpha_lm=d.alpha_lm, alpha_cos=d.alpha_cos, seed=cfg.seed), progress=progress)
    freeze(student)
    import shutil

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_student(student, tmp)
    shutil.rmtree(directory, ignore_errors=True)  # an unregistered leftover of an interrupted run
    tmp.replace(directory)  # atomic: a student folder is complete or absent
    compute_s = time.perf_counter() - started
    run = ctx.parent.child("distill", {"method": "post", "stage": "distill", "privacy.guarantee": "none",
                                       "data": "public only"})
    losses = [h["loss"] for h in result.history if h.get("loss") is not None]
    run.log_params({"distill.student_layers": d.student_layers, "distill.steps": d.steps,
                    "distill.public": cfg.methods.post.public.name, "distill.key": key})
    run.log_metrics({"distill.loss_first": losses[0] if losses else None,
                     "distill.loss_last": losses[-1] if losses else None, "distill.compute_s": compute_s})
    mlflow.log_artifacts(run.run_id, str(directory), "student")
    try:
        mlflow.create_registered_model(model_name)
    except Exception:  # noqa: BLE001 - already registered
        pass
    source = f"{mlflow.get_run(run.run_id).info.artifact_uri}/student"
    version = mlflow.create_model_version(model_name, source, run_id=run.run_id, tags={STUDENT_TAG: key})
    run.end()
    return {"student_dir": str(directory), "cached": False, "compute_s": compute_s, "key": key,
            "registered": f"{model_name}/{version.version}"}


def transfer_config(cfg: PrivPromptConfig):
    """The ``models.transfer`` settings of a config: the target prompt initialised like the
    source prompt."""
    from models.transfer import TransferConfig

    t = cfg.methods.post.transfer
    return TransferConfig(steps=t.steps, batch_size=t.batch_size, lr=t.lr, alpha=t.alpha,
                          max_length=cfg.models.max_length, seed=cfg.seed, init="vocab",
                          init_words=cfg.methods.prompt_dpsgd.init, init_seed=cfg.seed,
                          select_every=t.select_every)


def transfer_on_public(cfg: PrivPromptConfig, source_clf, source_prompt, target_clf, texts: list[str],
                       progress=None):
    """POST's transfer as the config asks (the flow and the audit's shadows share it): a fixed
    number of steps, or with ``select_every`` the prompt with the lowest transfer loss on
    ``select_size`` held-out public texts. ``texts`` are public; nothing private is read."""
    from models.transfer import PublicObjective, transfer_prompt

    t, config = cfg.methods.post.transfer, transfer_config(cfg)
    if not t.select_every:
        return transfer_prompt(source_clf, source_prompt, target_clf, texts, config, progress=progress)
    if len(texts) <= t.select_size:
        raise ConfigError(f"methods.post.transfer.select_size = {t.select_size} leaves no public texts to "
                          f"train on ({len(texts)} in methods.post.public); lower it or raise public.size")
    import numpy as np

    order = np.random.default_rng(cfg.seed).permutation(len(texts))  # files may be sorted by label
    held_out = [texts[i] for i in order[: t.select_size]]
    train = [texts[i] for i in sorted(order[t.select_size :])]

    objective = PublicObjective(source_clf, source_prompt, target_clf, held_out, config)  # encoded once

    def public_score(prompt) -> float:
        return -objective(prompt)

    return transfer_prompt(source_clf, source_prompt, target_clf, train, config, progress=progress,
                           select_fn=public_score)


def transfer_stage(ctx: StageContext, student_dir: str, source_prompt_path: str, texts: list[str],
                   progress=None) -> dict:
    """Train the target prompt to behave on the target like the DP prompt on the student, on
    public texts only (a fixed number of steps, or selection on held-out public texts; never on
    private data)."""
    from models.soft_prompt import load_prompt, save_prompt

    cfg, paths = ctx.cfg, ctx.paths
    assert_public(student_dir, paths.private)
    assert_public(source_prompt_path, paths.private)  # the DP prompt is a published output
    t = cfg.methods.post.transfer
    started = time.perf_counter()
    source = classifier_for(cfg, student_dir)
    target = classifier_for(cfg, cfg.models.target_name)
    prompt, _ = load_prompt(source_prompt_path)
    result = transfer_on_public(cfg, source, prompt, target, texts, progress=progress)
    compute_s = time.perf_counter() - started
    path = ctx.output_dir / "post.safetensors"
    save_prompt(path, result.prompt, {"method": "post", "model": cfg.models.target_name,
                                      "source_prompt": Path(source_prompt_path).name})
    run = ctx.parent.child("transfer", {"method": "post", "stage": "transfer", "privacy.guarantee": "dp",
                                        "data": "public only"})
    losses = [h["loss"] for h in result.history if h.get("loss") is not None]
    run.log_params({"transfer.steps": t.steps, "transfer.alpha": t.alpha, "transfer.lr": t.lr,
                    "transfer.public": cfg.methods.post.public.name, "transfer.select_every": t.select_every})
    run.log_metrics({"transfer.loss_first": losses[0] if losses else None,
                     "transfer.loss_last": losses[-1] if losses else None, "transfer.compute_s": compute_s,
                     "transfer.selected_step": result.best_step})
    for point in result.selection:  # held-out public transfer loss of each candidate
        run.log_metrics({"transfer.public_select_loss": -point["score"]}, step=point["step"])
    run.end()
    return {"prompt_path": str(path), "compute_s": compute_s, "steps": result.steps, "selected_step": result.best_step}
