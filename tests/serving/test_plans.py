"""The engine's planner (`serving.search.plans`): each query's shape picks its plan, and the
queries that can share a search are searched together, shape by shape in the table's order."""

from __future__ import annotations

import numpy as np

from index.search.grouping import Groups
from serving.search.answers import EVERY_ROW, Scope
from serving.search.plans import PLANS, FilteredPlan, GroupedPlan, PlainPlan, Planner, RangePlan, Shape, shape_of


def test_each_scope_has_one_shape_and_each_shape_a_plan():
    mask = np.ones(4, bool)
    groups = Groups.of_values("item", ["a", "b", "a", "b"])
    assert shape_of(EVERY_ROW) is Shape.PLAIN
    assert shape_of(Scope(allowed=mask)) is Shape.FILTERED
    assert shape_of(Scope(min_score=0.5)) is Shape.RANGE
    assert shape_of(Scope(allowed=mask, min_score=0.5)) is Shape.RANGE
    assert shape_of(Scope(groups=groups, allowed=mask, min_score=0.5)) is Shape.GROUPED
    assert list(PLANS) == [Shape.GROUPED, Shape.PLAIN, Shape.FILTERED, Shape.RANGE]
    assert [PLANS[s] for s in Shape] == [GroupedPlan, PlainPlan, FilteredPlan, RangePlan]


def test_queries_that_can_share_a_search_are_searched_together():
    one, other = np.ones(4, bool), np.zeros(4, bool)
    groups = Groups.of_values("item", ["a", "b", "a", "b"])
    scopes = [
        Scope(allowed=one),  # 0
        EVERY_ROW,  # 1
        Scope(min_score=0.1),  # 2
        Scope(groups=groups),  # 3: k 2
        Scope(allowed=other),  # 4
        EVERY_ROW,  # 5
        Scope(allowed=one),  # 6
        Scope(min_score=0.1),  # 7: alone, as every range
        Scope(groups=groups),  # 8: k 5, another search
        Scope(groups=groups),  # 9: k 2, with 3
    ]
    ks = [3, 3, 3, 2, 3, 3, 3, 3, 5, 2]
    searches = [(type(plan), k, members) for plan, k, members in Planner().searches(scopes, 5, ks)]
    assert searches == [
        (GroupedPlan, 2, [3, 9]),
        (GroupedPlan, 5, [8]),
        (PlainPlan, 5, [1, 5]),
        (FilteredPlan, 5, [0, 6]),
        (FilteredPlan, 5, [4]),
        (RangePlan, 5, [2]),
        (RangePlan, 5, [7]),
    ]
