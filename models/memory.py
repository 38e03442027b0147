"""How many examples one forward/backward pass holds: the physical (micro-)batch of a step.

A logical DP step (Poisson sample, one clipped gradient per example or unit, one sum, one noise
draw) is computed over micro-batches of this size and is the same step whatever the size (Opacus's
``BatchMemoryManager`` semantics): memory only, never the accounting or a released number
(``tests/pipeline/test_models.py::test_micro_batches_give_the_same_dp_step``).

Not set (``models.physical_batch_size: null``): on CPU :data:`CPU_DEFAULT`; on CUDA the largest size
whose measured per-example peak fits ``fraction`` of the device's free memory (:func:`choose`)."""

from __future__ import annotations

from typing import Callable

import torch

CPU_DEFAULT = 64
LARGEST = 4096
PROBE_EXAMPLES = 2


def choose(requested: int | None, device: torch.device, probe: Callable[[int], None] | None = None,
           fraction: float = 0.8, free_bytes: Callable[[], int] | None = None,
           peak_bytes: Callable[[Callable[[], None]], int] | None = None) -> int:
    """The physical batch size: ``requested`` when set; on CPU :data:`CPU_DEFAULT`; on CUDA
    ⌊fraction · free / per-example peak⌋ (clamped to [1, :data:`LARGEST`]), the per-example peak
    measured by running ``probe(PROBE_EXAMPLES)`` — one pass of the training's own kind (per-sample
    gradients of a few training rows; nothing of it is kept). ``free_bytes`` / ``peak_bytes``:
    the device's free memory and a pass's peak above the current allocation (CUDA's by default)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"physical_batch_size must be >= 1, got {requested}")
        return int(requested)
    if device.type != "cuda" or probe is None:
        return CPU_DEFAULT
    free_bytes = free_bytes or (lambda: torch.cuda.mem_get_info(device)[0])
    peak_bytes = peak_bytes or (lambda run: _cuda_peak(run, device))
    per_example = max(1, peak_bytes(lambda: probe(PROBE_EXAMPLES)) // PROBE_EXAMPLES)
    return int(max(1, min(LARGEST, fraction * free_bytes() // per_example)))


def _cuda_peak(run: Callable[[], None], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)
