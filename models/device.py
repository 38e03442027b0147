"""Device choice and seeding."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def default_device() -> torch.device:
    """CUDA when available, else CPU. ``PRIVPROMPT_DEVICE`` (e.g. ``cpu``, ``cuda:1``) overrides."""
    forced = os.environ.get("PRIVPROMPT_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> :func:`default_device`; a bare ``cuda`` becomes ``cuda:<current>`` so cache keys agree."""
    if device is None:
        device = default_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all CUDA devices) RNGs."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
