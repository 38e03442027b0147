"""prefect.yaml: every deployment's entrypoint imports as a Prefect flow, and every config it
names validates (so a scheduled run cannot fail on a typo); checked against the method registry
(every registered method runs in some deployment), not against a list of methods."""

from importlib import import_module
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_deployment_entrypoint_and_config(deployment):
    from prefect import Flow

    from tasks.config import load_config

    path, name = deployment["entrypoint"].split(":")
    flow = getattr(import_module(path.removesuffix(".py").replace("/", ".")), name)
    assert isinstance(flow, Flow)
    config = deployment.get("parameters", {}).get("config")
    if config is not None:
        cfg = load_config(str(ROOT / config), deployment["parameters"].get("overrides") or [])
        assert cfg.method


def _methods_run(deployment) -> set[str]:
    """The methods a deployment runs: published or enabled as a baseline, in any sweep variant."""
    from tasks.config import load_config, sweep_variants

    config = deployment.get("parameters", {}).get("config")
    if config is None:
        return set()
    cfg = load_config(str(ROOT / config), deployment["parameters"].get("overrides") or [])
    return {name for _, variant in sweep_variants(cfg) for name in variant.run_methods}


@pytest.fixture(scope="module")
def methods_run():
    return {d["name"]: _methods_run(d) for d in DEPLOYMENTS}


def test_every_registered_method_runs_in_a_deployment(methods_run):
    from tasks.methods import registered_methods

    covered = set().union(*methods_run.values())
    missing = [name for name in registered_methods() if name not in covered]
    assert not missing, f"registered methods no deployment in prefect.yaml runs: {missing}"


def test_method_tags_name_methods_the_deployment_runs(methods_run):
    from tasks.methods import registered_methods

    for d in DEPLOYMENTS:
        tagged = [t for t in d.get("tags", []) if t in registered_methods()]
        assert set(tagged) <= methods_run[d["name"]], (d["name"], tagged)
