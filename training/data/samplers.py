"""Class-balanced batches: C classes × K samples per class, deterministic per seed and epoch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class ClassBalancedBatchSampler:
    """Yields lists of dataset indices, each batch C distinct classes × K samples each.

    The whole epoch's batches are drawn from one generator seeded by (seed, epoch), then each
    Ray Train worker takes every `world_size`-th batch, so workers see disjoint batches and a
    restarted run replays the same epoch exactly. The epoch length is rounded down to a
    multiple of `world_size` so every DDP worker runs the same number of steps.
    """

    def __init__(
        self,
        labels: Sequence[int],
        classes_per_batch: int,
        samples_per_class: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        batches_per_epoch: int | None = None,
    ) -> None:
        labels = np.asarray(labels)
        self.class_ids, inverse = np.unique(labels, return_inverse=True)
        if classes_per_batch < 2:
            raise ValueError("classes_per_batch must be at least 2 (a batch needs negatives)")
        if samples_per_class < 2:
            raise ValueError("samples_per_class must be at least 2 (a batch needs positives)")
        if len(self.class_ids) < classes_per_batch:
            raise ValueError(
                f"classes_per_batch={classes_per_batch} but the data has only {len(self.class_ids)} classes"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.members = [np.flatnonzero(inverse == c) for c in range(len(self.class_ids))]
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        self.seed, self.rank, self.world_size = seed, rank, world_size
        batch_size = classes_per_batch * samples_per_class
        total = batches_per_epoch if batches_per_epoch is not None else len(labels) // batch_size
        self.total_batches = max(world_size, total - total % world_size)
        self.epoch = 0

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.total_batches // self.world_size

    def epoch_batches(self) -> list[np.ndarray]:
        """Every worker's batches of this epoch, in order."""
        rng = np.random.default_rng([self.seed, self.epoch])
        batches = []
        for _ in range(self.total_batches):
            chosen = rng.choice(len(self.members), size=self.classes_per_batch, replace=False)
            parts = []
            for c in chosen:
                pool = self.members[c]
                replace = len(pool) < self.samples_per_class
                parts.append(rng.choice(pool, size=self.samples_per_class, replace=replace))
            batches.append(np.concatenate(parts))
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.epoch_batches()[self.rank :: self.world_size]:
            yield batch.tolist()
