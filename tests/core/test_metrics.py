"""core.retrieval.metrics' sampling and intervals: a sample chosen by ids, and the Wilson score interval."""

from __future__ import annotations

import numpy as np
import pytest

from core.retrieval.metrics import stable_order, stable_sample, wilson_interval


@pytest.mark.parametrize(
    ("fraction", "n", "expected"),
    [
        (0.5, 100, (0.40383, 0.59617)),  # p ± z·sqrt(p(1-p)/n) pulled towards 1/2: symmetric here
        (0.0, 10, (0.0, 0.27753)),  # none of 10: z²/(n + z²) above, where the normal interval is empty
        (1.0, 10, (0.72247, 1.0)),
        (0.323, 1000, (0.29474, 0.35261)),  # issue 47's probe R@1: 0.354 lies outside, just
    ],
)
def test_the_wilson_interval_on_known_values(fraction, n, expected):
    assert wilson_interval(fraction, n) == pytest.approx(expected, abs=5e-6)


def test_the_wilson_interval_is_exact_at_its_ends_and_all_of_it_with_no_trials():
    assert wilson_interval(0.0, 50)[0] == 0.0 and wilson_interval(1.0, 50)[1] == 1.0
    assert wilson_interval(0.3, 0) == (0.0, 1.0)


def test_a_sample_by_ids_is_the_same_items_in_any_row_order():
    ids = [f"sku-{i}" for i in range(5000)]
    rows = np.random.default_rng(0).permutation(len(ids))
    reordered = [ids[r] for r in rows]
    assert {ids[r] for r in stable_sample(ids, 200)} == {reordered[r] for r in stable_sample(reordered, 200)}
    # Ranked by the ids alone, in every process (not Python's salted hash()): builds made apart
    # sample the same items, and a change of the hash would change every version's sample.
    assert [reordered[r] for r in stable_order(reordered)[:3]] == ["sku-2075", "sku-1612", "sku-222"]
    assert len(stable_sample(ids[:7], 200)) == 7
