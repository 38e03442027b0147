"""The method interface: what every method provides to the one lifecycle (``tasks/lifecycle.py``).

A method is a frozen :class:`MethodSpec` — what it is — registered by name
(``tasks.methods.register_method``), whose :class:`Mechanism` is what it does. The mechanism's
hooks, in the order the lifecycle calls them:

* ``plan(cfg, n_train, delta, epsilon)`` — pure (reads no data): the guarantee (``dp`` | ``ldp`` |
  ``none``, derived from the settings), the worst-case privacy event for ``dp`` calibrated to the
  ε share ``epsilon`` (given by the run's planner, ``tasks.run_plan.plan_for``; the config is
  never rewritten), and the params the run record logs. The lifecycle hands ``train`` and
  ``post_process`` the run's frozen ``privacy.plan.RunPlan`` (the same attribute names).
* ``prepare(ctx)`` — public data only, may be cached across runs (POST: the student).
* ``preflight(cfg, prepared)`` — every check that needs no private data (models and tokenizers
  load, label words / descriptions and template work on them): run by ``privprompt plan``
  (``prepared`` None) and by a run BEFORE its reservation, so a config mistake spends nothing.
* ``train(mctx, plan, rows, progress)`` — the ONLY hook that reads private rows; returns the
  trained prompt and the event actually spent (≤ the planned one).
* ``post_process(mctx, plan, prompt, progress)`` — public data only (POST: the transfer).
* ``chosen(mctx, plan, metrics)`` — what the run publishes of a choice among its outputs.

What the platform reads of a method besides its hooks the spec declares once: ``traits=Traits(...)``
(holdout, person unit, neighbour statistics, selection grid, test settings, ...), ``report=Report(...)``
(what it adds to the comparison report: ``privprompt report``, the sweep's summary;
``tasks/comparison.py`` reads the declarations from the registry and names no method) and
``extras=Extras(...)`` (what a few methods add: POST's variants and models, RAPT's own evaluation).
The interface before the spec, a ``Method`` subclass, is read by ``tasks/methods/legacy.py``.

``train`` and ``post_process`` get a :class:`MethodContext` (config, state paths, what
``prepare`` returned, DP randomness): no MLflow, no Prefect, so audit shadows call them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    from pathlib import Path

    from privacy.events import DpEvent
    from tasks.outcome import RunOutcome

    from ..config import PrivPromptConfig
    from ..randomness import DpRandomness
    from ..state import StatePaths

Guarantee = Literal["dp", "ldp", "none"]
Progress = Callable[[int, int], None]  # (step, total): progress only, never a private statistic


@dataclass
class MethodPlan:
    """A method's plan for ``n_train`` examples, computed without reading any data."""

    method: str
    guarantee: Guarantee
    n_train: int
    delta: float
    event: "DpEvent | None" = None   # worst case, for "dp"; None otherwise
    params: dict[str, Any] = field(default_factory=dict)      # logged on the parent run
    settings: dict[str, Any] = field(default_factory=dict)    # the method's own (JSON-able)
    reads_private: bool = True       # set by the run's planner from Traits.reads_private (one source)
    note: str = ""                   # said in budget.json (why no guarantee, what is post-processing)
    # a record-level run charged per person (data.person_field): the per-record event the target
    # calibrates; ``event`` is then its group-privacy charge (privacy.plan.plan_run)
    record_event: "DpEvent | None" = None

    def __post_init__(self):
        if self.guarantee not in ("dp", "ldp", "none"):
            raise ValueError(f"guarantee must be dp, ldp or none, got {self.guarantee!r}")
        if (self.event is not None) != (self.guarantee == "dp"):
            raise ValueError(f"{self.method}: a plan has a privacy event if and only if its guarantee is dp "
                             f"(guarantee {self.guarantee!r}, event {self.event!r})")


def budget(cfg: "PrivPromptConfig", epsilon: float | None) -> float:
    """The ε a method's plan calibrates to: its share ``epsilon`` when the planner gives one, else
    the user's whole ``privacy.target_epsilon`` (never a value written into the config)."""
    return float(cfg.privacy.target_epsilon if epsilon is None else epsilon)


@dataclass
class PrivateRows:
    """Private training rows handed to ``train`` (texts never leave the local side);
    ``validation``: disjoint private rows for selection, for methods that ask for them."""

    texts: list[str]
    labels: list[str]
    validation: "PrivateRows | None" = None
    # with a user privacy unit (``data.privacy_unit``): each row's keyed unit digest (rows sharing
    # one belong to one person); None: every row is its own unit
    units: list[str] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def unit_index(self) -> "tuple[list[int], int] | None":
        """(unit index 0..U-1 of each row, U) with a user unit; None when every row is its own unit."""
        if self.units is None:
            return None
        index: dict[str, int] = {}
        return [index.setdefault(u, len(index)) for u in self.units], len(index)

    def subset(self, idx) -> "PrivateRows":
        """The rows ``idx`` (with their units)."""
        idx = [int(i) for i in idx]
        return PrivateRows([self.texts[i] for i in idx], [self.labels[i] for i in idx],
                           units=None if self.units is None else [self.units[i] for i in idx])


@dataclass
class MethodContext:
    """What ``train`` / ``post_process`` may use: no tracking, no orchestration."""

    cfg: "PrivPromptConfig"
    paths: "StatePaths"
    prepared: dict[str, Any]
    randomness: "DpRandomness"
    seed: int
    output_dir: "Path | None" = None   # where mechanism outputs of this run may be written (outputs side)
    dataset_key: str | None = None     # the ledger's key of the private dataset (None: audit shadows)
    private_dir: "Path | None" = None  # the run's private working folder (a selection's operator log)


@dataclass
class Trained:
    """What ``train`` returns. ``history`` holds exact statistics of private data (losses): the
    lifecycle keeps it under private/ and never publishes it."""

    prompt: Any                    # a prompt object / tensor of the method's kind, or None
    event: "DpEvent | None"        # what was actually spent (dp), None otherwise
    steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # publishable (counts, not statistics of data)
    history: list[dict] = field(default_factory=list)
    # non-DP statistics of private data published as AUDIT statistics (e.g. DP-OPT's leakage
    # report): the lifecycle records them in the ledger as a non-private use
    audit_metrics: dict[str, float] = field(default_factory=dict)
    # set by the lifecycle for a record-level run charged per person: the per-record event, with
    # ``event`` its group-privacy charge (methods leave it None)
    record_event: "DpEvent | None" = None


@dataclass(frozen=True)
class Choice:
    """What a run publishes of a choice among settings: ``params`` (the parent's and the child's
    run record), ``tags`` (the parent's), ``meta`` (the published prompt file's), and the context
    and plan its output is post-processed with (None: the run's own)."""

    params: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    mctx: Any = None
    plan: Any = None


@dataclass
class PostProcessed:
    """What ``post_process`` returns: the published prompt and, optionally, a child run to log
    (public-data statistics only)."""

    prompt: Any
    steps: int = 0
    child: dict[str, Any] | None = None   # {"name", "tags", "params", "metrics", "series": {metric: [(step, v)]}}


@dataclass
class Variant:
    """An extra evaluated prompt: ``test.accuracy.<name>`` on ``model``."""

    name: str
    prompt_path: str | None
    model: str
    guarantee: Guarantee
    epsilon: float | None = None
    label: str | None = None     # shown in tables and plots


# ---- what a method adds to the comparison report (tasks/comparison.py reads the declarations) -----

@dataclass(frozen=True)
class ReportMetric:
    """A metric of a method's parent runs that the comparison report reads into the rows of that
    method's runs (``row[key]``), beside the generic ones (accuracy, ε, loss-MIA AUC, ...).

    ``names``: the logged metric names, the first one logged wins (a renamed metric's old name after
    its new one); ``prefix``: instead, every logged metric whose name starts with it, as a dict;
    ``transform``: applied to the value read. Runs of other methods get :meth:`empty` under ``key``,
    unless ``key`` is a generic one: the method's reading then replaces it for its own runs only.
    ``every_run``: read on EVERY run's row instead (what the other methods' runs log about this
    method, e.g. its accuracy as their baseline), before the runs' own methods' readings."""

    key: str
    names: tuple[str, ...] = ()
    prefix: str | None = None
    transform: Callable[[float], float] | None = None
    every_run: bool = False

    def empty(self) -> Any:
        return {} if self.prefix is not None else None

    def read(self, metrics: dict[str, float]) -> Any:
        if self.prefix is not None:
            return {k: v for k, v in metrics.items() if k.startswith(self.prefix)}
        for name in self.names:
            if name in metrics:
                return metrics[name] if self.transform is None else self.transform(metrics[name])
        return None


@dataclass(frozen=True)
class SummaryColumn:
    """A column of the report's per-label summary (``report/summary.md``): ``value(row)`` of each
    run of a group (None: not logged), shown as mean ± sample std over the group."""

    header: str
    value: Callable[[dict], float | None]


@dataclass(frozen=True)
class ReferenceAccuracy:
    """An accuracy every run is compared with on its own test split (the zero-shot baseline): a
    column "<label> accuracy" beside the test accuracy in the report's tables and a horizontal line
    per dataset in its accuracy panel, from the rows' ``key`` (a :class:`ReportMetric`)."""

    key: str
    label: str


@dataclass(frozen=True)
class LevelPanel:
    """A panel of the privacy–utility figure: ``key`` of the local-DP runs' rows against their
    privacy level (the method's ``ldp_level``), one line through the seed means per label."""

    key: str
    ylabel: str


@dataclass(frozen=True)
class ReportArtifact:
    """An artifact of the report at ``path``: ``build(rows)`` (every run's row) returns a Markdown
    table (str), a matplotlib figure, or None (nothing to show: not logged)."""

    path: str
    build: Callable[[list[dict]], Any]


ReportSection = ReferenceAccuracy | SummaryColumn | LevelPanel | ReportArtifact


@dataclass(frozen=True)
class Report:
    """What a method adds to the comparison report (``privprompt report``, the sweep's summary;
    ``tasks/comparison.py`` reads it from the registry and names no method), declared once
    (``report = Report(...)``).

    ``metrics``: read into the rows of its runs (or of every run, with ``every_run``) beyond the
    generic ones (RAPT: its empirical privacy; the prefix methods: their flatness curves; zero-shot:
    its accuracy, on its own runs and as the others' baseline). ``sections``: built from every run's
    row — summary columns, panels of the privacy–utility figure, artifacts; a section several methods
    declare is shown once. ``run_label(cfg)``: how a run is named in comparisons (tag ``method.label``)
    where runs of one method differ in kind (Privacy-Flat's ladder); None: the method's name.
    ``ldp_level(params)``: the local-DP parameter of a run (an ``ldp`` run has no ε) read back from its
    logged params (RAPT: η); None: the method has none."""

    metrics: tuple[ReportMetric, ...] = ()
    sections: tuple[ReportSection, ...] = ()
    run_label: Callable[["PrivPromptConfig"], str] | None = None
    ldp_level: Callable[[dict], float | None] | None = None

    def __post_init__(self):
        object.__setattr__(self, "metrics", tuple(self.metrics))
        object.__setattr__(self, "sections", tuple(self.sections))


@dataclass(frozen=True)
class Traits:
    """What the platform reads of a method besides its hooks, declared once (``traits = Traits(...)``).

    ``reads_private``: False for a method that never reads private training rows (zero-shot).
    ``uses_validation``: ``train`` also gets the holdout (``rows.validation``). ``unit_level``: its dp
    mechanism bounds each privacy unit's contribution when ``data.privacy_unit`` names a person
    (``rows.units``: Poisson sampling of units, one clipped contribution per unit, the accountant over
    units); a dp method without it is refused there. ``neighbour_statistics``: the names of the
    deterministic pre-noise statistics of its release (tasks/neighbours.py), which the neighbour
    harness computes on neighbouring datasets; () where none is declared (a dp plan is then refused).
    ``compares_with_no_prompt``: its own dp mechanism already chooses between its output and no
    prompt on the holdout (DP-OPT's DP-argmax with the empty instruction among its candidates), so its
    run gets no separate comparison (``fallback``; tasks/no_prompt.py). ``supports_loss_mia``: the
    in-flow loss attack applies. ``always_dp``: the plan is dp under every setting (the planner does
    not first ask it at the whole budget: a selection). ``release``: the name of its own release in the
    run's plan, the kind that runs it (tasks/releases.py). ``stage_names``: its own names of the
    pipeline's stages in the run summary (POST: distill, tune, transfer). ``selection_grid``: the
    candidates ``selection: {enabled: true}`` chooses from when the config lists none (settings of
    ``methods.<name>``, dotted for nested blocks; the platform adds "no prompt"; the default is the
    configured settings alone). ``test_settings``: settings of ``methods.<name>`` small enough to
    train in seconds on the tiny test models (the contract test runs every method with them)."""

    reads_private: bool = True
    uses_validation: bool = False
    unit_level: bool = False
    neighbour_statistics: tuple[str, ...] = ()
    compares_with_no_prompt: bool = False
    supports_loss_mia: bool = True
    always_dp: bool = False
    release: str = "method"
    stage_names: tuple[tuple[str, str], ...] = ()
    selection_grid: tuple[dict[str, Any], ...] = ({},)
    test_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("reads_private", "uses_validation", "unit_level", "compares_with_no_prompt", "supports_loss_mia",
                     "always_dp"):
            if not isinstance(getattr(self, name), bool):  # a truthy object would pass a person-unit check
                raise TypeError(f"Traits.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.release, str) or isinstance(self.neighbour_statistics, str):
            raise TypeError("Traits.release is a name and Traits.neighbour_statistics a tuple of names")
        object.__setattr__(self, "neighbour_statistics", tuple(self.neighbour_statistics))
        names = self.stage_names.items() if isinstance(self.stage_names, dict) else self.stage_names
        object.__setattr__(self, "stage_names", tuple((str(k), str(v)) for k, v in names))
        if isinstance(self.selection_grid, dict) or not all(isinstance(c, dict) for c in self.selection_grid):
            raise TypeError("Traits.selection_grid is a sequence of settings dicts")
        object.__setattr__(self, "selection_grid", tuple(dict(c) for c in self.selection_grid))
        object.__setattr__(self, "test_settings", dict(self.test_settings))


TRAIT_NAMES = tuple(f.name for f in fields(Traits))


def dp_unless_debug(cfg: "PrivPromptConfig") -> Guarantee:
    """``dp``, except under the seeded-DP-randomness debug switch (the noise is then known)."""
    return "none" if cfg.debug_seeded_dp_randomness else "dp"


def settings_of(cfg: "PrivPromptConfig", method: "MethodSpec | Mechanism") -> Any:
    """The config block ``methods.<name>`` of ``method`` (a spec, or a mechanism bound to one)."""
    spec = method.spec if isinstance(method, Mechanism) else method
    return getattr(cfg.methods, spec.name)


class Mechanism:
    """What a method DOES, in the order the door calls it; :class:`MethodSpec` declares the rest.
    A subclass implements ``guarantee``, ``plan`` and ``train``; the others have working defaults.
    ``spec`` is the declaration it was registered with (its name, traits and config block)."""

    spec: "MethodSpec"

    def guarantee(self, cfg: "PrivPromptConfig") -> Guarantee:
        """The guarantee this method's settings give (not its name): ``dp`` | ``ldp`` | ``none``."""
        raise NotImplementedError

    def plan(self, cfg: "PrivPromptConfig", n_train: int, delta: float, epsilon: float | None = None) -> MethodPlan:
        """Pure (reads no data): the plan for ``n_train`` units at the ε share ``epsilon`` and δ share
        ``delta`` the run's planner gives (``tasks.run_plan.plan_for``); None — a plan asked directly,
        e.g. an audit's shadows — calibrates to the config's whole ``privacy.target_epsilon``
        (:func:`budget`). The config is never rewritten."""
        raise NotImplementedError

    def train(self, mctx: MethodContext, plan: MethodPlan, rows: PrivateRows,
              progress: Progress | None = None) -> Trained:
        """The ONLY hook that reads private rows: the trained output and the event actually spent
        (≤ the planned one)."""
        raise NotImplementedError

    def post_process(self, mctx: MethodContext, plan: MethodPlan, prompt: Any,
                     progress: Progress | None = None) -> PostProcessed:
        """Public data and the DP output only (POST: the transfer). The default: the output as it is."""
        return PostProcessed(prompt)

    def prepare(self, ctx, progress: Progress | None = None) -> dict[str, Any]:
        """Public data only, may be cached across runs (POST: the student). The returned dict is
        JSON-able; its ``tags`` go on the parent run."""
        return {}

    def preflight(self, cfg: "PrivPromptConfig", prepared: dict[str, Any] | None) -> None:
        """Checks that need no private data, raising a one-line user error (``ConfigError``,
        ``ModelLoadError``): the same in ``privprompt plan`` (``prepared`` is None: ``prepare`` has
        not run) and in a run, before any budget is reserved. The default, for a soft prompt or
        prefix trained on ``models.local``: its classifier (model, tokenizer, label words, template)."""
        spec = self.spec
        if spec.prompt_kind in ("soft", "prefix") and spec.traits.reads_private:
            check_classifier(cfg, cfg.models.local, "models.local", getattr(settings_of(cfg, spec), "n_tokens", 0))

    def chosen(self, mctx: MethodContext, plan: MethodPlan, metrics: dict) -> Choice:
        """What the run publishes of a choice the method made among its own outputs, from released
        numbers only (DP-OPT: the generated prompt, the initial one or none). The default: nothing."""
        return Choice()


def local_model(cfg: "PrivPromptConfig", prepared: dict[str, Any]) -> str:
    """``models.local``: where a method's prompt is trained and used unless it says otherwise."""
    return cfg.models.local


def _no_check(cfg: "PrivPromptConfig", published: bool) -> None:
    return None


def _no_public_data(cfg: "PrivPromptConfig") -> bool:
    return False


def _nothing_missing(prepared: dict[str, Any]) -> str:
    return ""


def _no_variants(ctx, result: "RunOutcome", prepared: dict[str, Any], run_method) -> list[Variant]:
    return []


def _no_diagnostics(ctx, prompt_path: str, mctx: MethodContext) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Extras:
    """What a few methods add beyond their mechanism, as callables (the defaults: nothing added).

    ``validate(cfg, published)``: config-time checks (ValueError naming the key; ``published``: the
    run's method). ``uses_public_data(cfg)``: it needs the config's ``public:`` data.
    ``published_model(cfg, prepared)``: the model the published prompt is used (and attacked) on;
    ``source_model(cfg, prepared)``: the one ``train``'s prompt is trained on, before
    ``post_process`` (POST: the student); ``missing_prepared(prepared)``: what an audit of a
    finished run lacks of ``prepare``'s output ('' when nothing). ``evaluate_published(ctx,
    prompt_path, mctx)``: test accuracy computed the method's own way (RAPT: on privatized inputs);
    None: the generic evaluation. ``variants(ctx, result, prepared, run_method)``: extra evaluated
    prompts (:class:`Variant`; ``run_method(name)`` runs another registered method through the door).
    ``diagnostics(ctx, prompt_path, mctx)``: statistics of the published prompt on the TEST split only:
    {"metrics": {...}, "figures": {artifact path: matplotlib figure}}."""

    validate: Callable[["PrivPromptConfig", bool], None] = _no_check
    uses_public_data: Callable[["PrivPromptConfig"], bool] = _no_public_data
    published_model: Callable[["PrivPromptConfig", dict], str] = local_model
    source_model: Callable[["PrivPromptConfig", dict], str] = local_model
    missing_prepared: Callable[[dict], str] = _nothing_missing
    evaluate_published: Callable[..., "float | None"] | None = None
    variants: Callable[..., list[Variant]] = _no_variants
    diagnostics: Callable[..., dict[str, Any]] = _no_diagnostics


PROMPT_KINDS = ("soft", "prefix", "text", "lora", "none")


@dataclass(frozen=True)
class MethodSpec:
    """A method as the platform knows it, declared once and registered by name
    (``tasks.methods.register_method``): its ``name`` (``methods.<name>`` in a config), its
    ``config_class`` (the pydantic block there), its ``mechanism`` (what it does), the
    ``prompt_kind`` it publishes (soft | prefix | text | lora | none), a ``label`` for tables, its
    :class:`Traits`, what it adds to the comparison :class:`Report`, and its :class:`Extras`."""

    name: str
    config_class: type
    mechanism: Mechanism
    prompt_kind: str = "soft"
    label: str = ""
    traits: Traits = Traits()
    report: Report = Report()
    extras: Extras = Extras()

    def __post_init__(self):
        if not isinstance(self.mechanism, Mechanism):
            raise TypeError(f"method {self.name!r}: mechanism must be a Mechanism instance, got {self.mechanism!r}")
        if self.prompt_kind not in PROMPT_KINDS:
            raise ValueError(f"method {self.name!r}: prompt_kind must be one of {', '.join(PROMPT_KINDS)}")
        for name, kind in (("traits", Traits), ("report", Report), ("extras", Extras)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"method {self.name!r}: {name} must be a {kind.__name__}")
        bound = getattr(self.mechanism, "spec", None)
        if bound is None:  # a spec derived from another (dataclasses.replace) keeps its mechanism's binding
            self.mechanism.spec = self
        elif bound.name != self.name:
            raise ValueError(f"method {self.name!r}: its mechanism is already the mechanism of {bound.name!r}")
        elif (bound.prompt_kind, bound.config_class, bound.traits.reads_private) != (
                self.prompt_kind, self.config_class, self.traits.reads_private):
            # what the mechanism reads of its spec (the default preflight): a derived spec changing it
            # needs a mechanism of its own, or its checks would follow the first spec
            raise ValueError(f"method {self.name!r}: a spec derived with another prompt_kind, config_class or "
                             "reads_private needs its own mechanism instance")


def run_label(method: MethodSpec, cfg: "PrivPromptConfig") -> str:
    """How a run of ``method`` under ``cfg`` is named in comparisons (its report's ``run_label``)."""
    return method.report.run_label(cfg) if method.report.run_label is not None else method.name


def check_classifier(cfg: "PrivPromptConfig", model_name: str, role: str, prompt_tokens: int = 0) -> None:
    """Build the frozen classifier of ``model_name`` for the config's labels (cached, so a run pays
    for it once): the model and tokenizer load, the label words (masked / causal LMs: the first
    token of each ``models.label_descriptions`` entry, default " <label>") are told apart, the
    template fits the model, and ``models.max_length`` plus ``prompt_tokens`` soft-prompt or prefix
    positions fit the model's positions — else one long private record, cut to max_length, would
    crash the DP step that samples it or the holdout scoring (a crash decided by one
    record). Raises ``ModelLoadError`` or a one-line ``ConfigError``. A check that passed for the
    same model files, settings and code is not built again (``tasks.check_memo``)."""
    from models.backbones import ModelLoadError

    from .. import check_memo
    from ..errors import ConfigError
    from ..methodkit.classifiers import classifier_for

    memo = check_memo.key(cfg, model_name)
    known = check_memo.passed(memo)
    if known is not None:  # the same files, settings and code passed before: only the positions again
        check_positions(cfg, known["max_positions"], prompt_tokens, model_name, role)
        return
    try:
        clf = classifier_for(cfg, model_name)
    except ModelLoadError:
        raise
    except (ValueError, KeyError, IndexError) as exc:
        raise ConfigError(explain_classifier_error(exc, model_name, role)) from None
    check_positions(cfg, clf.backbone.max_positions, prompt_tokens, model_name, role)
    from models.row_own import int8_outliers

    if int8_outliers(clf.backbone.model):  # a checkpoint saved in 8-bit keeps its own threshold
        raise ConfigError(f"{role}={model_name!r} runs 8-bit weights with LLM.int8's outlier columns (llm_int8_threshold "
                          "> 0, as a checkpoint saved in 8-bit keeps): they are chosen over a whole batch, so one record "
                          "would move the other records' gradients and scores; load it with models.placement.quantization: "
                          "4bit or unquantised")
    check_memo.remember(memo, {"max_positions": clf.backbone.max_positions})


def check_positions(cfg: "PrivPromptConfig", limit: int | None, prompt_tokens: int, model_name: str, role: str) -> None:
    """``models.max_length`` plus ``prompt_tokens`` within a model's ``limit`` positions (None: no
    limit), else one line."""
    from ..errors import ConfigError

    if limit is not None and cfg.models.max_length + prompt_tokens > limit:
        raise ConfigError(f"models.max_length={cfg.models.max_length}" + (f" + {prompt_tokens} prompt positions"
                          if prompt_tokens else "") + f" exceed the {limit} positions of {role}={model_name!r}: "
                          f"lower models.max_length to at most {limit - prompt_tokens}")


def explain_classifier_error(exc: BaseException, model_name: str, role: str) -> str:
    """A one-line message for a classifier that cannot be built on ``model_name``."""
    text = " ".join(str(exc).split())
    if "share a first token" in text:
        return (f"models.label_descriptions on {role}={model_name!r}: {text}; a masked or causal LM scores each "
                "label by the FIRST token of its label word, so give every label a short word with its own first "
                "token (e.g. ' great' / ' terrible'); sentences work only for an encoder such as minilm "
                "(cosine to the description)")
    if "gives no tokens" in text:
        return f"models.label_descriptions on {role}={model_name!r}: {text}"
    return f"models.template / data.labels on {role}={model_name!r}: {type(exc).__name__}: {text}"
