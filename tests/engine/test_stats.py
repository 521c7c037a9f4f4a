"""SpecStats: counts per step, rates derived in one place, merging."""

import math

from verispec.engine import SpecStats


def test_observe_counts_chains_and_trees_alike():
    s = SpecStats()
    s.observe(4, 2)  # a chain of 4: 2 accepted
    s.observe(3, 3, nodes=8)  # a tree 3 deep with 8 nodes: its whole depth accepted
    s.observe(0, 0)  # plain step
    assert (s.drafted, s.accepted, s.nodes, s.target_passes, s.emitted) == (7, 5, 12, 3, 8)
    assert s.acceptance_rate == 5 / 7 and s.tau == 8 / 3
    assert s.drafted_at == [2, 2, 2, 1] and s.reached_at == [2, 2, 2, 0] and s.accepted_at == [2, 2, 1, 0]
    assert s.per_position_acceptance[:3] == [1.0, 1.0, 0.5] and math.isnan(s.per_position_acceptance[3])
    assert s.steps_by_drafted == {4: 1, 3: 1, 0: 1}


def test_merge_adds_counts_times_and_ragged_positions():
    a, b = SpecStats(), SpecStats()
    a.observe(2, 1)
    a.draft_time, a.wall_time, a.output_tokens = 0.5, 2.0, 2
    b.observe(4, 4, nodes=9)
    b.observe(2, 0)
    b.draft_time, b.wall_time, b.output_tokens = 0.25, 1.0, 6
    a.merge(b)
    assert (a.drafted, a.accepted, a.nodes, a.target_passes, a.emitted, a.output_tokens) == (8, 5, 13, 3, 8, 8)
    assert (a.draft_time, a.wall_time) == (0.75, 3.0)
    assert a.drafted_at == [3, 3, 1, 1] and a.accepted_at == [2, 1, 1, 1]
    assert a.steps_by_drafted == {2: 2, 4: 1}
    assert a.tokens_per_second == 8 / 3.0


def test_empty_stats_have_no_rates():
    s = SpecStats()
    assert math.isnan(s.acceptance_rate) and math.isnan(s.tau) and s.per_position_acceptance == []
