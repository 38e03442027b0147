"""The method interface before :class:`~tasks.methods.base.MethodSpec`, kept working for one
release: a :class:`Method` subclass — name, config block, traits and report as class attributes,
its hooks and extras as methods — registered with ``register_method`` becomes a spec whose
mechanism is an instance of the class (:func:`spec_from_class`). Members older still (traits as
class attributes, ``contract_test_config()``, ``selection_grid(cfg)``, ``reads_private_data(cfg)``,
``report_metrics()``, ``report_sections()``, ``run_label(cfg)``, ``ldp_level(params)``) are read into
its traits and report with a DeprecationWarning; ``default_delta`` is refused (δ follows the
platform's one policy)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from .base import TRAIT_NAMES, Extras, Mechanism, MethodSpec, Report, Traits


LEGACY_REPORT = ("report_metrics", "report_sections", "run_label", "ldp_level")


LEGACY_MEMBERS = ("contract_test_config", "selection_grid", "reads_private_data", *LEGACY_REPORT)


def _read_legacy_members(cls) -> None:
    """Read the members of the interface before :class:`Traits` / :class:`Report` that ``cls``
    defines or inherits from a class other than :class:`Method` into its ``traits`` and ``report``
    (see ``Method.__init_subclass__``): bound to ``cls`` itself, so a subclass's name is its own; a
    ``traits`` or ``report`` declared nearer to ``cls`` wins over an inherited old member. A class
    without a ``name`` (an intermediate base) is read when its registered subclass is."""
    found, declared = {}, set()  # declared: "traits" / "report" set by a class nearer to cls
    for base in cls.__mro__:
        if base in (Method, Mechanism, object):
            continue
        for name in (*TRAIT_NAMES, *LEGACY_MEMBERS, "default_delta"):
            over = "report" if name in LEGACY_REPORT else "traits"
            if name in base.__dict__ and name not in found and (over not in declared or name == "default_delta"):
                found[name] = base
        declared |= ({"traits", "report"} & set(base.__dict__)) - base.__dict__.get("_read_from_legacy", set())
    if "default_delta" in found:
        raise TypeError(f"method class {cls.__qualname__}: default_delta (from {found['default_delta'].__qualname__}) is "
                        "no longer read (every run's default δ is min(1e-5, 1/(10 n)), rounded down); set "
                        "privacy.target_delta for a smaller δ")
    # attributes as traits: only where the class itself sets one (an inherited one is in its parent's traits)
    traits = {name: cls.__dict__[name] for name in TRAIT_NAMES if name in cls.__dict__}
    legacy = [name for name in LEGACY_MEMBERS if name in found]
    if not (traits or legacy):
        return
    import warnings

    warnings.warn(f"method class {cls.__qualname__}: {', '.join(sorted({*traits, *legacy}))} are read into its traits "
                  "and report for one release; declare traits = Traits(...) and report = Report(...) (tasks.methods)",
                  DeprecationWarning, stacklevel=3)
    report = {}
    if legacy and isinstance(getattr(cls, "name", None), str):
        try:
            instance = cls()
            if "contract_test_config" in found:
                traits["test_settings"] = dict(getattr(cls, "contract_test_config")())
            if "selection_grid" in found:
                traits["selection_grid"] = tuple(getattr(cls, "selection_grid")(instance, None))
            if "reads_private_data" in found:
                traits["reads_private"] = bool(getattr(cls, "reads_private_data")(instance, None))
            if "report_metrics" in found:
                report["metrics"] = tuple(getattr(cls, "report_metrics")(instance))
            if "report_sections" in found:
                report["sections"] = tuple(getattr(cls, "report_sections")(instance))
        except Exception as exc:  # noqa: BLE001 - one line naming the member that cannot be read
            raise TypeError(f"method class {cls.__qualname__}: its {', '.join(legacy)} cannot be read without a config "
                            f"({type(exc).__name__}: {exc}); declare traits = Traits(selection_grid=..., "
                            "test_settings=...) and report = Report(...) instead") from exc
        for name in ("run_label", "ldp_level"):
            if name in found:
                report[name] = getattr(instance, name)  # bound to the one instance made here
    if traits:
        cls.traits = replace(cls.traits, **traits)
    if report:
        cls.report = replace(cls.report, **report)
    cls._read_from_legacy = {name for name, read in (("traits", traits), ("report", report)) if read}


EXTRAS = ("validate", "uses_public_data", "published_model", "source_model", "missing_prepared", "evaluate_published",
          "variants", "diagnostics")


class Method(Mechanism):
    """Base class of a method written against the interface before :class:`MethodSpec`: subclasses
    set ``name`` and ``config_class`` and implement ``guarantee``, ``plan`` and ``train``; the
    extras of :class:`~tasks.methods.base.Extras` are methods of the same names."""

    name: ClassVar[str]
    config_class: ClassVar[type]
    prompt_kind: ClassVar[str] = "soft"
    label: ClassVar[str] = ""
    traits: ClassVar[Traits] = Traits()
    report: ClassVar[Report] = Report()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _read_legacy_members(cls)

    def settings(self, cfg):
        """This method's config block."""
        return getattr(cfg.methods, self.name)

    # the extras' defaults, as the old interface had them (a hook may call them, or super())
    def validate(self, cfg, published: bool) -> None:
        return Extras.validate(cfg, published)

    def uses_public_data(self, cfg) -> bool:
        return Extras.uses_public_data(cfg)

    def published_model(self, cfg, prepared) -> str:
        return Extras.published_model(cfg, prepared)

    def source_model(self, cfg, prepared) -> str:
        return Extras.source_model(cfg, prepared)

    def missing_prepared(self, prepared) -> str:
        return Extras.missing_prepared(prepared)

    def variants(self, ctx, result, prepared, run_method) -> list:
        return Extras.variants(ctx, result, prepared, run_method)

    def diagnostics(self, ctx, prompt_path, mctx) -> dict:
        return Extras.diagnostics(ctx, prompt_path, mctx)


def spec_from_class(cls: type) -> MethodSpec:
    """The spec of an old-style :class:`Method` subclass: its class attributes, an instance of it
    as the mechanism, the extras it overrides bound to that instance. A ``tables`` method is
    refused: the variants table is the platform's (from the variants' labels and guarantees)."""
    if not issubclass(cls, Method):
        raise TypeError(f"method class {cls.__qualname__} extends the mechanism {cls.__mro__[1].__qualname__}: register "
                        "a MethodSpec(name=..., config_class=..., mechanism=...) with its declarations (the toolkit's "
                        "DPSGD_TRAITS, PREFIX_REPORT, prefix_extras; docs/adding-a-method.md)")
    if "tables" in {name for base in cls.__mro__ if base not in (Method, Mechanism, object) for name in vars(base)}:
        raise TypeError(f"method class {cls.__qualname__}: tables() is no longer read; the run's variants table is "
                        "built from its variants (Variant.label, guarantee, epsilon)")
    if not isinstance(getattr(cls, "config_class", None), type):
        raise TypeError(f"method class {cls.__qualname__} needs a config_class (its pydantic block)")
    instance = cls()
    extras = {name: getattr(instance, name) for name in EXTRAS
              if any(name in vars(base) for base in cls.__mro__ if base not in (Method, Mechanism, object))}
    return MethodSpec(name=getattr(cls, "name", None), config_class=cls.config_class, mechanism=instance,
                      prompt_kind=cls.prompt_kind, label=cls.label, traits=cls.traits, report=cls.report,
                      extras=Extras(**extras))
