"""The (Poisson-subsampled) Gaussian PLD of ``privacy/pld.py`` is dp-accounting's, to the bit: the
hockey-stick divergence on the grid computed along an axis instead of one Python inversion per
grid point (the cost of every DP-SGD calibration)."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from privacy.pld import gaussian_pld


def _pmfs(pld):
    return [pld._pmf_remove, pld._pmf_add]  # noqa: SLF001 - the library's two directions


@pytest.mark.parametrize("sigma,q,grid", [(0.5, 0.008, 1e-3), (0.9, 0.02, 2e-4), (1.3, 0.2, 1e-3),
                                          (3.0, 0.9, 1e-4), (8.0, 0.001, 1e-3), (0.3, 0.5, 1e-3)])
def test_the_vectorised_gaussian_pld_is_dp_accountings(sigma, q, grid):
    ours = gaussian_pld(sigma, q, grid)
    theirs = pld_lib.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=grid)
    for a, b in zip(_pmfs(ours), _pmfs(theirs)):
        assert type(a) is type(b) and a._infinity_mass == b._infinity_mass  # noqa: SLF001
        if hasattr(b, "_probs"):  # dense
            assert a._lower_loss == b._lower_loss and np.array_equal(a._probs, b._probs)  # noqa: SLF001
        else:  # sparse (a small PLD)
            assert a._loss_probs == b._loss_probs  # noqa: SLF001
    for count in (1, 50):
        assert ours.self_compose(count).get_epsilon_for_delta(1e-5) == \
            theirs.self_compose(count).get_epsilon_for_delta(1e-5)


def test_an_unsampled_gaussian_takes_the_librarys_path():
    ours = gaussian_pld(1.0, 1.0, 1e-3)
    theirs = pld_lib.from_gaussian_mechanism(1.0, value_discretization_interval=1e-3)
    assert ours.get_epsilon_for_delta(1e-5) == theirs.get_epsilon_for_delta(1e-5)
