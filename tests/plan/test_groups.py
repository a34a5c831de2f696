"""plan_packs(groups=...): a group (a preference pair) is one item of the strategy, its members consecutive in one
pack, in dataset order; overlong groups follow the overflow policy as a unit; every sample exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from varpack.plan import STRATEGIES, PackPlan, plan_packs
from varpack.plan.report import plan_summary, summary_text


def _pairs(num_pairs, seed=0, hi=400):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, hi, size=2 * num_pairs)
    groups = np.repeat(np.arange(num_pairs), 2)
    return lengths, groups


def _check_members_together(plan, groups):
    seen = np.concatenate(plan.packs) if plan.num_packs else np.zeros(0, np.int64)
    for pack in plan.packs:
        g = groups[pack]
        runs = g[np.r_[True, g[1:] != g[:-1]]]
        assert len(set(runs.tolist())) == runs.size, "a group's members are split within a pack"
        for gid in runs:
            members = pack[g == gid]
            assert members.tolist() == np.flatnonzero(groups == gid).tolist()  # all of them, in order
    return seen


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pairs_stay_together_every_sample_once(strategy):
    lengths, groups = _pairs(500)
    plan = plan_packs(lengths, 1024, strategy=strategy, groups=groups)
    seen = _check_members_together(plan, groups)
    assert sorted(seen.tolist()) == list(range(lengths.size))  # every sample exactly once
    assert (plan.pack_lengths <= 1024).all()
    assert plan.overflow["num_groups"] == 500


def test_groups_are_the_strategy_items():
    """The packs of the groups are the strategy's packs of the group lengths (summed members)."""
    lengths, groups = _pairs(300, seed=3)
    glen = lengths[0::2] + lengths[1::2]
    gplan = plan_packs(glen, 1024)
    plan = plan_packs(lengths, 1024, groups=groups)
    assert [(groups[p][0::2]).tolist() for p in plan.packs] == [p.tolist() for p in gplan.packs]
    assert plan.fill_ratio == gplan.fill_ratio


def test_ungrouped_plan_may_split_pairs():
    """Negative control: without groups BFD does separate a pair's members (so the test above can fail)."""
    lengths, groups = _pairs(300, seed=3)
    plan = plan_packs(lengths, 1024)
    with pytest.raises(AssertionError):
        _check_members_together(plan, groups)


def test_overlong_pair_error_names_group():
    lengths = np.array([100, 100, 600, 500, 10, 20])
    groups = np.array([0, 0, 7, 7, 2, 2])
    with pytest.raises(
        ValueError, match=r"1 group\(s\) are longer than packing_length=1000 together .*7: 1100"
    ):
        plan_packs(lengths, 1000, groups=groups)


def test_overlong_pair_dropped_as_unit_and_reported():
    lengths = np.array([100, 100, 600, 500, 10, 20])
    groups = np.array([0, 0, 7, 7, 2, 2])
    plan = plan_packs(lengths, 1000, groups=groups, overflow="drop")
    seen = _check_members_together(plan, groups)
    assert sorted(seen.tolist()) == [0, 1, 4, 5]
    ov = plan.overflow
    assert (
        ov["dropped_ids"] == [2, 3]
        and ov["overlong_group_ids"] == [7]
        and ov["overlong_group_lengths"] == [1100]
    )
    assert ov["tokens_dropped"] == 1100
    text = summary_text(plan_summary(plan, lengths, data="x"))
    assert "1 overlong group(s) of 2 samples (dropped; group ids 7)" in text


def test_group_noun_names_pairs():
    """group_noun="pair" (preference pairs): the errors and the report say pair(s), not group(s)."""
    lengths = np.array([100, 100, 600, 500, 10, 20])
    groups = np.array([0, 0, 1, 1, 2, 2])
    with pytest.raises(
        ValueError, match=r"1 pair\(s\) are longer than packing_length=1000 together \(pair id: tokens\): 1: 1100"
    ):
        plan_packs(lengths, 1000, groups=groups, group_noun="pair")
    plan = plan_packs(lengths, 1000, groups=groups, overflow="drop", group_noun="pair")
    text = summary_text(plan_summary(plan, lengths, data="x"))
    assert "1 overlong pair(s) of 2 samples (dropped; pair ids 1)" in text and "group" not in text
    with pytest.raises(ValueError, match=r"sample 2 \(pair 1\) is empty"):
        plan_packs([3, 4, 0, 5], 10, groups=[0, 0, 1, 1], group_noun="pair")
    with pytest.raises(ValueError, match="cutting an overlong pair would cut a member"):
        plan_packs([3, 4], 10, groups=[0, 0], overflow="split", group_noun="pair")


@pytest.mark.parametrize("policy", ["truncate", "split"])
def test_cutting_policies_refused_with_groups(policy):
    with pytest.raises(ValueError, match=f"overflow='{policy}' cannot be used with groups"):
        plan_packs([3, 4], 10, groups=[0, 0], overflow=policy)


def test_bad_groups():
    with pytest.raises(ValueError, match="group 0 comes back at sample 2"):
        plan_packs([1, 2, 3, 4], 10, groups=[0, 1, 0, 0])
    with pytest.raises(ValueError, match="one group id per sample"):
        plan_packs([1, 2, 3], 10, groups=[0, 0])
    with pytest.raises(ValueError, match=r"sample 3 \(group 1\) is empty"):
        plan_packs([1, 2, 3, 0], 10, groups=[0, 0, 1, 1])
    with pytest.raises(TypeError, match="integers"):
        plan_packs([1, 2], 10, groups=[0.0, 0.0])


def test_fingerprint_covers_groups(tmp_path):
    lengths, groups = _pairs(20)
    plan = plan_packs(lengths, 1024, groups=groups)
    assert plan.fingerprint != plan_packs(lengths, 1024).fingerprint
    loaded = PackPlan.load(plan.save(tmp_path / "p"), lengths=lengths)  # the groups are saved with the plan
    assert loaded.groups.tolist() == groups.tolist() and loaded.fingerprint == plan.fingerprint
    assert [p.tolist() for p in loaded.packs] == [p.tolist() for p in plan.packs]
    assert PackPlan.load(plan_packs(lengths, 1024).save(tmp_path / "q")).groups is None
