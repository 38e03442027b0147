"""The accountant registry (privacy/accountants.py): the built-ins by name, the default policy
min(PLD, RDP) exactly as ``spend`` states every ε, and a new accountant added without touching the
project."""

import math

import pytest

from privacy import accountant as acct
from privacy import accountants
from privacy import events as ev
from privacy import selection as psel

DELTA = 1e-5
DPSGD = ev.dpsgd_event(0.01, 1.0, 1000)
# a Poisson-subsampled LimitedDomain: its RDP curve is not a proven bound (rdp.rdp_is_proven)
UNPROVEN = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.002, ev.LimitedDomainEvent(1.0, 5e-9)), 2000)
# best of K trials: PLD cannot express it
SELECTION = psel.selection_event([psel.trial_event(None, 30.0)], psel.TruncatedNegativeBinomial(eta=1.0, gamma=0.1))


@pytest.fixture
def registry():
    """The registry as it was, after the test (a test's own accountants do not outlive it)."""
    saved = dict(accountants._ACCOUNTANTS)
    yield accountants
    accountants._ACCOUNTANTS.clear()
    accountants._ACCOUNTANTS.update(saved)
    accountants.cached_spend.cache_clear()


def test_the_built_ins_are_registered_and_the_default_is_min_pld_rdp():
    assert {"pld", "rdp", "min_pld_rdp"} <= set(accountants.registered_accountants())
    assert accountants.DEFAULT_ACCOUNTANT == "min_pld_rdp"
    assert isinstance(accountants.create_accountant(), accountants.MinPldRdp)
    assert isinstance(accountants.create_accountant("pld"), accountants.PldAccountant)
    with pytest.raises(ValueError, match="unknown accountant 'prv'; registered: .*min_pld_rdp"):
        accountants.create_accountant("prv")


def test_the_default_policy_is_the_smaller_proven_bound_with_both_numbers_kept():
    pld = accountants.create_accountant("pld").spend(DPSGD, DELTA)
    rdp = accountants.create_accountant("rdp").spend(DPSGD, DELTA)
    both = acct.spend(DPSGD, DELTA)
    assert both == accountants.create_accountant("min_pld_rdp").spend(DPSGD, DELTA)
    assert both.epsilon == min(pld.epsilon, rdp.epsilon) == pld.epsilon  # PLD is the tighter for a Gaussian
    assert (both.epsilon_pld, both.epsilon_rdp, both.rdp_order) == (pld.epsilon_pld, rdp.epsilon_rdp, rdp.rdp_order)
    assert both.accountant == "min(pld, rdp)" and pld.accountant == "pld" and rdp.accountant == "rdp"
    assert pld.epsilon_rdp is None and rdp.epsilon_pld is None


def test_where_one_accountant_proves_nothing_the_policy_takes_the_other():
    # an unproven RDP curve: PLD alone decides, the RDP number kept as a cross-check
    unproven = acct.spend(UNPROVEN, DELTA)
    pld_alone = accountants.create_accountant("pld").spend(UNPROVEN, DELTA)
    assert unproven.epsilon == unproven.epsilon_pld == pld_alone.epsilon
    assert unproven.epsilon_rdp < unproven.epsilon_pld and unproven.accountant.startswith("pld (rdp: unproven")
    assert math.isinf(accountants.create_accountant("rdp").spend(UNPROVEN, DELTA).epsilon)
    # no PLD for a selection: RDP alone
    chosen = acct.spend(SELECTION, DELTA)
    assert chosen.epsilon_pld is None and chosen.accountant == "rdp (no pld for this event)"
    assert chosen.epsilon == accountants.create_accountant("rdp").spend(SELECTION, DELTA).epsilon < math.inf
    assert math.isinf(accountants.create_accountant("pld").spend(SELECTION, DELTA).epsilon)
    # neither: nothing proven bounds it
    neither = acct.spend(ev.ComposedEvent((UNPROVEN, SELECTION)), DELTA)
    assert math.isinf(neither.epsilon)


def test_delta_for_epsilon_by_each_accountant():
    eps = acct.spend(DPSGD, DELTA).epsilon
    by = {name: acct.delta_for_epsilon(DPSGD, eps, name) for name in ("pld", "rdp", "min_pld_rdp")}
    assert by["min_pld_rdp"] == min(by["pld"], by["rdp"]) == acct.delta_for_epsilon(DPSGD, eps)
    assert by["min_pld_rdp"] <= DELTA * 1.05 < by["rdp"]  # RDP alone needs a larger δ at PLD's ε
    assert acct.delta_for_epsilon(UNPROVEN, 5.0, "rdp") == 1.0
    assert acct.delta_for_epsilon(SELECTION, 5.0, "pld") == 1.0


def test_a_new_accountant_is_one_registration(registry):
    @registry.register_accountant("pessimist")
    class Pessimist(accountants.Accountant):
        """Twice the default's ε: still a valid upper bound."""

        def spend(self, event, delta, discretization=accountants.DISCRETIZATION):
            base = accountants.create_accountant().spend(event, delta, discretization)
            return accountants.PrivacySpend(2 * base.epsilon, delta, base.epsilon_pld, base.epsilon_rdp,
                                            base.rdp_order, accountant="pessimist")

        def delta_for_epsilon(self, event, epsilon):
            return accountants.create_accountant().delta_for_epsilon(event, epsilon / 2)

    assert "pessimist" in registry.registered_accountants()
    assert acct.spend_by("pessimist", DPSGD, DELTA).epsilon == 2 * acct.spend(DPSGD, DELTA).epsilon
    composed = acct.PrivacyAccountant(accountant="pessimist").compose(DPSGD.event, count=1000)
    assert composed.spend(DELTA).accountant == "pessimist"
    eps = acct.spend(DPSGD, DELTA).epsilon
    assert composed.delta(2 * eps) == pytest.approx(acct.delta_for_epsilon(DPSGD, eps))
    with pytest.raises(ValueError, match="already registered"):
        registry.register_accountant("pessimist", Pessimist)
    registry.register_accountant("pessimist", accountants.PldAccountant, force=True)  # replaced: caches forgotten
    assert acct.spend_by("pessimist", DPSGD, DELTA).accountant == "pld"
    with pytest.raises(TypeError, match="not an Accountant"):
        registry.register_accountant("broken", lambda: object())
        registry.create_accountant("broken")


def test_spend_keeps_its_checks_and_unwraps_a_composition_of_one():
    parallel = ev.ParallelEvent((DPSGD, ev.GaussianEvent(3.0)))
    assert acct.spend(ev.ComposedEvent((parallel,)), DELTA) == acct.spend(parallel, DELTA)
    with pytest.raises(ValueError, match="delta"):
        acct.spend(DPSGD, 0.0)
    with pytest.raises(ValueError, match="delta"):
        acct.spend_by("pld", DPSGD, 2.0)
