"""A published prompt as an MLflow pyfunc model in the Model Registry: predicts labels (and scores)
for texts, outside PrivPrompt's flows (``privprompt predict``, ``mlflow models serve``).

The model's artifacts are the published prompt file (soft prompt / prefix tensors, or a text
prompt's instruction) and ``spec.json``: the backbone reference (``models.backbone_ref``), the
template, the labels, the label words / descriptions and the input length. No training data.

Registration (:func:`register_output`) is refused for anything but a ``dp`` / ``ldp`` output, and
for any file under the state folder's ``private/``. One registered model per (dataset, method);
each version points at its run and carries the privacy tags of ../shared/RUN_RECORD.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlflow.pyfunc
import pandas as pd

SPEC_FILE = "spec.json"
MODEL_ARTIFACT = "registered_model"  # where the pyfunc sits in its run's artifacts
REGISTERED = ("dp", "ldp")  # the publish rule (tasks.lifecycle.PUBLISHED)
CANDIDATE = "candidate"  # every new version's alias; privprompt promote moves "production" (tasks.promotion)


class RegistrationRefused(ValueError):
    """An output the registry must never hold (no formal guarantee, or private)."""


def registered_model_name(dataset: str, method: str) -> str:
    return f"privprompt.{dataset}.{method}"


def predictor_spec(cfg, method: str, model_name: str, backbone_ref: dict) -> dict:
    """What the pyfunc needs besides the prompt file, from the run's config (no private data)."""
    return {"method": method, "backbone": backbone_ref, "model": model_name, "labels": list(cfg.data.labels),
            "label_descriptions": dict(cfg.models.label_descriptions or {}), "template": cfg.models.template,
            "max_length": int(cfg.models.max_length), "seed": int(cfg.seed)}


@dataclass
class Predictor:
    """Classifier + the prompt its forward takes, built like the run's own evaluation
    (``tasks.methodkit.classifiers.prompted`` / ``input_length``)."""

    classifier: object
    prompt: object
    max_length: int
    labels: list[str]

    @classmethod
    def build(cls, spec: dict, prompt_path: str | Path, device=None) -> "Predictor":
        from models.backbone_ref import load_referenced
        from models.classifiers import build_classifier
        from models.prompts import load_prompt_artifact

        backbone = load_referenced(spec["backbone"], device)
        labels, desc = list(spec["labels"]), spec.get("label_descriptions") or None
        base = build_classifier(backbone, labels, desc, spec.get("template"))
        prompt, _ = load_prompt_artifact(prompt_path)
        if getattr(prompt, "kind", None) == "text":  # the instruction is part of the template
            clf = build_classifier(backbone, labels, desc, prompt.template(base.template))
            return cls(clf, None, spec["max_length"] + max(0, clf.template_tokens - base.template_tokens), labels)
        return cls(base, prompt, spec["max_length"], labels)

    def logits(self, texts: list[str], batch_size: int = 64,
               progress: Callable[[int, int], None] | None = None):
        import torch

        from models.scoring import predict_logits

        out = []
        for start in range(0, len(texts), batch_size):
            chunk = [str(t) for t in texts[start:start + batch_size]]
            enc = self.classifier.encode(chunk, max_length=self.max_length)
            out.append(predict_logits(self.classifier, enc, self.prompt, batch_size=batch_size))
            if progress is not None:
                progress(min(start + batch_size, len(texts)), len(texts))
        return torch.cat(out) if out else torch.zeros((0, len(self.labels)))

    def predict(self, texts: list[str], batch_size: int = 64, progress=None):
        """DataFrame: ``label`` and ``score.<label>`` (softmax over the labels) per text."""
        logits = self.logits(texts, batch_size, progress)
        probs = logits.double().softmax(dim=1).numpy()
        frame = pd.DataFrame({"label": [self.labels[i] for i in logits.argmax(dim=1).tolist()]})
        for j, label in enumerate(self.labels):
            frame[f"score.{label}"] = probs[:, j]
        return frame


def input_texts(model_input, field: str = "text") -> list[str]:
    """Texts from a DataFrame (column ``field``, default ``text``; else its only column), a dict or a list."""
    if isinstance(model_input, pd.DataFrame):
        if field in model_input.columns:
            return model_input[field].astype(str).tolist()
        if len(model_input.columns) == 1:
            return model_input.iloc[:, 0].astype(str).tolist()
        hint = " (--text-field NAME names another)" if field == "text" else ""
        raise ValueError(f"input needs a {field!r} column{hint} (columns: {list(model_input.columns)})")
    if isinstance(model_input, dict):
        return [str(t) for t in model_input["text"]]
    return [str(t) for t in model_input]


class PromptClassifierModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: texts in (a ``text`` column), labels and per-label scores out."""

    def load_context(self, context):
        spec = json.loads(Path(context.artifacts["spec"]).read_text())
        self.predictor = Predictor.build(spec, context.artifacts["prompt"])

    def predict(self, context, model_input: pd.DataFrame, params=None):
        # the DataFrame hint: MLflow infers no schema from it (the signature is given at save time)
        # and stops advising type hints in every run's and prediction's output
        batch_size = int((params or {}).get("batch_size", 64))
        return self.predictor.predict(input_texts(model_input), batch_size)


@contextlib.contextmanager
def _pins_of_this_environment():
    """While saving a model whose requirements are pinned to this environment's own versions:
    MLflow's check that the environment satisfies them (it warns on a mismatch) cannot fail, and
    it maps every installed distribution to its modules first (~0.4-1 s of every published run,
    issue 29). Skipped for the duration; the saved requirements are the same."""
    from mlflow.utils import environment as mlflow_environment

    with _SAVING:  # one save at a time in a process: each puts back the check it found
        check = getattr(mlflow_environment, "warn_dependency_requirement_mismatches", None)
        if check is None:  # another MLflow: nothing to skip
            yield
            return
        mlflow_environment.warn_dependency_requirement_mismatches = lambda requirements: None
        try:
            yield
        finally:
            mlflow_environment.warn_dependency_requirement_mismatches = check


_SAVING = threading.Lock()


def save_pyfunc(directory: Path, spec: dict, prompt_path: str | Path) -> Path:
    """Write the pyfunc model folder (MLflow format) to ``directory``."""
    import importlib.metadata as md

    from mlflow.models import infer_signature

    work = Path(tempfile.mkdtemp(prefix="pyfunc-"))
    try:
        spec_path = work / SPEC_FILE
        spec_path.write_text(json.dumps(spec, indent=2, sort_keys=True))
        example = pd.DataFrame({"text": ["an example input"]})
        out = pd.DataFrame({"label": [spec["labels"][0]], **{f"score.{l}": [0.5] for l in spec["labels"]}})
        reqs = [f"{p}=={md.version(p)}" for p in ("torch", "transformers", "safetensors", "pandas", "mlflow")]
        # the class is pickled by reference to this module (loading it imports PrivPrompt anyway),
        # and the signature is given: MLflow's cautions about both are left out of the run's output
        pyfunc_log = logging.getLogger("mlflow.pyfunc")
        level = pyfunc_log.level
        pyfunc_log.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings(), _pins_of_this_environment():
                warnings.filterwarnings("ignore", message=r".*input example was not provided", category=UserWarning)
                mlflow.pyfunc.save_model(str(directory), python_model=PromptClassifierModel(),
                                         artifacts={"spec": str(spec_path), "prompt": str(prompt_path)},
                                         signature=infer_signature(example, out), pip_requirements=reqs)
        finally:
            pyfunc_log.setLevel(level)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return directory


def download_model(client, model_uri: str, dst: str | Path) -> Path:
    """The pyfunc folder ``model_uri`` names (``models:/NAME/VERSION``, ``models:/NAME/latest``,
    ``models:/NAME@ALIAS``, ``runs:/RUN/PATH`` or a local folder), fetched with ``client``'s own
    tracking and registry URIs: no process-wide MLflow setting is read or changed."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    if Path(model_uri).is_dir():
        return Path(model_uri)
    tracking = client.tracking_uri
    try:
        if model_uri.startswith("models:/"):
            version = resolve_version(client, model_uri)
            source = client.get_model_version_download_uri(version.name, str(version.version))
        else:
            source = model_uri
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dst), tracking_uri=tracking))
    except MlflowException as exc:
        raise ValueError(str(exc.message).splitlines()[0]) from None


def resolve_version(client, model_uri: str):
    """The ModelVersion ``models:/NAME/VERSION``, ``models:/NAME/latest`` or ``models:/NAME@ALIAS``
    names; a ValueError (one line) for anything else."""
    from mlflow.exceptions import MlflowException

    if not model_uri.startswith("models:/"):
        raise ValueError(f"{model_uri!r} is not models:/NAME/VERSION, models:/NAME/latest or models:/NAME@ALIAS")
    rest = model_uri[len("models:/"):].strip("/")
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            return client.get_model_version_by_alias(name, alias)
        name, _, version = rest.rpartition("/")
        if not name:
            raise ValueError(f"{model_uri!r} is not models:/NAME/VERSION, models:/NAME/latest or models:/NAME@ALIAS")
        if version == "latest":
            versions = client.search_model_versions(f"name='{name}'")
            if not versions:
                raise ValueError(f"registered model {name!r} has no versions")
            version = str(max(int(v.version) for v in versions))
        return client.get_model_version(name, version)
    except MlflowException as exc:
        raise ValueError(str(exc.message).splitlines()[0]) from None


PROMPT_TAG = "prompt.registry"  # a text prompt's version: its entry in MLflow's Prompt Registry


def prompt_name(model_name: str) -> str:
    """The Prompt Registry name of a registered model's text prompts (MLflow refuses a prompt of a
    registered model's own name)."""
    return f"{model_name}.prompt"


def register_text_prompt(client, version, template: str, labels: list[str], label_words: list[str],
                         source_model: str, target_model: str) -> str:
    """Register a published text prompt (DP-OPT's instruction, dp_fewshot's demonstrations: the
    whole template, ``{{text}}`` the input) in MLflow's Prompt Registry beside its model version:
    the version's privacy tags plus the source and target models, the labels and their words; alias
    ``candidate`` (``privprompt promote`` moves ``production`` with the model's). Loadable with
    ``mlflow.genai.load_prompt("prompts:/<name>@production")``. Idempotent: a version that has its
    prompt keeps it. Returns the prompt version's URI."""
    tags = dict(version.tags or {})
    if tags.get(PROMPT_TAG):
        return tags[PROMPT_TAG]
    name = prompt_name(version.name)
    keep = ("privacy.epsilon", "privacy.delta", "privacy.guarantee", "privacy.accountant", "privacy.unit",
            "dataset.fingerprint", "prompt.source")
    prompt = client.register_prompt(
        name, template.replace("{text}", "{{text}}"),
        commit_message=f"{version.name} v{version.version} (run {version.run_id})",
        tags={**{k: tags[k] for k in keep if k in tags}, "model.source": source_model, "model.target": target_model,
              "labels": json.dumps(list(labels)), "label_words": json.dumps(list(label_words)),
              "registered_model": f"models:/{version.name}/{version.version}"})
    client.set_prompt_alias(name, CANDIDATE, int(prompt.version))
    uri = f"prompts:/{name}/{prompt.version}"
    client.set_model_version_tag(version.name, str(version.version), PROMPT_TAG, uri)
    return uri


def version_tags(guarantee: str, spend: dict | None, dataset_key: str, unit: str = "record") -> dict[str, str]:
    spend = spend or {}
    none = "none (local d_X privacy: no (ε, δ) claim)" if guarantee == "ldp" else "none"
    return {"privacy.epsilon": str(spend["epsilon"]) if "epsilon" in spend else none,
            "privacy.delta": str(spend["delta"]) if "delta" in spend else none,
            "privacy.guarantee": guarantee,
            "privacy.accountant": str(spend.get("accountant", "none")),
            "privacy.unit": unit,
            "dataset.fingerprint": dataset_key}


def check_registrable(guarantee: str, prompt_path: str | Path, private_dir: str | Path,
                      backbone: dict | None = None) -> None:
    """Refuse what the registry must never hold: no formal guarantee, or a file under ``private/``
    — the prompt, or the backbone a reference would name by its path and hash (a model trained on
    private data and kept there)."""
    if guarantee not in REGISTERED:
        raise RegistrationRefused(f"an output with guarantee {guarantee!r} is never registered (only {REGISTERED})")
    private = Path(private_dir).resolve()
    for what, where in (("the prompt", prompt_path), ("the backbone", (backbone or {}).get("path"))):
        if where is None:
            continue
        path = Path(where).resolve()
        if path == private or private in path.parents:
            raise RegistrationRefused(f"{what} ({path}) is under the state folder's private/ and never leaves it")


def register_output(client, run_id: str, model_name: str, spec: dict, prompt_path: str | Path, guarantee: str,
                    spend: dict | None, dataset_key: str, private_dir: str | Path, unit: str = "record",
                    extra_tags: dict[str, str] | None = None, description: str | None = None):
    """Log the pyfunc under run ``run_id`` (``registered_model/``) and register it as a new version
    of ``model_name`` with the privacy tags (and ``extra_tags``: a retarget's lineage), the alias
    ``candidate`` (it moves from the version before; ``privprompt promote`` moves ``production``
    after the gates; the caller writes the model card, :func:`tasks.model_card.write_card`); returns the ModelVersion. A run's output is registered
    once: a retry that republishes it (``tasks.lifecycle``) gets the version it already has."""
    from mlflow.exceptions import MlflowException

    check_registrable(guarantee, prompt_path, private_dir, spec.get("backbone"))
    try:
        existing = client.search_model_versions(f"name='{model_name}' and run_id='{run_id}'")
    except MlflowException:
        existing = []
    if existing:
        return existing[0]
    with tempfile.TemporaryDirectory(prefix="pyfunc-") as tmp:
        folder = save_pyfunc(Path(tmp) / MODEL_ARTIFACT, spec, prompt_path)
        client.log_artifacts(run_id, str(folder), MODEL_ARTIFACT)
    try:
        client.create_registered_model(model_name, description="PrivPrompt: prompts published with a formal "
                                       "privacy guarantee (dp or ldp) for one dataset and method")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{MODEL_ARTIFACT}"
    tags = {**version_tags(guarantee, spend, dataset_key, unit), **(extra_tags or {})}
    version = client.create_model_version(model_name, source, run_id=run_id, tags=tags,
                                          description=description or f"{spec['method']} on {spec['model']}")
    client.set_registered_model_alias(model_name, CANDIDATE, str(version.version))
    return client.get_model_version(model_name, str(version.version))
