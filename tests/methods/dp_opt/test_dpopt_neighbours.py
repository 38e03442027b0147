"""DP-OPT's ε is stated for adding or removing one SOURCE record: one record may change at most
one member's demos (one vote moved, added or removed: LimitedDomain's neighbours), and each
candidate's selection count by at most one. Checked here under the coupling the proof uses:
every other row keeps its own draws."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.methods.base import PrivateRows
from tasks.methods.dp_opt.method import DPOpt, member_demos


def _members(seed, n, q=0.05, members=8, cap=4):
    return member_demos(np.random.default_rng(seed), n, q, members, cap)


@pytest.mark.parametrize("seed", range(40))
def test_one_added_record_changes_at_most_one_member(seed):
    n = int(np.random.default_rng(1000 + seed).integers(20, 400))
    before, after = _members(seed, n), _members(seed, n + 1)  # record n appended: its own draws
    changed = [j for j, (a, b) in enumerate(zip(before, after)) if a.tolist() != b.tolist()]
    assert len(changed) <= 1
    for j in changed:  # the new record is in it; nothing else moved but what the cap pushed out
        assert n in after[j].tolist()
        assert set(after[j].tolist()) - {n} <= set(before[j].tolist())
    assert all(n not in after[j].tolist() for j in range(len(after)) if j not in changed)


def test_sampling_rate_and_member_spread():
    q, members, n = 0.1, 5, 20000
    parts = _members(3, n, q, members, cap=n)
    sizes = np.array([p.size for p in parts])
    assert abs(sizes.sum() / n - q) < 0.01                    # Poisson at rate q
    assert np.all(np.abs(sizes / sizes.mean() - 1) < 0.15)    # uniform over members
    flat = np.concatenate(parts)
    assert flat.size == np.unique(flat).size                  # a row joins at most one member


def test_cap_and_empty_members():
    parts = _members(0, 1000, q=0.5, members=4, cap=3)
    assert len(parts) == 4 and all(p.size == 3 for p in parts)
    parts = _members(0, 3, q=0.01, members=6, cap=3)
    assert len(parts) == 6 and sum(p.size for p in parts) <= 3


def test_selection_scores_the_whole_holdout():
    """No subset of the holdout by size (it would depend on every record): one added holdout row
    changes each candidate's correct-count by at most one."""
    train = PrivateRows([f"t{i}" for i in range(30)], ["a"] * 30)
    train.validation = PrivateRows([f"v{i}" for i in range(500)], ["b"] * 500)
    gen, val = DPOpt()._select_rows(train, seed=0)
    assert gen.texts == train.texts and val.texts == train.validation.texts


def test_validation_size_is_refused_with_the_reason():
    from tasks.methods.dp_opt.method import DPOptConfig

    with pytest.raises(ValueError, match="whole holdout"):
        DPOptConfig(validation_size=100)


def test_sampled_proposals_need_a_fresh_secret_generator_per_query():
    import torch

    from tasks.methods.dp_opt.engine import SharedPrefix
    from tasks.methods.dp_opt.generate import dp_generate

    class Engine:  # two members, three-token vocabulary
        eos_id = None
        tok = [0, 1, 2]

        def last_logits_rowwise(self, rows, prefix):
            return torch.zeros(len(rows), 3)

        propose = staticmethod(lambda logits, t, g: torch.multinomial(torch.softmax(logits / t, -1), 1,
                                                                      generator=g).squeeze(1))

    with pytest.raises(ValueError, match="new_generator"):
        dp_generate(Engine(), SharedPrefix([], None), lambda: [[1], [2]], lambda c: 0, lambda n: True, 3,
                    temperature=1.0)
    made = []

    def new_generator():
        made.append(torch.Generator().manual_seed(len(made)))
        return made[-1]

    out = dp_generate(Engine(), SharedPrefix([], None), lambda: [[1], [2]], lambda c: 1, lambda n: True, 3,
                      temperature=1.0, new_generator=new_generator)
    assert out.queries == 3 and len(made) == 3  # one fresh generator per query
