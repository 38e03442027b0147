"""Random generators for the DP mechanisms.

DP randomness (noise and sampling) must come from a secret source, never from a logged seed:
production code calls :func:`secret_rng`; tests and debugging inject :func:`seeded_rng`.

Honest caveat: numpy has no CSPRNG. :func:`secret_rng` draws a 256-bit seed from the OS CSPRNG
(``secrets``), so the seed is secret and unguessable, but the generator itself is PCG64, which is
not cryptographically secure (its state can in principle be recovered from enough outputs), and
floating-point sampling has known side channels (Mironov, CCS 2012). Fine for research, not a
hardened implementation.
"""

from __future__ import annotations

import secrets

import numpy as np

from .validation import check_count


def secret_rng() -> np.random.Generator:
    """A PCG64 generator seeded with 256 bits of OS entropy (``secrets.randbits``); the seed is never exposed."""
    return np.random.default_rng(np.random.SeedSequence(secrets.randbits(256)))


def seeded_rng(seed: int) -> np.random.Generator:
    """A reproducible generator for tests and debugging only: NEVER for DP noise in a real run."""
    if isinstance(seed, np.generic):
        seed = seed.item()
    return np.random.default_rng(check_count(seed, "seed"))
