"""One device per Dask worker: the preload of PrivPrompt's local clusters (sweeps, audits).

A local cluster (``audit.dask`` / ``sweep.dask``: ``n_workers`` processes) starts each worker with
this module as its preload (Dask's ``dask_setup(worker)`` hook). Worker ``i`` gets device
``devices[i mod len(devices)]`` as ``PRIVPROMPT_DEVICE``, which every model load resolves through
(:func:`models.device.default_device`): with ``devices`` unset, one visible GPU per worker in turn
(two workers on a 4-GPU machine: cuda:0 and cuda:1; four workers on one GPU: all cuda:0), and the
CPU where there is none. A device the user forced for the whole run (``PRIVPROMPT_DEVICE`` set
before the flow starts) is kept. A cluster the team already runs (``dask.address``) places its own
workers (e.g. dask-cuda's one worker per GPU); nothing here touches it.
"""

from __future__ import annotations

import os
import zlib

DEVICES_ENV = "PRIVPROMPT_WORKER_DEVICES"  # comma-separated, set by the cluster's launcher (tasks.prefect_tasks)


def worker_index(name) -> int:
    """A local cluster names its workers 0, 1, …; any other name maps to a stable index."""
    try:
        return int(name)
    except (TypeError, ValueError):
        return zlib.crc32(str(name).encode())


def visible_devices() -> list[str]:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(n)]


def device_for(name, devices: list[str]) -> str | None:
    """The device of worker ``name`` among ``devices`` (None: no device to pin, e.g. a CPU machine)."""
    return devices[worker_index(name) % len(devices)] if devices else None


def dask_setup(worker) -> None:  # Dask's preload hook, in each worker process as it starts
    if os.environ.get("PRIVPROMPT_DEVICE"):
        return
    listed = [d.strip() for d in os.environ.get(DEVICES_ENV, "").split(",") if d.strip()]
    device = device_for(worker.name, listed or visible_devices())
    if device is not None:
        os.environ["PRIVPROMPT_DEVICE"] = device
