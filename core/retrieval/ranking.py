"""The one order of search hits, which every layer ranks by: score descending, then the lower id
first — a row, a group, or (no ids given) the earlier place, as a stable sort of the scores.

`ranked` orders all of them, `best_k` only the first k (a partition, then a sort of those k,
the same places in the same order as `ranked`'s first k: a row tied with the k-th that a
partition left out is brought back). NaN scores rank last; a place whose id is NO_ROW (faiss's
empty place) ranks as a score of -inf. Exact search's reference, a version's merge of its parts
and a sharded server's of its shards, the re-rank, the filtered and grouped paths and the
monitor's exact answer all order their hits here, so the same scores answer in the same order
wherever they are ranked.
"""

from __future__ import annotations

import numpy as np

NO_ROW = -1  # faiss's id for a place with no answer

# Up to this many candidates a line (or with k at least a quarter of them) a full sort costs less
# than a partition, its tie check and a sort of the k (the merge of a few parts' k, a re-rank's).
SORT_BELOW = 256


def ranked(scores: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """The order of `scores` along the last axis: score descending, ties by `ids` ascending
    (None: by place), ties of both by place."""
    return _sorted(_keys(scores, ids), ids)


def best_k(scores: np.ndarray, k: int, ids: np.ndarray | None = None) -> np.ndarray:
    """`ranked(scores, ids)[..., :k]`, without sorting every place: the places of each line's
    best k (fewer when a line has fewer), best first."""
    scores = np.asarray(scores)
    ids = None if ids is None else np.asarray(ids)
    n = scores.shape[-1]
    k = max(0, min(k, n))
    if k == 0:
        return np.zeros((*scores.shape[:-1], 0), dtype=np.intp)
    if n <= SORT_BELOW or 4 * k >= n or scores.size == 0:
        return ranked(scores, ids)[..., :k]
    if scores.ndim == 1:
        return _best_of_line(scores, ids, k)
    # Line by line: a partition's index array for all lines at once (1000 × 100,000: 800 MB)
    # leaves the cache and costs more than the partition.
    lines, tags = scores.reshape(-1, n), None if ids is None else ids.reshape(-1, n)
    top = [_best_of_line(line, None if tags is None else tags[i], k) for i, line in enumerate(lines)]
    return np.stack(top).reshape(*scores.shape[:-1], k)


def _keys(scores: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
    """Ascending sort keys: negated scores (NaN stays last), +inf at an absent place."""
    scores = np.asarray(scores)
    return -scores if ids is None else np.where(np.asarray(ids) == NO_ROW, np.inf, -scores)


def _sorted(key: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
    if ids is None:
        return np.argsort(key, axis=-1, kind="stable")
    return np.lexsort((np.asarray(ids), key), axis=-1)


def _best_of_line(scores: np.ndarray, ids: np.ndarray | None, k: int) -> np.ndarray:
    """One line's best k (0 < k < its length): a partition, then a sort of its k."""
    key = _keys(scores, ids)
    part = np.argpartition(key, k)  # place k holds the (k+1)-th; before it the best k, in no order
    head = part[:k]
    head_keys = key[head]
    kth, after = head_keys.max(), key[part[k]]
    if kth == after or (np.isnan(kth) and np.isnan(after)):
        # A tie across the k-th place: the partition chose among the tied arbitrarily.
        head = _settled(key, ids, head, kth)
        head_keys = key[head]
    if ids is None:
        return head[np.lexsort((head, head_keys))]
    return head[np.lexsort((head, ids[head], head_keys))]


def _settled(key: np.ndarray, ids: np.ndarray | None, head: np.ndarray, kth: float) -> np.ndarray:
    """A line's best k where the k-th (`kth`) ties with places past it: those better than it,
    all in `head` (a partition's k), then of every place tied with it the lowest ids (places)."""
    tied = np.isnan(key) if np.isnan(kth) else key == kth
    better = head[~tied[head]]
    need = len(head) - len(better)
    if ids is None:
        return np.concatenate([better, _first_places(tied, need)])
    level = np.flatnonzero(tied)
    return np.concatenate([better, level[np.argsort(ids[level], kind="stable")[:need]]])


def _first_places(mask: np.ndarray, count: int) -> np.ndarray:
    """The first `count` places `mask` holds (it holds that many), looked for in growing blocks:
    the tied can be most of a line (a filter's -inf places) and only the first few are wanted."""
    found, start, size = [], 0, 4096
    while count > 0 and start < len(mask):
        places = np.flatnonzero(mask[start : start + size])[:count] + start
        found.append(places)
        count, start, size = count - len(places), start + size, 4 * size
    return np.concatenate(found)
