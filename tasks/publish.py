"""A published output in forms people use outside PrivPrompt, written where the lifecycle publishes:

* a PEFT adapter folder (``peft/`` in the run's artifacts, ``<name>_peft/`` next to the prompt in
  ``outputs/``): prompt tuning for a soft prompt, prefix tuning for a prefix, a LoRA adapter for a
  LoRA (``models.prompts.peft_export``); a text prompt is no adapter, it is a template (``peft/template.json``);
* a new version of the registered MLflow model of (dataset, method) (``tasks.registry_model``).

A method that evaluates its published prompt its own way (RAPT: on privatized inputs) has an output
neither form reproduces; the run record says so (tags ``peft.adapter`` and ``registry.model``) and
nothing is exported. Only the lifecycle's publish step calls :func:`publish_usable`, and only for a
``dp`` / ``ldp`` output under ``outputs/``; :func:`~tasks.registry_model.check_registrable` refuses
anything else.
"""

from __future__ import annotations

from pathlib import Path

from .stages import own_evaluation

ADAPTERS = {"soft": "prompt tuning", "prefix": "prefix tuning", "lora": "LoRA"}  # the PEFT adapter of each kind
NO_PROMPT_DESCRIPTION = ("no prompt: {model} with its template and label words ({method}'s prompt did not beat it "
                         "on the holdout, so the run published none)")


def publish_usable(ctx, child, name: str, guarantee: str, prompt_path: str, spend: dict | None,
                   source: str = "trained") -> dict[str, str]:
    """Write and log the PEFT adapter (or template) of the published prompt at ``prompt_path`` on
    ``child`` (the training run), and register it on the flow's parent run. Returns the tags set.
    ``source``: ``trained`` (the method's output) or ``none`` (the model without a prompt, when no
    prompt won: ``tasks.lifecycle.write_no_prompt``), tagged ``prompt.source`` on the version."""
    from models.backbone_ref import backbone_reference, base_model_name_or_path
    from models.backbones import load_backbone
    from models.prompts import load_prompt_artifact, prompt_kind
    from models.prompts.peft_export import PeftExportError, save_peft_adapter, save_text_template

    from .registry_model import (check_registrable, predictor_spec, register_output, register_text_prompt,
                                 registered_model_name)
    from .methodkit.classifiers import classifier_for
    from .model_card import write_card

    cfg, paths = ctx.cfg, ctx.paths
    check_registrable(guarantee, prompt_path, paths.private)
    if own_evaluation(name) is not None:
        why = (f"not exported: {name} evaluates its published prompt its own way (e.g. on privatized inputs), "
               "which neither a PEFT adapter nor the registry's predictor reproduces")
        tags = {"peft.adapter": why, "registry.model": why}
        child.set_tags(tags)
        return tags
    model_name = cfg.models.target_name
    backbone = load_backbone(model_name, seed=cfg.seed, placement=cfg.models.placement_of(model_name))
    ref = backbone_reference(model_name, cfg.seed, backbone.model)
    check_registrable(guarantee, prompt_path, paths.private, ref)  # the adapter names the backbone too
    prompt, _ = load_prompt_artifact(prompt_path)
    folder = Path(prompt_path).with_name(f"{name}_peft")
    tags: dict[str, str] = {"prompt.source": source}
    text = getattr(prompt, "kind", None) == "text"
    if text:
        base = classifier_for(cfg, model_name)
        words = list(getattr(base, "label_words", None) or getattr(base, "label_descriptions", []))
        save_text_template(folder, prompt.template(base.template), list(cfg.data.labels), words)
        tags["peft.adapter"] = "none: a text prompt is a template (peft/template.json), not a PEFT adapter"
    else:
        try:
            save_peft_adapter(folder, prompt, backbone.model, backbone.kind, base_model_name_or_path(ref),
                              ref.get("revision"))
            tags["peft.adapter"] = f"peft/ ({ADAPTERS[prompt_kind(prompt)]})"
        except PeftExportError as exc:
            tags["peft.adapter"] = f"not exported: {exc}"
    if folder.is_dir():
        child.mlflow.log_artifacts(child.run_id, str(folder), "peft")
    version = register_output(ctx.parent.mlflow, ctx.parent.run_id,
                              registered_model_name(cfg.data.name, name),
                              predictor_spec(cfg, name, model_name, ref), prompt_path, guarantee, spend,
                              ctx.part.published_key, paths.private, cfg.data.charge_unit,
                              extra_tags={"prompt.source": source}, description=NO_PROMPT_DESCRIPTION.format(
                                  method=name, model=model_name) if source == "none" else None)
    if text:  # and in MLflow's Prompt Registry, where prompts are looked for
        tags["registry.prompt"] = register_text_prompt(ctx.parent.mlflow, version, prompt.template(base.template),
                                                       list(cfg.data.labels), words, cfg.models.local, model_name)
        version = ctx.parent.mlflow.get_model_version(version.name, str(version.version))
    write_card(ctx.parent.mlflow, version, predictor_spec(cfg, name, model_name, ref))
    tags["registry.model"] = f"models:/{version.name}/{version.version}"
    child.set_tags(tags)
    return tags
