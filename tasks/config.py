"""One config schema (pydantic) for every flow: data, models, privacy, method blocks, seed,
experiment. Unknown keys are errors; every error names the key and the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Block):
    name: str = Field(description="dataset name, also the folder under the data root")
    path: str | None = Field(None, description="folder with train/test files (default: <data_root>/<name>)")
    hub: str | None = Field(None, description="a hub dataset id for `datasets.load_dataset` instead of files")
    hub_config: str | None = None
    train_split: str = "train"
    test_split: str = "test"
    text_field: str = "text"
    label_field: str = "label"
    labels: list[str] = Field(min_length=2)
    label_map: dict[str, str] = Field(default_factory=dict, description="raw label -> label name")
    train_size: int | None = Field(None, gt=0, description="subsample of the private training data")
    test_size: int | None = Field(None, gt=0)
    holdout_fraction: float = Field(0.1, gt=0, lt=1, description="held-out validation share")
    canaries: int = Field(0, ge=0, description="random canary records, each planted with prob. 1/2")

    @field_validator("labels")
    @classmethod
    def _unique_labels(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"labels must be unique, got {v}")
        return v


class ModelsConfig(_Block):
    local: str = Field(description="model where private data is used (HF id, local path or alias)")
    target: str | None = Field(None, description="model the prompt is published for (default: local)")
    label_descriptions: dict[str, str] = Field(default_factory=dict)
    template: str | None = None
    max_length: int = Field(64, gt=4)
    eval_batch_size: int = Field(64, gt=0)

    @property
    def target_name(self) -> str:
        return self.target or self.local


class PrivacyConfig(_Block):
    target_epsilon: float = Field(8.0, description="ε the DP method spends")
    target_delta: float | None = Field(None, description="δ; default min(1e-5, 1/(10 n_train))")
    dataset_epsilon_cap: float = Field(10.0, description="total ε allowed on this dataset (ledger)")
    max_grad_norm: float = Field(1.0, gt=0)

    @field_validator("target_epsilon", "dataset_epsilon_cap")
    @classmethod
    def _positive_eps(cls, v):
        if not v > 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("target_delta")
    @classmethod
    def _delta_range(cls, v):
        if v is not None and not (0 < v < 1):
            raise ValueError(f"must lie in (0, 1), got {v}")
        return v


class PromptTuningConfig(_Block):
    enabled: bool = True
    n_tokens: int = Field(10, gt=0)
    lr: float = Field(0.05, gt=0)
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(32, gt=0, description="(expected) batch size")
    init: str | None = Field(None, description="words to initialise the prompt from")


class ZeroShotConfig(_Block):
    enabled: bool = True


class PublicDataConfig(_Block):
    """Public (non-private) text for distillation and prompt transfer: never the private data."""

    name: str = Field(description="dataset folder under the data root, e.g. tweet_sentiment")
    path: str | None = None
    split: str = "validation"
    text_field: str = "text"
    size: int | None = Field(None, gt=0)


class DistillConfig(_Block):
    student_layers: int = Field(2, gt=0)
    steps: int = Field(300, gt=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(5e-4, gt=0)
    alpha_ce: float = Field(0.5, ge=0)
    alpha_lm: float = Field(0.5, ge=0)
    alpha_cos: float = Field(1.0, ge=0)


class TransferConfig(_Block):
    steps: int = Field(200, gt=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(1e-3, gt=0)
    alpha: float = Field(0.5, ge=0, le=1, description="weight of the Δ-logit KL term")
    select_every: int = Field(0, ge=0, description="0: keep the prompt after `steps`; N: every N steps score "
                              "it by the transfer loss on held-out PUBLIC texts and keep the best")
    select_size: int = Field(200, gt=0, description="public texts held out for that selection")


class PostConfig(_Block):
    enabled: bool = False
    public: PublicDataConfig | None = None
    distill: DistillConfig = Field(default_factory=DistillConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    full_pt: bool = Field(False, description="non-private tuning on the target (an upper bound; opt-in)")


class MethodsConfig(_Block):
    zero_shot: ZeroShotConfig = Field(default_factory=lambda: ZeroShotConfig(enabled=False))
    prompt_sgd: PromptTuningConfig = Field(default_factory=lambda: PromptTuningConfig(enabled=False))
    prompt_dpsgd: PromptTuningConfig = Field(default_factory=PromptTuningConfig)
    post: PostConfig = Field(default_factory=PostConfig)


class MiaConfig(_Block):
    enabled: bool = True
    max_examples: int = Field(1000, gt=0, description="members and non-members scored, each")


TUNING_METHODS = ("prompt_dpsgd", "prompt_sgd")
FLOW_METHODS = TUNING_METHODS + ("post",)


class DaskConfig(_Block):
    address: str | None = Field(None, description="scheduler of an existing Dask cluster (default: local)")
    n_workers: int = Field(2, gt=0)
    threads_per_worker: int = Field(1, gt=0)


class AuditConfig(_Block):
    enabled: bool = False
    shadows: int = Field(8, ge=2, description="shadow prompts for LiRA (each example in half of them)")
    attacks: list[Literal["loss", "lira", "min_k"]] = Field(default_factory=lambda: ["loss", "lira", "min_k"])
    pool_size: int | None = Field(None, gt=3, description="audit pool (members + non-members)")
    fprs: list[float] = Field(default_factory=lambda: [0.01, 0.001])
    min_k: float = Field(0.2, gt=0, le=1)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    dask: DaskConfig = Field(default_factory=DaskConfig)

    @field_validator("fprs")
    @classmethod
    def _fprs(cls, v):
        if not v or any(not (0 < f < 1) for f in v):
            raise ValueError(f"every FPR must lie in (0, 1), got {v}")
        return v

    @field_validator("shadows")
    @classmethod
    def _even(cls, v):
        if v % 2:
            raise ValueError(f"must be even (each example is in exactly half of the shadows), got {v}")
        return v


class PrivPromptConfig(_Block):
    flow: Literal["prompt_tuning"] = "prompt_tuning"
    method: str = Field("prompt_dpsgd", description="the method this run publishes")
    experiment: str | None = Field(None, description="MLflow experiment (default: the method)")
    seed: int = 0
    state_dir: str | None = Field(None, description="default $PRIVPROMPT_HOME or ./.privprompt")
    data_root: str | None = Field(None, description="default $PRIVPROMPT_DATA_ROOT or ../shared/data")
    allow_nonprivate_baselines: bool = Field(False, description="opt-in for non-private baselines")
    data: DataConfig
    models: ModelsConfig
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    methods: MethodsConfig = Field(default_factory=MethodsConfig)
    mia: MiaConfig = Field(default_factory=MiaConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    sweep: list[dict[str, Any]] = Field(
        default_factory=list,
        description="variants, each a mapping of dotted keys to values; one flow run per variant")
    seeds: list[int] = Field(
        default_factory=list,
        description="run the config (every sweep variant) once per seed; the summary gives mean ± std")

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"seeds must be distinct, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.method not in FLOW_METHODS:
            raise ValueError(f"method {self.method!r} is not available; choose one of {list(FLOW_METHODS)}")
        # the published method always runs, whatever its `enabled` says (the flows ensure it)
        if self.method == "post":
            if self.methods.post.public is None:
                raise ValueError("methods.post.public: POST needs a public dataset for distillation and transfer")
            t, public = self.methods.post.transfer, self.methods.post.public
            if t.select_every and public.size is not None and t.select_size >= public.size:
                raise ValueError(f"methods.post.transfer.select_size = {t.select_size} holds out all "
                                 f"{public.size} public texts (methods.post.public.size): none left to train on")
            if self.methods.post.full_pt and not self.allow_nonprivate_baselines:
                raise ValueError("methods.post.full_pt is non-private tuning on the target: set "
                                 "allow_nonprivate_baselines: true to opt in")
        if (self.methods.prompt_sgd.enabled or self.method == "prompt_sgd") and not self.allow_nonprivate_baselines:
            raise ValueError("methods.prompt_sgd is non-private training: set "
                             "allow_nonprivate_baselines: true to opt in")
        return self

    @property
    def guarantee(self) -> str:
        return "dp" if self.method in ("prompt_dpsgd", "post") else "none"

    @property
    def experiment_name(self) -> str:
        return self.experiment or self.method


def _format_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown config key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        parts.append(f"{key}: {msg}")
    return "invalid config: " + "; ".join(parts)


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML scalars)."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key!r}: {p!r} is not a block")
            node = nxt
        node[parts[-1]] = _parse_value(value)
    return raw


def parse_config(raw: dict) -> PrivPromptConfig:
    if not isinstance(raw, dict):
        raise ConfigError("invalid config: the top level must be a mapping of keys")
    try:
        return PrivPromptConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> PrivPromptConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_config(apply_overrides(raw, overrides or []))


def config_to_yaml(cfg: PrivPromptConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def with_models(config: dict, local: str, target: str) -> dict:
    """A copy of a config dict with ``models.local`` / ``models.target`` replaced (POST runs its
    stages on the teacher or on the student; the audit's shadows do the same)."""
    return {**config, "models": {**config["models"], "local": local, "target": target}}


def sweep_variants(cfg: PrivPromptConfig) -> list[tuple[str, PrivPromptConfig]]:
    """The configs of a sweep (validated up front, before anything runs), with their labels."""
    import copy

    base = cfg.model_dump(mode="json")
    base["sweep"], base["seeds"] = [], []
    variants = list(cfg.sweep) or [{}]  # seeds alone: the config itself, once per seed
    seeds = cfg.seeds or [None]
    out = []
    for i, variant in enumerate(variants):
        if not isinstance(variant, dict) or (cfg.sweep and not variant):
            raise ConfigError(f"invalid config: sweep.{i}: must be a non-empty mapping of dotted keys to values")
        if cfg.seeds and "seed" in variant:
            raise ConfigError(f"invalid config: sweep.{i} sets seed, and seeds: {cfg.seeds} runs every variant "
                              "with each seed; use one or the other")
        for seed in seeds:
            item = dict(variant) if seed is None else {**variant, "seed": seed}
            overrides = [f"{k}={json.dumps(v)}" for k, v in item.items()]
            try:
                variant_cfg = parse_config(apply_overrides(copy.deepcopy(base), overrides))
            except ConfigError as err:
                raise ConfigError(f"sweep.{i} ({variant}): {err}") from None
            out.append((",".join(f"{k}={v}" for k, v in item.items()), variant_cfg))
    return out


def variant_group(label: str) -> str:
    """A sweep label without its seed: the runs that differ only by seed share it."""
    return ",".join(p for p in label.split(",") if p and not p.startswith("seed=")) or "base"
