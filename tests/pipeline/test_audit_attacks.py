"""Audit attacks are a registry, like the methods (issue 36: tasks/attacks/, one module per attack):
a toy attack registered here, in tests/ (no project file edited), is accepted by the audit's config
and scored as the audit scores attacks; the built-ins keep the default list (it is in every config's
hash) and the bootstrap's order; unknown names are one line listing the registered ones. The audit
running a toy attack on a real pool: tests/pipeline/test_audit_flow.py."""

from __future__ import annotations

import numpy as np
import pytest

from tasks import attacks
from tasks.config import AuditConfig, apply_overrides, parse_config
from tasks.errors import ConfigError

LABELS = ["neg", "pos"]


class ToyMargin(attacks.Attack):
    """A toy attack: the true-label index as its score (reads no model, needs no shadows)."""

    name = "toy_margin"

    def statistics(self, scoring):
        return {"toy_margin": np.asarray(scoring.labels, dtype=float)}

    def scores(self, target, shadows):
        return {"toy_margin": target["toy_margin"]}


@pytest.fixture
def toy_attack():
    attacks.register_attack(ToyMargin)
    yield ToyMargin
    attacks.unregister_attack("toy_margin")


def test_the_built_in_attacks_keep_the_default_and_the_order_they_had():
    assert {"loss", "lira", "min_k"} <= set(attacks.registered_attacks())
    assert AuditConfig().attacks == ["loss", "lira", "min_k"]  # the default is in every config's hash
    # the bootstrap's order: shadow-free attacks first, whatever order a config lists them in
    assert [a.name for a in attacks.chosen_attacks(["lira", "min_k", "loss"])] == ["loss", "min_k", "lira"]
    assert attacks.needs_shadows(["loss", "lira"]) and not attacks.needs_shadows(["loss", "min_k"])


def test_an_attack_registered_by_a_test_is_accepted_by_the_config(toy_attack):
    acfg = AuditConfig(enabled=True, attacks=["loss", "toy_margin"])
    assert [a.name for a in attacks.chosen_attacks(acfg.attacks)] == ["loss", "toy_margin"]
    assert not attacks.needs_shadows(acfg.attacks)
    assert AuditConfig().attacks == ["loss", "lira", "min_k"]  # a new attack is chosen by name only
    scoring = attacks.PoolScoring(classifier=None, encoded=None, labels=[0, 1, 1], prompt=None, batch_size=2,
                                  audit=acfg)
    stats = toy_attack().statistics(scoring)
    assert toy_attack().scores(stats, None)["toy_margin"].tolist() == [0.0, 1.0, 1.0]


def test_a_bad_attack_registration_is_refused(toy_attack):
    class Again(attacks.Attack):
        name = "toy_margin"

    with pytest.raises(ValueError, match="attack 'toy_margin' is already registered by ToyMargin"):
        attacks.register_attack(Again)

    class Median(attacks.Attack):
        name = "toy_median"
        unit_reduction = "median"

    with pytest.raises(ValueError, match="unit_reduction is 'mean' or 'sum'"):
        attacks.register_attack(Median)
    assert "toy_median" not in attacks.registered_attacks()


def test_unknown_attacks_are_one_line_listing_the_registered_ones(toy_attack):
    with pytest.raises(KeyError) as err:
        attacks.get_attack("mink")
    assert err.value.args[0] == "unknown attack 'mink'; registered attacks: lira, loss, min_k, toy_margin"
    raw = {"method": "prompt_dpsgd", "data": {"name": "toy", "labels": LABELS}, "models": {"local": "tiny-gpt2"}}
    with pytest.raises(ConfigError) as err:
        parse_config(apply_overrides(raw, ["audit.attacks=[loss,mink]"]))
    line = str(err.value)
    assert "\n" not in line and "audit.attacks" in line
    assert "unknown attack 'mink'; registered attacks: lira, loss, min_k, toy_margin" in line
