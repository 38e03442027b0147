"""dp_fewshot's pre-noise statistic for the neighbour harness (``tasks.neighbours``; issue 37).

``dp_fewshot_sums``: for every (label, demonstration) group, the sum of its subsets' next-token
distributions that each token's Gaussian vote adds noise to, from the project's own keyed partition
(:func:`keyed_subsets`, the harness's key standing in for the run's secret one). Each subset's
distribution is the worst case a clipped distribution can be: all its mass on one token, an
arbitrary function of the subset's rows (a hash of them). Adding or removing one record changes one
subset of one group (it may push another row past that subset's cap: still that subset), so one
group's sum moves by at most √2 in L2 and the others not at all. In units of the mechanism's bound
√2 (``privacy.mechanisms.distribution_vote`` adds N(0, (σ·√2)²)): at most 1, the release's sensitivity.

A statistic of private data: run by the harness on synthetic rows only."""

from __future__ import annotations

import hashlib
import math

import numpy as np

from ...neighbours import register_statistic, training_rows

VOCABULARY = 7


@register_statistic("dp_fewshot_sums")
def group_sums(source, cfg, key: bytes) -> np.ndarray:
    from ...methodkit.keyed_partition import keyed_subsets

    block = cfg.methods.dp_fewshot
    rows = training_rows(source, cfg, key)
    M, D = block.subsets, block.demos_per_label
    sums = []
    for label in cfg.data.labels:
        parts = keyed_subsets(rows.texts, rows.labels, label, key, D * M, block.shots)
        for d in range(D):
            total = np.zeros(VOCABULARY)
            for part in parts[d * M:(d + 1) * M]:
                if part:
                    content = "\x1d".join(rows.texts[i] for i in part).encode()
                    total[int.from_bytes(hashlib.sha256(content).digest()[:4], "big") % VOCABULARY] += 1.0
            sums.append(total)
    return np.concatenate(sums) / math.sqrt(2.0)
