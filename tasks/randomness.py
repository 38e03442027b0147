"""Where DP randomness comes from (issue 14): noise and sampling of every mechanism are drawn
from a SECRET source — OS entropy, never logged — and never from the config's ``seed``, which is
logged (param and config.yaml). ``seed`` keeps governing what is not private: initialisation,
splits, subsets.

A debugging switch, ``debug_seeded_dp_randomness: true``, derives the DP streams from ``seed``
so a run can be replayed exactly. Such a run has no privacy guarantee: it is tagged
``privacy.guarantee=none``, records a non-private use in the ledger and publishes nothing.

Neither numpy nor torch ships a cryptographically secure generator: the streams here are PCG64
(numpy) and Philox/MT (torch) seeded with 63–256 secret bits from ``secrets``. The seed is
unpredictable; the generators are not hardened against floating-point side channels.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DpRandomness:
    """Factory of the DP streams of one run (or one audit shadow)."""

    seeded: bool = False
    seed: int = 0
    _counter: int = field(default=0, repr=False)

    def _next_seed(self, stream: int) -> int:
        if not self.seeded:
            return secrets.randbits(63)
        return stream

    def torch_generators(self) -> tuple["object", "object"]:
        """(sampling, noise) torch generators. Seeded mode reproduces the historical streams of
        DP-SGD (``2·seed`` for sampling, ``2·seed + 1`` for noise)."""
        import torch

        sample = torch.Generator().manual_seed(self._next_seed(2 * self.seed))
        noise = torch.Generator().manual_seed(self._next_seed(2 * self.seed + 1))
        return sample, noise

    def numpy(self, stream: int = 0) -> np.random.Generator:
        """A numpy generator for a mechanism (LimitedDomain, DP-argmax, d_X, ...)."""
        if not self.seeded:
            return np.random.default_rng(np.random.SeedSequence(secrets.randbits(256)))
        return np.random.default_rng([self.seed, 7919, stream])


def for_config(cfg) -> DpRandomness:
    """The run's DP randomness: secret unless the config's debug switch asks for seeded streams."""
    return DpRandomness(seeded=bool(cfg.debug_seeded_dp_randomness), seed=cfg.seed)


def for_shadow(cfg, shadow_seed: int) -> DpRandomness:
    """Audit shadows are private working data (never published): seeded by their own seed so an
    audit is reproducible; the audited prompt's own randomness is not involved."""
    return DpRandomness(seeded=True, seed=shadow_seed)
