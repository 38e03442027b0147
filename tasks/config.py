"""One config schema (pydantic) for every flow: data, models, privacy, method blocks, seed,
experiment. Unknown keys are errors; every error names the key and the problem."""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Iterator

import yaml
from pydantic import BaseModel, ConfigDict, Field, InstanceOf, ValidationError, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from .errors import ConfigError

from .schema import (AuditConfig, Block, DaskConfig, DataConfig, DPICLConfig, DPSGDConfig, MiaConfig,  # noqa: F401
                     ModelsConfig, PrivacyConfig, PromptTuningConfig, PublicDataConfig, SelectionConfig,
                     FallbackConfig)
from .state import digest_key


def method_blocks() -> dict[str, type[Block]]:
    """Each registered method's config block class by name, in the registry's order: what
    ``methods.<name>`` is validated against (read at parse time: a method registered later is
    validated the same way, and the schema itself never changes)."""
    from .methods import METHODS

    return {method.name: method.config_class for method in METHODS.values()}


def _line_errors(name: str, err: ValidationError) -> list[dict]:
    """``err``'s errors as line errors under ``methods.<name>`` (their type and message kept)."""
    from pydantic_core import PydanticCustomError

    out = []
    for e in err.errors():
        line = {"type": e["type"], "loc": (name, *e["loc"]), "input": e["input"]}
        if e.get("ctx"):
            line["ctx"] = e["ctx"]
        try:  # a pydantic error type as it is; a custom one keeps its type name and message
            ValidationError.from_exception_data("check", [line])
        except (KeyError, TypeError, ValueError):
            line = {"type": PydanticCustomError(e["type"], e["msg"]), "loc": line["loc"], "input": e["input"]}
        out.append(line)
    return out


class MethodsConfig(Block):
    """One block per registered method (`methods.<name>`), its defaults filled in.

    The schema is fixed: each entry is validated at parse time against the block class its method
    registered (:func:`method_blocks`), so a method registered after import needs no rebuild. The
    blocks are kept in the registry's order, as fields would be (``model_dump`` is unchanged); an
    unknown name is an unknown key, a method's own error keeps its location ``methods.<name>.<key>``."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _registered_blocks(cls, data, handler):
        if isinstance(data, cls) or not isinstance(data, dict):
            return handler(data)
        blocks, errors, out = method_blocks(), [], {}
        for name, block in blocks.items():
            try:
                out[name] = block.model_validate(data[name]) if name in data else block()
            except ValidationError as err:
                errors.extend(_line_errors(name, err))
        errors += [{"type": "extra_forbidden", "loc": (name,), "input": value}  # as pydantic orders them
                   for name, value in data.items() if name not in blocks]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return handler(out)


class LedgerConfig(Block):
    url: str | None = Field(
        None, description="the privacy ledger's database: sqlite:////abs/path.sqlite or postgresql://user@host:port/db "
                          "(a team's shared ledger); default $PRIVPROMPT_LEDGER_URL, else the SQLite file in the state "
                          "folder. No password here (the config is logged): use $PRIVPROMPT_LEDGER_URL or ~/.pgpass")

    @field_validator("url")
    @classmethod
    def _ledger_url(cls, v):
        if v is None:
            return v
        from privacy.ledger.store import mask_url, resolve

        if "://" not in v:
            raise ValueError(f"{v!r} is not a ledger URL: use sqlite:////abs/path.sqlite or postgresql://user@host/db")
        from sqlalchemy.engine import make_url

        try:  # the password first: the rest (driver installed?) is checked by resolve
            has_password = bool(make_url(v).password)
        except Exception:  # noqa: BLE001 - malformed: resolve says so in one line
            has_password = False
        if has_password:
            raise ValueError(f"{mask_url(v)} carries a password, and the config is logged to MLflow: put the URL in "
                             "$PRIVPROMPT_LEDGER_URL (or the password in ~/.pgpass) instead")
        resolve(v)
        return v


# A key configs had while there was one flow per method (its one value named the flow); no code
# read it. Old configs still validate (it is dropped), and config hashes stay what they were.
LEGACY_FLOW_KEY = ("flow", "prompt_tuning")


class PrivPromptConfig(Block):
    method: str = Field("prompt_dpsgd", description="the method this run publishes")
    experiment: str | None = Field(None, description="MLflow experiment (default: the method)")
    seed: int = 0
    state_dir: str | None = Field(None, description="default $PRIVPROMPT_HOME, else one folder per user "
                                                     "(platformdirs user_data_dir: ~/.local/share/privprompt on Linux); "
                                                     "mode 0700, and private/ with every file in it 0700 / 0600, "
                                                     "whatever the umask")
    data_root: str | None = Field(None, description="default $PRIVPROMPT_DATA_ROOT or ../shared/data")
    ledger: LedgerConfig = Field(default_factory=LedgerConfig, description="where the privacy budget ledger lives")
    allow_nonprivate_baselines: bool = Field(False, description="opt-in for non-private baselines")
    data: DataConfig
    models: ModelsConfig
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    methods: MethodsConfig = Field(default_factory=MethodsConfig)
    public: PublicDataConfig | None = Field(None, description="public text (POST's distillation and transfer, RAPT's vocabulary)")
    debug_seeded_dp_randomness: bool = Field(
        False, description="DEBUG ONLY: derive DP noise and sampling from `seed` (replayable); the run then has "
                           "no guarantee (privacy.guarantee=none) and publishes nothing")
    selection: SelectionConfig = Field(default_factory=SelectionConfig,
                                       description="private selection of the published method's settings (issue 30)")
    dp_icl: DPICLConfig = Field(default_factory=DPICLConfig, description="DP-ICL served per query by "
                                "`privprompt predict --dp-icl`, each answered batch charged to the ledger")
    fallback: FallbackConfig = Field(default_factory=FallbackConfig,
                                     description="every dp run compared with no prompt on the holdout (a released, "
                                     "accounted difference), and no prompt published when it loses (issue 41)")
    mia: MiaConfig = Field(default_factory=MiaConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    sweep: list[dict[str, Any]] = Field(
        default_factory=list,
        description="variants, each a mapping of dotted keys to values; one flow run per variant")
    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="dotted key -> values: one variant per combination (cartesian product), beside `sweep:`")
    seeds: list[int] = Field(
        default_factory=list,
        description="run the config (every sweep variant) once per seed; the summary gives mean ± std")
    sweep_dask: DaskConfig | None = Field(
        None, description="run a sweep's variants as tasks on a DaskTaskRunner (a local cluster of n_workers "
                          "processes, or `address`); variants with an audit run serially in the sweep flow")

    @field_validator("grid")
    @classmethod
    def _grid_values(cls, v):
        for key, values in v.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"grid.{key} must be a non-empty list of values, got {values!r}")
        return v

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"seeds must be distinct, got {v}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _drop_legacy_flow_key(cls, data):
        key, value = LEGACY_FLOW_KEY
        if isinstance(data, dict) and data.get(key) == value:  # any other value stays an unknown key
            data = {k: v for k, v in data.items() if k != key}
        return data

    @model_validator(mode="after")
    def _consistent(self):
        from .methods import registered_methods

        if self.method not in registered_methods():
            raise ValueError(f"method {self.method!r} is not registered; choose one of {registered_methods()}")
        return self

    @property
    def run_methods(self) -> list[str]:
        """The methods a flow runs: enabled baselines first, the published method last."""
        from .methods import registered_methods

        baselines = [m for m in registered_methods()
                     if m != self.method and getattr(getattr(self.methods, m), "enabled", False)]
        return baselines + [self.method]

    @property
    def experiment_name(self) -> str:
        return self.experiment or self.method


# A flow parameter that may be a config parsed already (a sweep's variant, an audit's target): taken
# as it is (an isinstance check, never a parse by Prefect's parameter validation), and absent from
# the deployments' parameter schema (a deployment passes a YAML path or a dict).
ParsedConfig = SkipJsonSchema[InstanceOf[PrivPromptConfig]]
ParsedAuditConfig = SkipJsonSchema[InstanceOf[AuditConfig]]


def _format_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            hint = did_you_mean(tuple(e["loc"]))
            msg = "unknown config key" + (f" ({hint})" if hint else "")
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
        cfg = PrivPromptConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    from .method_checks import check_methods

    try:
        check_methods(cfg)
    except ValueError as exc:
        raise ConfigError(f"invalid config: <root>: Value error, {exc}") from None
    return cfg


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

    import itertools

    base = cfg.model_dump(mode="json")
    base["sweep"], base["seeds"], base["grid"], base["sweep_dask"] = [], [], {}, None
    grid = [dict(zip(cfg.grid, combo)) for combo in itertools.product(*cfg.grid.values())] if cfg.grid else []
    variants = list(cfg.sweep) + grid or [{}]  # seeds alone: the config itself, once per seed
    seeds = cfg.seeds or [None]
    out = []
    for i, variant in enumerate(variants):
        if not isinstance(variant, dict) or ((cfg.sweep or cfg.grid) and not variant):
            raise ConfigError(f"invalid config: sweep.{i}: must be a non-empty mapping of dotted keys to values")
        if cfg.seeds and "seed" in variant:
            raise ConfigError(f"invalid config: sweep.{i} sets seed, and seeds: {cfg.seeds} runs every variant "
                              "with each seed; use one or the other")
        for seed in seeds:
            item = dict(variant) if seed is None else {**variant, "seed": seed}
            overrides = [f"{k}={json.dumps(v)}" for k, v in item.items()]
            try:  # the config itself (no override) is not parsed again
                variant_cfg = (parse_config(apply_overrides(copy.deepcopy(base), overrides)) if overrides else
                               cfg.model_copy(update={"sweep": [], "seeds": [], "grid": {}, "sweep_dask": None}))
            except ConfigError as err:
                raise ConfigError(f"sweep.{i} ({variant}): {err}") from None
            out.append((",".join(f"{k}={v}" for k, v in item.items()), variant_cfg))
    return out


def _drop_new_defaults(cfg: PrivPromptConfig, data: dict) -> None:
    """Keys added later hash as before they existed while at their defaults (placement, a Dask
    cluster's devices, the dp_icl block, the fallback block): stored runs' config.hash still match."""
    from .schema import DPICLConfig, PlacementConfig

    if cfg.dp_icl == DPICLConfig():
        data.pop("dp_icl", None)
    elif cfg.dp_icl.compare_queries == DPICLConfig().compare_queries:
        data["dp_icl"].pop("compare_queries", None)
    if cfg.fallback == FallbackConfig():  # a finished run of a sweep stays finished (not re-run and re-charged)
        data.pop("fallback", None)
    if cfg.models.placement == PlacementConfig() and not cfg.models.placement_for:
        data["models"].pop("placement", None)
        data["models"].pop("placement_for", None)
    for block in ("audit", "sweep_dask"):
        dask = data.get(block, {}).get("dask") if block == "audit" else data.get(block)
        if isinstance(dask, dict) and dask.get("devices") is None:
            dask.pop("devices", None)


def config_hash(cfg: PrivPromptConfig) -> str:
    """A hash of the validated config minus where it runs (state folder, ledger): a rerun of the same
    variant has the same hash (resumable sweeps skip variants with a FINISHED run of it)."""
    return digest_key(_hashed(cfg), length=20)


def config_family(cfg: PrivPromptConfig) -> str:
    """:func:`config_hash` without the seed and the target ε: the runs ``privprompt report`` may pool
    (seeds of one config, at each target), and never runs of different settings."""
    data = _hashed(cfg)
    data.pop("seed", None)
    data.get("privacy", {}).pop("target_epsilon", None)
    return digest_key(data, length=20)


def _hashed(cfg: PrivPromptConfig) -> dict:
    from .data import data_dump

    data = cfg.model_dump(mode="json")
    for key in ("state_dir", "ledger", "sweep", "grid", "seeds", "sweep_dask"):
        data.pop(key, None)
    data["data"] = data_dump(cfg.data)  # the unit at its default hashes as before it existed
    if cfg.selection == SelectionConfig():  # hashed as before the block existed: stored runs' config.hash still match
        data.pop("selection", None)
    _drop_new_defaults(cfg, data)
    data[LEGACY_FLOW_KEY[0]] = LEGACY_FLOW_KEY[1]  # hashed as before: stored runs' config.hash still match
    return data


def variant_group(label: str) -> str:
    """A sweep label without its seed: the runs that differ only by seed share it."""
    return ",".join(p for p in label.split(",") if p and not p.startswith("seed=")) or "base"


# ---- the schema's keys (read by the config reference and the did-you-mean hints) ----------------

def _block_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The config block inside an annotation (``X``, ``X | None``, ``list[X]``) and whether it is a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        blocks = [b for b in (_block_of(a) for a in args if a is not type(None)) if b[0] is not None]
        return blocks[0] if len(blocks) == 1 else (None, False)
    if origin is list and args:
        inner, _ = _block_of(args[0])
        return inner, inner is not None
    return None, False


def _fields(block: type[BaseModel]) -> list[tuple[str, Any]]:
    """A block's fields in schema order; the ``methods:`` block's entries (one per registered
    method, validated against its block at parse time) by name: the registry's order may change."""
    if block is MethodsConfig:
        from pydantic import Field
        from pydantic.fields import FieldInfo

        return sorted((name, FieldInfo.from_annotated_attribute(cls, Field(default_factory=cls)))
                      for name, cls in method_blocks().items())
    return list(block.model_fields.items())


def walk(model: type[BaseModel] | None = None, prefix: str = "") -> Iterator[tuple[str, Any, type[BaseModel] | None]]:
    """Every key of the schema, depth first: (dotted key, field, the block it opens or None).
    A list of blocks (``models.endpoints``) appears as ``key[]`` with its block's keys under it."""
    model = model or PrivPromptConfig
    for name, field in _fields(model):
        key = f"{prefix}{name}"
        block, is_list = _block_of(field.annotation)
        yield key, field, block
        if block is not None:
            yield from walk(block, f"{key}[]." if is_list else f"{key}.")


def all_keys() -> list[str]:
    """Every dotted key of the schema (list items as ``key[]``)."""
    return [key for key, _, _ in walk()]


def _block_at(loc: tuple) -> type[BaseModel] | None:
    """The block a validation error location's last element was looked up in."""
    block = PrivPromptConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = dict(_fields(block)).get(part)
        if field is None:
            return None
        block, _ = _block_of(field.annotation)
        if block is None:
            return None
    return block


def did_you_mean(loc: tuple) -> str:
    """A hint for an unknown key at ``loc`` (a pydantic error location): the closest keys of the
    same block (difflib), else a block elsewhere that has a key of that name. '' when none."""
    if not loc or not isinstance(loc[-1], str):
        return ""
    name = loc[-1]
    prefix = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
    block = _block_at(loc)
    if block is not None:
        close = difflib.get_close_matches(name, [key for key, _ in _fields(block)], n=2, cutoff=0.6)
        if close:
            return "did you mean " + " or ".join(f"'{prefix + '.' if prefix else ''}{c}'" for c in close) + "?"
    elsewhere = [k.replace("[]", "") for k in all_keys() if k.rsplit(".", 1)[-1] == name]
    if elsewhere:
        return "did you mean " + " or ".join(f"'{k}'" for k in elsewhere[:3]) + " (a key of another block)?"
    leaves = {k.rsplit(".", 1)[-1]: k.replace("[]", "") for k in all_keys()}
    close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.75)
    return f"did you mean '{leaves[close[0]]}'?" if close else ""
