"""The audit's membership-inference attacks, by name (a registry, like the methods': compare
Opacus's ``register_accountant``). ``audit.attacks`` names attacks registered here; the audit
(:mod:`tasks.audit`) asks each for its per-example statistics of a prompt on the audit pool and for
its membership scores, and never compares attack names.

An attack lives in ONE module of this folder (``loss.py``, ``lira.py``, ``min_k.py``): an
:class:`Attack` subclass decorated with :func:`register_attack`. Every module here is imported (and
so registered) on first use; an attack elsewhere registers the same way when it is imported (a
test's toy attack, a plugin). Shadow prompts are trained only when a chosen attack
``needs_shadows``; their statistics are computed in the shadows' worker processes, so an attack
registered outside this folder that needs shadows must be imported there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..registry import Registry, import_folder


@dataclass(frozen=True)
class PoolScoring:
    """What an attack reads to score one prompt on the audit pool: the prompted classifier, the
    pool's encoding and true-label indices, the prompt, the batch size and the audit's settings."""

    classifier: Any
    encoded: Any
    labels: Any
    prompt: Any
    batch_size: int
    audit: Any  # the AuditConfig (e.g. ``min_k``)


@dataclass(frozen=True)
class Shadows:
    """The statistics of every shadow prompt on the pool and which pool rows each was trained on
    (``in_mask[k, i]``: row i was in shadow k's half)."""

    statistics: list[dict[str, np.ndarray]]
    in_mask: np.ndarray


class Attack:
    """A membership-inference attack on the audit pool. Higher scores = looks like a member."""

    name: str = ""
    needs_shadows: bool = False   # the audit trains the K shadow prompts for it (LiRA)
    unit_reduction: str = "mean"  # a unit's score from its records' ("sum": log-likelihood ratios)
    # its place in the default ``audit.attacks`` (None: run only when a config names it). The default
    # list is in the config's hash, so the built-ins keep the order they had (loss, lira, min_k)
    default_position: int | None = None

    def statistics(self, scoring: PoolScoring) -> dict[str, np.ndarray]:
        """Per-example statistics of one prompt (the audited one, and each shadow) on the pool."""
        return {}

    def scores(self, target: dict[str, np.ndarray], shadows: Shadows | None) -> dict[str, np.ndarray]:
        """Score name → per-example membership scores; each gives the metrics ``mia.<score name>.*``.
        ``target``: the statistics of every chosen attack for the audited prompt; ``shadows``: None
        unless a chosen attack needs them."""
        raise NotImplementedError


def _check(cls, registered) -> None:
    if cls.unit_reduction not in ("mean", "sum"):
        raise ValueError(f"attack {cls.name!r}: unit_reduction is 'mean' or 'sum', got {cls.unit_reduction!r}")


ATTACKS = Registry("attack", lambda: import_folder(__name__, __path__),
                   "unknown attack {name}; registered attacks: {names}")


def register_attack(cls: type[Attack]) -> type[Attack]:
    """Class decorator: register ``cls`` under ``cls.name`` (a second registration of the name by
    another class is an error)."""
    return ATTACKS.add(cls, _check)


def unregister_attack(name: str) -> None:
    """Remove ``name`` from the registry (an attack added for a while: a test's toy attack)."""
    ATTACKS.remove(name)


def registered_attacks() -> list[str]:
    """The registered attack names, in registration order."""
    return ATTACKS.names()


def default_attacks() -> list[str]:
    """The default ``audit.attacks``: the registered attacks with a ``default_position``, in its order."""
    ranked = [a for a in ATTACKS.values() if a.default_position is not None]
    return [a.name for a in sorted(ranked, key=lambda a: a.default_position)]


def unknown_attack_message(name: object) -> str:
    return ATTACKS.missing(name)


def get_attack(name: str) -> Attack:
    """The attack registered as ``name``; one line listing the registered ones when there is none."""
    return ATTACKS.get(name)


def chosen_attacks(names: list[str]) -> list[Attack]:
    """The attacks ``names`` chooses, in the order the audit runs them: those that need no shadows
    first, then those that do, each group in registration order (the built-ins alphabetically). The
    order is the bootstrap's (one random stream across the attacks), so it does not depend on how a
    config lists them."""
    wanted = [get_attack(n) for n in names]
    order = {name: i for i, name in enumerate(registered_attacks())}
    unique = {a.name: a for a in wanted}.values()
    return sorted(unique, key=lambda a: (a.needs_shadows, order[a.name]))


def needs_shadows(names: list[str]) -> bool:
    """Whether any attack ``names`` chooses trains shadow prompts."""
    return any(a.needs_shadows for a in chosen_attacks(names))
