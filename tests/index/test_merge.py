"""The one merge (index/search/merge.py): a version's segments, its shards read into one process, and a
sharded server's shard answers are merged by one order — score descending, then row — so rows
that tie answer in the same order whichever parts hold them, and a segmented version answers
range searches with faiss's own range search, part by part."""

from __future__ import annotations

import numpy as np
import pytest

from core.data.items import ItemTable
from core.retrieval.ranking import NO_ROW
from core.retrieval.vectors import l2_normalized
from index.changes.add import add_vectors
from index.search.faiss_index import build_index
from index.search.merge import MergedIndex, best_rows
from index.search.range_search import by_range_search, reaching
from index.versions.version import IndexVersion
from serving.search.answers import NOTHING_EXCLUDED
from serving.search.engine import SearchEngine, ServingPair
from serving.shards.fanout import LocalShards, ShardedSearch
from tests.support import shards as support

N, DIM, ITEMS, COPIES, K = 600, 16, 150, 40, 10

pytestmark = pytest.mark.usefixtures("local_ray")  # sharded builds add their shards in Ray tasks


def test_best_rows_ranks_by_score_then_row_and_leaves_empty_places_last():
    rows = np.array([[7, NO_ROW, 3, 9, 5], [NO_ROW, NO_ROW, 2, NO_ROW, NO_ROW]])
    scores = np.array([[0.5, 0.9, 0.8, 0.8, 0.5], [0.0, 0.0, -0.3, 0.0, 0.0]], dtype=np.float32)
    top_scores, top_rows = best_rows(rows, scores, 6)
    assert top_rows.tolist() == [[3, 9, 5, 7, NO_ROW, NO_ROW], [2, NO_ROW, NO_ROW, NO_ROW, NO_ROW, NO_ROW]]
    assert top_scores[0, :4].tolist() == pytest.approx([0.8, 0.8, 0.5, 0.5])
    assert np.isneginf(top_scores[0, 4:]).all() and np.isneginf(top_scores[1, 1:]).all()


def test_a_merged_index_refuses_parts_it_cannot_merge():
    vectors = l2_normalized(np.random.default_rng(0).standard_normal((20, DIM)).astype(np.float32))
    flat = build_index(vectors, "Flat", device="cpu")
    other = build_index(vectors[:, :8].copy(), "Flat", device="cpu")
    with pytest.raises(ValueError, match="parts of different dimensions: \\[8, 16\\]"):
        MergedIndex([flat, other], [0, 20])
    with pytest.raises(ValueError, match="2 parts but 1 offsets"):
        MergedIndex([flat, flat], [0])
    with pytest.raises(ValueError, match="at least one part"):
        MergedIndex([], [])


@pytest.fixture(scope="module")
def with_copies(tmp_path_factory):
    """Versions of one catalog at S = 1 and S = 4, each then added COPIES rows that copy rows of
    the first build exactly (new ids, new items: other segments, and for S = 4 often other shards)."""
    folder = tmp_path_factory.mktemp("merge")
    model = support.model(folder / "model", DIM)
    data = support.catalog(N, DIM, ITEMS)
    copies = ItemTable(
        [f"copy{i:03d}" for i in range(COPIES)],
        None,
        [f"/images/copy{i}.png" for i in range(COPIES)],
        [{"item": f"copied{i}", "shade": "0"} for i in range(COPIES)],
    )
    roots = {}
    for shards in (1, 4):
        root = folder / f"s{shards}"
        support.publish(root, data, model, shards)
        add_vectors(root, data[0][:COPIES], copies)
        roots[shards] = root
    return roots, data[0][:COPIES]


def _answers(engine, pair, queries):
    found = engine.search(pair, queries, K, [NOTHING_EXCLUDED] * len(queries))
    return [[(h.row, h.score) for h in answer.hits] for answer in found]


@pytest.mark.parametrize("shards", [1, 4])
def test_rows_that_tie_answer_in_one_order_over_segments_shards_and_the_ingress_merge(with_copies, shards):
    roots, originals = with_copies
    version = IndexVersion.open(roots[shards]).load()
    assert len(version.segment_entries or version.shard_names) > 0 and version.size == N + COPIES
    queries = originals[:12]  # each query's own row and its copy score alike: a tie for first place
    one = _answers(SearchEngine(), ServingPair(None, version.searchable(), version), queries)  # type: ignore[arg-type]
    ties = 0
    for hits in one:
        for (row_a, score_a), (row_b, score_b) in zip(hits, hits[1:], strict=False):
            assert score_a > score_b or (score_a == score_b and row_a < row_b)  # score, then row
            ties += score_a == score_b
    assert ties >= len(queries)  # every query met its copy in another segment or shard
    if shards > 1:  # the ingress's merge of the shard replicas' answers: the same rows, the same order
        sharded = ShardedSearch(LocalShards(roots[shards], shards))
        assert _answers(sharded, ServingPair(None, None, version), queries) == one  # type: ignore[arg-type]


def test_a_segmented_version_answers_range_searches_with_faiss_range_search(with_copies):
    roots, originals = with_copies
    version = IndexVersion.open(roots[1]).load()
    searched = version.searchable()
    assert isinstance(searched, MergedIndex) and len(searched.parts) == 2
    assert by_range_search(searched)  # every part (Flat) has a range search of its own
    min_score = 0.6
    found = reaching(searched, originals[:20], min_score, limit=N)
    for query, answer in zip(originals[:20], found, strict=True):
        exact = version.exact_scores(query)
        assert not answer.truncated
        assert set(np.flatnonzero(exact >= min_score + 1e-5)) <= set(answer.rows.tolist())
        assert (exact[answer.rows] >= min_score - 1e-5).all()
        assert {row for row in answer.rows.tolist() if row >= N}  # the copy, from the added segment
