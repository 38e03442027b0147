"""What the lifecycle records on MLflow for a method's pass (the flow's parent run and the
training's child run): tags and params only of what may be shown (the plan, released numbers),
never an exact statistic of private data (those stay under private/: ``tasks/lifecycle.py``)."""

from __future__ import annotations


def open_training(ctx, name: str, guarantee: str, opt_in: bool):
    """The training's child run under the flow's parent (tagged with its guarantee); a δ ≥ 1/n
    taken by the config's explicit opt-in is said on both."""
    opted = {"privacy.delta_opt_in": "true"} if opt_in else {}
    if opt_in:  # the run record says that this run's δ is ≥ 1/n by the config's explicit opt-in
        ctx.parent.set_tags(opted)
    return ctx.parent.child(name, {"method": name, "stage": "train", "privacy.guarantee": guarantee, **opted})


def record_choice(ctx, params: dict, tags: dict) -> None:
    """A choice among settings on the parent (a selection's winner, by name: released numbers only)."""
    if params:
        ctx.parent.log_params(params)
    if tags:
        ctx.parent.set_tags(tags)


def record_training(child, params: dict, metrics: dict, opt_in: bool) -> None:
    """The training's params (the plan's) and metrics (released or audit statistics) on its child run."""
    child.log_params({**params, **({"privacy.delta_opt_in": "true"} if opt_in else {})})
    child.log_metrics(metrics)


def log_post_child(ctx, spec: dict, guarantee: str) -> None:
    """A post-processing child run (public-data statistics only) from a method's ``PostProcessed.child``."""
    run = ctx.parent.child(spec["name"], {**spec.get("tags", {}), "privacy.guarantee": guarantee})
    run.log_params(spec.get("params", {}))
    run.log_metrics(spec.get("metrics", {}))
    for metric, points in spec.get("series", {}).items():
        for step, value in points:
            run.log_metrics({metric: value}, step=step)
    run.end()
