"""Device choice, seeding and the attention kernels a forward may use."""

from __future__ import annotations

import contextlib
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


def attention_backends(device: torch.device | str):
    """A context for forwards whose shapes keep changing: on CUDA, scaled_dot_product_attention may
    pick flash, memory-efficient or math attention but not cuDNN's; elsewhere nothing.

    cuDNN attention is SDPA's first choice for bfloat16/float16 on Hopper and builds an execution plan
    for every new shape: DP-OPT's queries (one token longer each time) and DP-SGD's Poisson batches
    (a new batch size nearly every step, times the batch's padded length) see mostly new shapes
    (bench/bench_cuda_shapes.py: 217 vs 40 ms per OPT token on a Llama-2-7B shape; bench/RESULTS.md).
    ``PRIVPROMPT_CUDNN_ATTENTION=1`` leaves torch's own choice (a switch for benchmarks). It sets
    (and restores) torch's process-wide backend switches, which only choose kernels."""
    if torch.device(device).type != "cuda" or os.environ.get("PRIVPROMPT_CUDNN_ATTENTION") == "1":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
