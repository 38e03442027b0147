"""The checks of a parsed config that ask its methods (their guarantee under its settings,
traits, ``Extras.validate`` and ``uses_public_data``, the selection's): run by
``tasks.config.parse_config`` after the schema has validated the config, so the schema itself
calls no method."""

from __future__ import annotations


def guarantee_of(cfg) -> str:
    """The published method's guarantee (``dp`` | ``ldp`` | ``none``), from its settings."""
    from .methods import get_method

    return get_method(cfg.method).mechanism.guarantee(cfg)


def check_methods(cfg) -> None:
    """Refuse (ValueError, one line naming the key) a config whose methods cannot run as set: an
    endpoint for a prompt that may not leave, a person unit or a group charge a method cannot bound,
    a method's own checks, public data it needs, a non-private method without the opt-in, and the
    ``selection:`` block (``tasks.selection.check_selection_config``). The published method always
    runs, whatever its ``enabled`` says; baselines are the enabled others."""
    from .methods import get_method

    methods = {name: get_method(name) for name in cfg.run_methods}
    if cfg.models.endpoints:
        if not cfg.data.test_shareable:
            raise ValueError("models.endpoints: a remote endpoint would receive the test split, which is private "
                             "unless data.test_shareable: true says it may leave this machine")
        published = methods[cfg.method]
        if published.prompt_kind != "text":
            raise ValueError(f"models.endpoints: method {cfg.method} publishes a "
                             f"{published.prompt_kind} prompt; only text prompts go to an endpoint")
        for endpoint in cfg.models.endpoints:
            ids = endpoint.label_token_ids
            if ids is not None and len(ids) != len(cfg.data.labels):
                raise ValueError(f"models.endpoints ({endpoint.alias}): label_token_ids has {len(ids)} ids for "
                                 f"{len(cfg.data.labels)} labels (data.labels order)")
            if ids is not None and len(set(ids)) != len(ids):
                raise ValueError(f"models.endpoints ({endpoint.alias}): label_token_ids repeats an id: two labels "
                                 "would be one answer")
        if published.traits.reads_private and published.mechanism.guarantee(cfg) == "none":
            raise ValueError(f"models.endpoints: method {cfg.method} has no formal guarantee (privacy.guarantee="
                             "none) and its prompt is built from private training rows (e.g. demonstrations "
                             "verbatim): it never leaves this machine; only a published dp or ldp prompt (or one "
                             "that reads no private data) goes to an endpoint")
    for name, method in methods.items():
        if cfg.data.user_unit and method.mechanism.guarantee(cfg) == "dp" and not method.traits.unit_level:
            raise ValueError(f"data.privacy_unit: {cfg.data.privacy_unit!r} makes a person the privacy unit, and "
                             f"methods.{name} bounds only one record's contribution (no per-unit mechanism): use "
                             "data.privacy_unit: record, or another method")
        if cfg.data.group_size and method.mechanism.guarantee(cfg) == "ldp":
            raise ValueError(f"methods.{name} is local DP (ldp, no (ε, δ) event): a record-level run on a dataset of "
                             f"people (data.person_field: {cfg.data.person_field}) is charged a group-privacy bound per "
                             "person, which an ldp run has none of; refused: use data.privacy_unit: "
                             f"{cfg.data.person_field} (its per-unit bound) or another method")
        method.extras.validate(cfg, published=name == cfg.method)
        if method.extras.uses_public_data(cfg) and cfg.public is None:
            raise ValueError(f"public: method {name} needs a public dataset (the `public:` block)")
        if (method.traits.reads_private and method.mechanism.guarantee(cfg) == "none"
                and not cfg.allow_nonprivate_baselines):
            why = ("debug_seeded_dp_randomness derives the DP noise from the logged seed"
                   if cfg.debug_seeded_dp_randomness and method.mechanism.guarantee(cfg.model_copy(
                       update={"debug_seeded_dp_randomness": False})) != "none"
                   else f"methods.{name} trains on private data without a formal guarantee")
            raise ValueError(f"{why}: set allow_nonprivate_baselines: true to opt in")
    if cfg.selection.enabled:
        from .selection import check_selection_config

        check_selection_config(cfg, methods[cfg.method])
