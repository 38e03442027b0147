"""One device per Dask worker (issue 39, many GPUs in one flow): the local clusters' preload pins
worker i to devices[i mod len], keeps a device the user forced, and leaves a CPU machine alone."""

from __future__ import annotations

import types

import pytest

from tasks import dask_devices
from tasks.dask_devices import DEVICES_ENV, dask_setup, device_for


def test_workers_take_the_devices_in_turn():
    gpus = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [device_for(i, gpus[:2]) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [device_for(str(i), gpus) for i in range(2)] == ["cuda:0", "cuda:1"]  # names are strings too
    assert device_for("tcp://w-7", gpus) == device_for("tcp://w-7", gpus)  # other names: stable
    assert device_for(0, []) is None  # no GPU: nothing pinned, models load on the CPU


def test_the_preload_sets_the_device_unless_the_user_forced_one(monkeypatch):
    monkeypatch.setenv("PRIVPROMPT_DEVICE", "")  # unset for the preload, restored after the test
    monkeypatch.setenv(DEVICES_ENV, "cuda:0,cuda:1")
    dask_setup(types.SimpleNamespace(name=1))
    import os

    assert os.environ["PRIVPROMPT_DEVICE"] == "cuda:1"
    monkeypatch.setenv("PRIVPROMPT_DEVICE", "cuda:3")  # forced for the whole run: kept
    dask_setup(types.SimpleNamespace(name=0))
    assert os.environ["PRIVPROMPT_DEVICE"] == "cuda:3"
    monkeypatch.setenv("PRIVPROMPT_DEVICE", "")
    monkeypatch.setenv(DEVICES_ENV, "")
    monkeypatch.setattr(dask_devices, "visible_devices", lambda: [])  # a CPU machine
    dask_setup(types.SimpleNamespace(name=0))
    assert os.environ["PRIVPROMPT_DEVICE"] == ""


@pytest.mark.slow  # a LocalCluster of two worker processes (≈ 10 s)
def test_a_local_cluster_pins_one_device_per_worker():
    """The task runner's own cluster settings: each worker process sees its device."""
    from distributed import Client, LocalCluster

    from tasks.prefect_tasks import dask_task_runner
    from tasks.schema import DaskConfig

    runner = dask_task_runner(DaskConfig(n_workers=2, devices=["cuda:0", "cuda:1"]))
    kwargs = {k: v for k, v in runner.cluster_kwargs.items()}
    with LocalCluster(**kwargs) as cluster, Client(cluster) as client:
        seen = client.run(lambda: __import__("os").environ.get("PRIVPROMPT_DEVICE"))
    assert sorted(seen.values()) == ["cuda:0", "cuda:1"]
