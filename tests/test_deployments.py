"""prefect.yaml: every deployment's entrypoint imports as a Prefect flow, and every config it
names validates (so a scheduled run cannot fail on a typo)."""

from importlib import import_module
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
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


def test_every_method_config_has_a_deployment():
    configs = {d.get("parameters", {}).get("config") for d in DEPLOYMENTS}
    for needed in ("configs/quickstart.yaml", "configs/post.yaml", "configs/dpzero.yaml", "configs/dp_opt.yaml",
                   "configs/rapt.yaml", "configs/privacy_flat.yaml", "configs/sweep.yaml"):
        assert needed in configs, needed
