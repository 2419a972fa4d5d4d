"""training.data.samplers.ClassBalancedBatchSampler: C classes × K samples, per seed and epoch."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from training.data.samplers import ClassBalancedBatchSampler


def make_labels(seed: int = 0, classes: int = 12, low: int = 3, high: int = 15) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(low, high, classes)
    labels = np.concatenate([np.full(s, c * 10) for c, s in enumerate(sizes)])  # non-contiguous ids
    return labels[rng.permutation(len(labels))]


def batches(sampler) -> list[list[int]]:
    return list(iter(sampler))


def test_every_batch_is_c_classes_times_k_samples():
    labels = make_labels()
    sampler = ClassBalancedBatchSampler(labels, classes_per_batch=4, samples_per_class=3, seed=1)
    out = batches(sampler)
    assert len(out) == len(sampler) == len(labels) // 12
    assert sampler.batch_size == 12
    for batch in out:
        assert len(batch) == 12
        assert all(isinstance(i, int) and 0 <= i < len(labels) for i in batch)
        counts = Counter(labels[batch].tolist())
        assert len(counts) == 4 and set(counts.values()) == {3}
        # Classes come in contiguous runs of K, and samples within a class are distinct
        # whenever the class has at least K members.
        for run in range(4):
            chunk = batch[run * 3 : (run + 1) * 3]
            assert len(set(labels[chunk].tolist())) == 1
            assert len(set(chunk)) == 3


def test_small_classes_are_sampled_with_replacement():
    labels = np.array([0] * 2 + [1] * 2 + [2] * 10)
    sampler = ClassBalancedBatchSampler(labels, 2, 4, batches_per_epoch=20)
    for batch in sampler:
        counts = Counter(labels[batch].tolist())
        assert len(counts) == 2 and set(counts.values()) == {4}


def test_deterministic_per_seed_and_epoch():
    labels = make_labels()
    a = ClassBalancedBatchSampler(labels, 3, 2, seed=7)
    b = ClassBalancedBatchSampler(labels, 3, 2, seed=7)
    assert batches(a) == batches(b)
    assert batches(a) == batches(a)  # iterating again replays the same epoch
    a.set_epoch(1)
    epoch1 = batches(a)
    assert epoch1 != batches(b)
    b.set_epoch(1)
    assert batches(b) == epoch1
    a.set_epoch(0)
    assert batches(a) == batches(ClassBalancedBatchSampler(labels, 3, 2, seed=7))
    assert batches(ClassBalancedBatchSampler(labels, 3, 2, seed=8)) != batches(a)


def test_epochs_cover_different_classes_and_samples():
    labels = make_labels()
    sampler = ClassBalancedBatchSampler(labels, 3, 2, seed=0)
    seen = set()
    for epoch in range(5):
        sampler.set_epoch(epoch)
        seen.update(i for batch in sampler for i in batch)
    assert len(seen) > 0.8 * len(labels)  # not the same few items every epoch


@pytest.mark.parametrize("world_size, per_epoch", [(2, 10), (3, 12), (4, 13)])
def test_ranks_split_the_single_worker_sequence(world_size, per_epoch):
    labels = make_labels()
    single = ClassBalancedBatchSampler(labels, 3, 2, seed=5, batches_per_epoch=per_epoch)
    ranks = [
        ClassBalancedBatchSampler(labels, 3, 2, seed=5, rank=r, world_size=world_size, batches_per_epoch=per_epoch)
        for r in range(world_size)
    ]
    for epoch in (0, 3):
        single.set_epoch(epoch)
        for sampler in ranks:
            sampler.set_epoch(epoch)
        per_rank = [batches(s) for s in ranks]
        # Same number of steps on every worker (DDP would hang otherwise).
        assert len({len(s) for s in ranks}) == 1
        assert [len(b) for b in per_rank] == [len(s) for s in ranks]
        steps = len(ranks[0])
        assert steps == per_epoch // world_size
        # Interleaving the ranks' batches gives the single worker's sequence (its first
        # steps × world_size batches when the epoch does not divide evenly).
        interleaved = [per_rank[r][i] for i in range(steps) for r in range(world_size)]
        assert interleaved == batches(single)[: steps * world_size]
        # No two workers train on the same batch.
        as_sets = [{tuple(b) for b in rank_batches} for rank_batches in per_rank]
        assert sum(len(s) for s in as_sets) == len(set().union(*as_sets)) == steps * world_size


def test_epoch_length_is_at_least_one_step_per_worker():
    labels = np.repeat(np.arange(3), 2)  # 6 items: fewer than one 2×2 batch per 2 workers
    sampler = ClassBalancedBatchSampler(labels, 2, 2, rank=1, world_size=4)
    assert len(sampler) == 1 and len(batches(sampler)) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"classes_per_batch": 1, "samples_per_class": 2}, "classes_per_batch must be at least 2"),
        ({"classes_per_batch": 2, "samples_per_class": 1}, "samples_per_class must be at least 2"),
        ({"classes_per_batch": 13, "samples_per_class": 2}, "only 12 classes"),
        ({"classes_per_batch": 2, "samples_per_class": 2, "rank": 2, "world_size": 2}, "rank 2"),
        ({"classes_per_batch": 2, "samples_per_class": 2, "rank": -1}, "rank -1"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClassBalancedBatchSampler(make_labels(), **kwargs)
