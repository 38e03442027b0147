"""Run a batch as groups of rows of similar length (less padding, the same per-row results).

Inputs are right-padded to the longest row of the batch, and a frozen transformer's cost grows
with the padded width. SST-2's training phrases average 13 tokens while a batch of 64 reaches
≈ 44: most of a forward pass is padding. Rows never interact inside a forward pass (attention
masks out padding; no batch norm), so splitting a batch by length and putting the rows back in
order gives the same per-row outputs (up to float rounding of differently shaped products) —
and the same per-example gradients: a DP-SGD step is unchanged (clipping and noise come after).

:func:`length_groups` picks the split that minimises padded tokens plus a per-call overhead
(:func:`call_overhead`: small on CPU, large on CUDA where one wide call is cheap).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F


def call_overhead(device: torch.device | str | None, width: int | None = None) -> int:
    """Cost of one more forward call, in padded tokens: 256 on CPU, 8,192 on CUDA (one wide call
    is cheap there), and more for a narrow model (hidden size ``width``), whose per-token work is
    small next to the fixed cost of a call (4·10⁷ / width²: tiny test models are not split).
    ``PRIVPROMPT_LENGTH_GROUP_OVERHEAD`` overrides (a huge value switches grouping off)."""
    forced = os.environ.get("PRIVPROMPT_LENGTH_GROUP_OVERHEAD")
    if forced:
        return int(forced)
    base = 8192 if torch.device(device or "cpu").type == "cuda" else 256
    return max(base, int(4e7 / width ** 2)) if width else base


def length_groups(lengths: torch.Tensor, overhead: int) -> list[torch.Tensor]:
    """Row indices split into groups of contiguous length ranges, minimising
    Σ_groups (rows × longest row) + overhead × groups (exact, by dynamic programming over the
    distinct lengths). One group holding every row when splitting does not pay."""
    lengths = torch.as_tensor(lengths).detach().reshape(-1).cpu().long()
    n = int(lengths.numel())
    if n <= 1:
        return [torch.arange(n)]
    values, counts = torch.unique(lengths, sorted=True, return_counts=True)
    values, counts = values.tolist(), counts.tolist()
    D = len(values)
    before = [0]
    for c in counts:
        before.append(before[-1] + c)
    best = [0.0] + [float("inf")] * D  # best[j]: rows of the j smallest lengths, grouped
    cut = [0] * (D + 1)
    for j in range(1, D + 1):
        for i in range(j):  # one group for lengths values[i..j-1]
            cost = best[i] + (before[j] - before[i]) * values[j - 1] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], D
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    if len(bounds) == 1:
        return [torch.arange(n)]
    order = torch.argsort(lengths, stable=True)
    return [order[before[i]:before[j]] for i, j in reversed(bounds)]


def in_length_groups(lengths: torch.Tensor, run: Callable[[torch.Tensor | None], torch.Tensor],
                     device: torch.device | str | None = None, width: int | None = None) -> torch.Tensor:
    """``run(rows)`` on each group of :func:`length_groups` (``rows`` None: the whole batch, one
    call), outputs concatenated back in input row order. Outputs (rows, width, ...) of different
    widths are right-padded with zeros to the widest (padding positions of the whole batch)."""
    groups = length_groups(lengths, call_overhead(device, width))
    if len(groups) == 1:
        return run(None)
    outs = [run(g) for g in groups]
    if outs[0].dim() >= 2:
        width = max(o.shape[1] for o in outs)
        pad = lambda o: F.pad(o, [0, 0] * (o.dim() - 2) + [0, width - o.shape[1]])  # noqa: E731
        outs = [o if o.shape[1] == width else pad(o) for o in outs]
    order = torch.cat(groups)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    out = torch.cat(outs)
    return out[inverse.to(out.device)]


def per_example_rows(prompt: torch.Tensor | None, rows: torch.Tensor | None, per_example: bool):
    """``prompt`` for the rows of one group: per-example copies are indexed (their gradients
    flow back to the rows of the full tensor), a shared prompt is passed as it is."""
    if prompt is None or rows is None or not per_example:
        return prompt
    return prompt[rows.to(prompt.device)]
