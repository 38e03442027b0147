"""``privprompt retarget MODEL_URI --target MODEL``: a released prompt moved to another backbone with
PUBLIC data only — post-processing of the DP output, so no ε is spent and the ledger gets no entry.

* a soft prompt (prompt tuning, POST, …): POST's public-data transfer
  (:func:`tasks.methodkit.transfer.transfer_on_public`, the same code as POST's own transfer
  step) from the version's backbone and prompt to ``MODEL``, on the parent run's ``public:`` texts,
  with the transfer settings of the parent config's ``methods.post.transfer`` block;
* a text prompt (DP-OPT's instruction): the same instruction on ``MODEL``'s template.

A LoRA adapter is refused in one line: it updates its own backbone's layers.

Either way the prompt is evaluated on the labelled public rows (``retarget.public.accuracy`` beside
``retarget.public.no_prompt.accuracy``: public numbers, read by the ``holdout`` gate) and
registered as a new version of the same registered model, on a ``retarget`` child run of the DP
run, with the parent's ``privacy.*`` and ``dataset.fingerprint`` tags, ``lineage.parent`` (the
parent version's URI) and ``lineage.dp_run`` (the run whose DP release it is), the alias
``candidate`` and a model card. ``privprompt promote`` gates it like any other.

What is read: the registered model (spec and prompt: public outputs), the DP run's ``config.yaml``
artifact, the public data's file (refused, as a run refuses it, when the config names it private: by
its path, never its content). Not read: the private source, the state folder's ``private/``, the ledger.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PrivPromptError

MIN_LABELLED = 8  # public rows with a label of the label set needed to report a public accuracy


class RetargetError(PrivPromptError, ValueError):
    """The version cannot be retargeted as asked (one line: why)."""


@dataclass
class Retargeted:
    version: object  # the new ModelVersion
    kind: str        # soft | text
    metrics: dict


def _parent(client, model_uri: str, tmp: Path):
    """(ModelVersion, spec, prompt file, the DP run's config dict) of the version to retarget."""
    import yaml

    from .registry_model import REGISTERED, SPEC_FILE, download_model, resolve_version

    version = resolve_version(client, model_uri)
    tags = dict(version.tags or {})
    if tags.get("privacy.guarantee") not in REGISTERED:
        raise RetargetError(f"{model_uri}: guarantee {tags.get('privacy.guarantee')!r}; only dp / ldp versions are retargeted")
    folder = download_model(client, f"models:/{version.name}/{version.version}", tmp / "parent")
    spec = json.loads((folder / "artifacts" / SPEC_FILE).read_text())
    prompts = [p for p in (folder / "artifacts").iterdir() if p.name != SPEC_FILE]
    if len(prompts) != 1:
        raise RetargetError(f"{model_uri}: the registered model holds {len(prompts)} prompt files, not one")
    dp_run = tags.get("lineage.dp_run") or version.run_id
    try:
        config = yaml.safe_load(Path(client.download_artifacts(dp_run, "config.yaml", str(tmp))).read_text())
    except Exception:  # noqa: BLE001 - reported as one line
        raise RetargetError(f"{model_uri}: its run {dp_run} has no config.yaml artifact to read the public data "
                            "and transfer settings from") from None
    return version, spec, prompts[0], config


def _public_rows(cfg, private_dir) -> tuple[list[str], list[str | None]]:
    """The parent config's public texts (``public:``, as its runs read them) and each row's label when
    it is one of the label set (None otherwise). The private source is not read (module docstring)."""
    from . import sources
    from .data import DataError, assert_not_the_private_source, assert_public, public_split_file
    from .state import default_data_root

    if cfg.public is None:
        raise RetargetError("the parent run's config names no public: data; retargeting reads public texts only")
    p, root = cfg.public, default_data_root(cfg.data_root)
    file = public_split_file(p.name, p.path, p.split, root)
    assert_public(file, private_dir)
    assert_not_the_private_source(file, cfg.data, root)
    rows = [r for r in sources.read_file(file) if isinstance(r.get(p.text_field), str) and r[p.text_field].strip()]
    if not rows:
        raise DataError(f"public dataset {file} has no '{p.text_field}' texts")
    if p.size is not None and p.size < len(rows):
        import numpy as np

        idx = np.random.default_rng(cfg.seed).choice(len(rows), size=p.size, replace=False)
        rows = [rows[i] for i in sorted(idx)]
    labels = set(cfg.data.labels)
    label_of = [str(r.get(cfg.data.label_field)) if str(r.get(cfg.data.label_field)) in labels else None for r in rows]
    return [r[p.text_field] for r in rows], label_of


def _scores(spec: dict, prompt_path: Path, texts, label_of) -> dict:
    """:func:`_public_accuracy` of the version ``spec`` and ``prompt_path`` describe, as the registry's
    predictor builds it (a text prompt inside the template), beside the same backbone without it."""
    from models.classifiers import build_classifier

    from .registry_model import Predictor

    with_prompt = Predictor.build(spec, prompt_path)
    base = build_classifier(with_prompt.classifier.backbone, list(spec["labels"]),
                            spec.get("label_descriptions") or None, spec.get("template"))
    without = Predictor(base, None, int(spec["max_length"]), list(spec["labels"]))
    rows = [(t, y) for t, y in zip(texts, label_of) if y is not None]
    if len(rows) < MIN_LABELLED:
        return {}
    truth = [y for _, y in rows]
    out = {}
    for key, predictor in (("retarget.public.accuracy", with_prompt), ("retarget.public.no_prompt.accuracy", without)):
        predicted = predictor.predict([t for t, _ in rows])["label"].tolist()
        out[key] = sum(a == b for a, b in zip(predicted, truth)) / len(rows)
    out["retarget.public.n_labelled"] = float(len(rows))
    return out


def _target_spec(spec: dict, target: str):
    """(the new spec, the target backbone): the parent's labels, template and length on ``target``."""
    from models.backbone_ref import backbone_reference
    from models.backbones import load_backbone

    backbone = load_backbone(target, seed=int(spec.get("seed", 0)))
    ref = backbone_reference(target, int(spec.get("seed", 0)), backbone.model)
    return {**spec, "backbone": ref, "model": target}, backbone


def _transfer(cfg, spec: dict, prompt_path: Path, target_spec: dict, backbone, texts, progress=None):
    """POST's public-data transfer of the parent's soft prompt from its backbone to ``backbone``."""
    from models.classifiers import build_classifier

    from .methodkit.transfer import transfer_on_public
    from .registry_model import Predictor

    source = Predictor.build(spec, prompt_path)
    if source.prompt is None or source.prompt.dim() != 2:
        raise RetargetError("only a soft prompt or a text prompt is retargeted (a prefix is tied to its backbone's "
                            "layers; POST's transfer moves soft prompts)")
    target_clf = build_classifier(backbone, list(spec["labels"]), spec.get("label_descriptions") or None,
                                  spec.get("template"))
    moved = transfer_on_public(cfg, cfg.methods.post, source.classifier, source.prompt, target_clf, texts, progress,
                               key="methods.post.transfer")
    losses = [h["loss"] for h in moved.history if h.get("loss") is not None]  # public-data losses
    return moved.prompt, {"retarget.transfer.loss_first": losses[0] if losses else None,
                          "retarget.transfer.loss_last": losses[-1] if losses else None}


def _new_run(client, parent, target: str, kind: str) -> str:
    """A ``retarget`` child of the DP run (so the report counts no second run of the method)."""
    tags = dict(parent.tags or {})
    dp_run = tags.get("lineage.dp_run") or parent.run_id
    dp = client.get_run(dp_run)
    run = client.create_run(dp.info.experiment_id, run_name=f"retarget-{target}", tags={
        "mlflow.parentRunId": dp_run, "stage": "retarget", "method": dp.data.tags.get("method", ""),
        "dataset": dp.data.tags.get("dataset", ""), "privacy.guarantee": tags.get("privacy.guarantee", ""),
        "data": "public only", "model.target": target, "retarget.kind": kind,
        "lineage.parent": f"models:/{parent.name}/{parent.version}", "lineage.dp_run": dp_run})
    return run.info.run_id


def _publish(client, paths, parent, run_id: str, spec: dict, prompt, backbone) -> Path:
    """The new prompt under ``outputs/retarget/<run>/`` (and as the run's ``prompt/``), a soft
    prompt's PEFT adapter as its ``peft/``."""
    from models.backbone_ref import base_model_name_or_path
    from models.prompts import save_prompt_artifact
    from models.prompts.peft_export import save_peft_adapter

    folder = paths.root / "outputs" / "retarget" / run_id
    kind = "text" if getattr(prompt, "kind", None) == "text" else "soft"
    path = save_prompt_artifact(folder / f"{spec['method']}{'.json' if kind == 'text' else '.safetensors'}", prompt,
                                {"privacy.guarantee": parent.tags.get("privacy.guarantee", ""),
                                 "lineage.parent": f"models:/{parent.name}/{parent.version}"})
    client.log_artifact(run_id, str(path), "prompt")
    if kind == "soft":
        adapter = save_peft_adapter(folder / "peft", prompt, backbone.model, backbone.kind,
                                    base_model_name_or_path(spec["backbone"]), spec["backbone"].get("revision"))
        client.log_artifacts(run_id, str(adapter), "peft")
    return path


def _register(client, paths, parent, run_id: str, spec: dict, path: Path, target: str):
    """The new version: the parent's privacy tags kept, its lineage named, the alias ``candidate``."""
    from .registry_model import register_output

    kept = {k: v for k, v in parent.tags.items() if k.startswith("privacy.") or k == "dataset.fingerprint"}
    lineage = {"lineage.parent": f"models:/{parent.name}/{parent.version}",
               "lineage.dp_run": parent.tags.get("lineage.dp_run") or parent.run_id, "model.target": target}
    return register_output(client, run_id, parent.name, spec, path, kept["privacy.guarantee"], None,
                           kept.get("dataset.fingerprint", ""), paths.private, kept.get("privacy.unit", "record"),
                           extra_tags={**kept, **lineage})


def retarget(client, paths, model_uri: str, target: str, steps: int | None = None, progress=None) -> Retargeted:
    """Move the version ``model_uri`` names to backbone ``target`` on public data and register it."""
    from models.prompts import load_prompt_artifact

    from .config import parse_config
    from .model_card import write_card

    with tempfile.TemporaryDirectory(prefix="privprompt-retarget-") as tmp:
        parent, spec, prompt_path, config = _parent(client, model_uri, Path(tmp))
        prompt, _ = load_prompt_artifact(prompt_path)
        if getattr(prompt, "kind", None) == "lora":
            raise RetargetError("a LoRA adapter is not retargeted: it is an update of its backbone's own weights "
                                f"(layer names and shapes of {spec['model']}), which no other model has; train "
                                f"one on the target itself (models.local: {target})")
        if steps is not None:
            config.setdefault("methods", {}).setdefault("post", {}).setdefault("transfer", {})["steps"] = int(steps)
        cfg = parse_config(config)
        texts, label_of = _public_rows(cfg, paths.private)
        new_spec, backbone = _target_spec(spec, target)
        kind = "text" if getattr(prompt, "kind", None) == "text" else "soft"
        metrics = {}
        if kind == "soft":
            prompt, metrics = _transfer(cfg, spec, prompt_path, new_spec, backbone, texts, progress)
        run_id = _new_run(client, parent, target, kind)
        try:
            path = _publish(client, paths, parent, run_id, new_spec, prompt, backbone)
            metrics.update(_scores(new_spec, path, texts, label_of))
            client.log_batch(run_id, metrics=[_metric(k, v) for k, v in metrics.items() if v is not None])
            version = _register(client, paths, parent, run_id, new_spec, path, target)
            write_card(client, version, new_spec)
        except BaseException:
            client.set_terminated(run_id, "FAILED")  # no version was registered, or none with a card
            raise
        client.set_terminated(run_id)
    return Retargeted(version, kind, metrics)


def _metric(key: str, value: float):
    import time

    from mlflow.entities import Metric

    return Metric(key, float(value), int(time.time() * 1000), 0)
