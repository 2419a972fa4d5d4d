"""Filtered search: the value → rows structure and its filters (index/search/filters.py), the planner's
two paths over every index type (index/search/faiss_search.py: search_within), and a real server on
loopback answering filtered queries over Flat, IVF-Flat, IVF-PQ (re-ranked) and HNSW versions
built with `--filterable`."""

from __future__ import annotations

import csv

import grpc
import numpy as np
import pytest

from core.data.catalog import read_catalog
from core.data.items import ItemTable
from index.build.build import run_build
from index.build.config import BuildConfig
from index.changes.add import run_add
from index.search.faiss_index import build_index, with_default_rerank
from index.search.faiss_search import EXACT, INDEX, exact_within, search_within, searchable
from index.search.filters import (
    Condition,
    FieldSpec,
    Filter,
    FilterError,
    FilterIndex,
    Range,
    check_catalog_fields,
    check_filter,
    parse_filterable,
)
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import condition

CATEGORIES = ("a", "b", "c", "d", "e")


def items_table(n: int = 200) -> ItemTable:
    """Row r: category CATEGORIES[r % 5], size r % 7 (int), price r / 10 (float), no price on every 13th row."""
    metadata = []
    for r in range(n):
        meta = {"category": CATEGORIES[r % 5], "size": str(r % 7)}
        if r % 13:
            meta["price"] = f"{r / 10}"
        metadata.append(meta)
    return ItemTable(
        ids=[f"i{r}" for r in range(n)],
        labels=[f"L{r % 3}" for r in range(n)],
        paths=[f"/x/{r}.png" for r in range(n)],
        metadata=metadata,
    )


SPECS = parse_filterable(["category", "size:int", "price:float", "label"])


@pytest.fixture(scope="module")
def structure(tmp_path_factory) -> FilterIndex:
    """Built, saved and read back: every test sees what a server reads."""
    path = tmp_path_factory.mktemp("filters") / "filters.npz"
    FilterIndex.build(items_table(), SPECS).save(path)
    return FilterIndex.load(path)


def rows(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(mask).tolist())


def test_structure_is_arrays_per_field(structure):
    category = structure.fields["category"]
    assert category.values.tolist() == list(CATEGORIES)
    assert category.offsets.tolist() == [0, 40, 80, 120, 160, 200]
    assert category.rows[:3].tolist() == [0, 5, 10] and category.rows.dtype == np.int32
    price = structure.fields["price"]
    assert price.values.dtype == np.float64 and len(price.rows) == 200 - len(range(0, 200, 13))
    assert structure.specs == SPECS


def test_conditions_and_their_combinations(structure):
    n = 200
    eq = structure.mask(Filter(must=(Condition("category", value="b"),)))
    assert rows(eq) == {r for r in range(n) if r % 5 == 1}
    member = structure.mask(Filter(must=(Condition("size", any_of=("0", "3", "3")),)))
    assert rows(member) == {r for r in range(n) if r % 7 in (0, 3)}
    ranged = structure.mask(Filter(must=(Condition("price", range=Range(gte=2.0, lt=5.0)),)))
    assert rows(ranged) == {r for r in range(20, 50) if r % 13}  # rows without a price never match
    open_range = structure.mask(Filter(must=(Condition("size", range=Range(gt=5)),)))
    assert rows(open_range) == {r for r in range(n) if r % 7 == 6}
    combined = structure.mask(
        Filter(
            must=(Condition("category", any_of=("a", "b")), Condition("label", value="L0")),
            should=(Condition("size", value="1"), Condition("price", range=Range(lte=3.0))),
            must_not=(Condition("price", range=Range(gte=1.0, lte=1.5)),),
        )
    )
    expected = {
        r
        for r in range(n)
        if r % 5 in (0, 1)
        and r % 3 == 0
        and (r % 7 == 1 or (r % 13 and r / 10 <= 3.0))
        and not (r % 13 and 1.0 <= r / 10 <= 1.5)
    }
    assert rows(combined) == expected and expected
    only_not = structure.mask(Filter(must_not=(Condition("category", value="a"),)))
    assert rows(only_not) == {r for r in range(n) if r % 5}
    nothing = structure.mask(Filter(must=(Condition("category", value="zzz"),)))
    assert not nothing.any()  # a filter matching nothing is a mask, not an error


@pytest.mark.parametrize(
    ("query", "field", "words"),
    [
        (Filter(must=(Condition("colour", value="red"),)), "colour", "not filterable"),
        (Filter(must=(Condition("size", value="big"),)), "size", "not a int"),
        (Filter(must=(Condition("price", any_of=("1.5", "cheap")),)), "price", "not a float"),
        (Filter(must=(Condition("category", range=Range(gte=1)),)), "category", "numeric field"),
        (Filter(must=(Condition("price"),)), "price", "exactly one"),
        (Filter(must=(Condition("category", any_of=()),)), "category", "no values"),
        (Filter(must=(Condition("price", range=Range()),)), "price", "no bounds"),
        (Filter(must=(Condition("price", range=Range(gte=5, lte=2)),)), "price", "contradictory"),
        (Filter(should=(Condition("size", range=Range(gt=3, lt=3)),)), "size", "contradictory"),
        (Filter(must_not=(Condition("price", range=Range(gte=1, gt=2)),)), "price", "two bounds"),
        (Filter(must=(Condition("", value="x"),)), "", "no field name"),
        (Filter(), "", "no conditions"),
    ],
)
def test_bad_filters_name_the_field(structure, query, field, words):
    with pytest.raises(FilterError) as err:
        structure.mask(query)
    assert err.value.field == field and words in str(err.value)
    if field:
        assert repr(field) in str(err.value)
    # Checked from the declared fields alone (a sharded server's ingress, which holds no rows):
    # the same error, word for word.
    with pytest.raises(FilterError) as unheld:
        check_filter(query, SPECS)
    assert str(unheld.value) == str(err.value)


def test_declarations_are_checked_against_the_catalog():
    assert parse_filterable(["category", " price : float "]) == [FieldSpec("category"), FieldSpec("price", "float")]
    with pytest.raises(ValueError, match="'when'.*not one of"):
        parse_filterable(["price:when"])
    with pytest.raises(ValueError, match="declared twice"):
        parse_filterable(["a", "a:int"])
    metadata = [{"brand": "x", "price": "1.5"}, {"brand": "y", "price": "2,5"}]
    with pytest.raises(ValueError, match=r"column 'price' row 2 holds '2,5', not a float"):
        check_catalog_fields(parse_filterable(["price:float"]), None, metadata)
    with pytest.raises(ValueError, match="no column 'colour'"):
        check_catalog_fields(parse_filterable(["colour"]), None, metadata)
    with pytest.raises(ValueError, match="no label column"):
        check_catalog_fields(parse_filterable(["label"]), None, metadata)
    check_catalog_fields(parse_filterable(["brand", "price:float"]), None, metadata[:1])


# -- the planner's two paths ------------------------------------------------------------------

FACTORIES = {
    "flat": ("Flat", {}),
    "ivf-flat": ("IVF32,Flat", {"nprobe": 8}),
    "ivf-pq-reranked": ("IVF32,PQ8", {"nprobe": 8}),
    "hnsw": ("HNSW16", {"efSearch": 64}),
}


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 32)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", list(FACTORIES))
@pytest.mark.parametrize("threshold", [0.0, 1.0], ids=["index-path", "exact-path"])
def test_search_within_returns_k_matching_rows(vectors, kind, threshold):
    factory, params = FACTORIES[kind]
    index = build_index(vectors, factory, params, device="cpu")
    searched = searchable(index, with_default_rerank(index, params), vectors)
    queries = vectors[:20]
    for fraction in (0.5, 0.05):
        allowed = np.random.default_rng(1).random(len(vectors)) < fraction
        scores, found, path = search_within(searched, vectors, queries, 10, allowed, exact_below=threshold)
        assert path == (INDEX if threshold == 0.0 else EXACT)
        assert (found >= 0).all() and allowed[found].all()
        assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
        _, truth = exact_within(vectors, queries, 10, np.flatnonzero(allowed))
        recall = np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)])
        assert recall >= (1.0 if kind == "flat" or path == EXACT else 0.7), (kind, fraction, recall)
    few = np.zeros(len(vectors), dtype=bool)
    few[[3, 77, 901]] = True  # fewer rows than k: all of them, then -1
    _, found, _ = search_within(searched, vectors, queries, 10, few, exact_below=threshold)
    assert all(set(r[:3]) == {3, 77, 901} for r in found) and (found[:, 3:] == -1).all()
    _, found, _ = search_within(searched, vectors, queries, 10, np.zeros(len(vectors), dtype=bool))
    assert (found == -1).all()


# -- a real server ----------------------------------------------------------------------------


def catalog_with_categories(demo_run, out) -> tuple:
    """The demo's test split with `category` (row % 4: c0..c3, so each holds a quarter) and a
    `price` (row / 10) per row."""
    source = read_catalog(demo_run / "train" / "splits" / "test.csv")
    path = out / "catalog.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "path", "label", "category", "price"])
        for r, (item_id, p, label) in enumerate(zip(source.ids, source.paths, source.labels, strict=True)):
            w.writerow([item_id, p, label, f"c{r % 4}", r / 10])
    return path, read_catalog(path)


@pytest.fixture(scope="module", params=list(FACTORIES), ids=list(FACTORIES))
def served_filtered(request, demo_run, tmp_path_factory):
    from tests.support.server import start

    factory, params = FACTORIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    path, catalog = catalog_with_categories(demo_run, root)
    cfg = BuildConfig(
        model=str(demo_run / "model"),
        index_root=str(root / "index"),
        catalog=str(path),
        factory=factory,
        search_params=params,
        filterable=["category", "price:float", "label"],
    )
    run_build(cfg, progress=False)
    server, client = start(root / "index", ann_sample_rate=1.0)
    yield request.param, server, client, catalog
    client.close()
    server.stop(grace=1)


def match(field: str, value) -> pb.Filter:
    return pb.Filter(must=[condition(field, value)])


@pytest.mark.slow
def test_filtered_queries_on_every_index_type(served_filtered):
    kind, server, client, catalog = served_filtered
    info = client.get_info()
    assert {(f.name, f.type) for f in info.filterable} == {
        ("category", "string"),
        ("price", "float"),
        ("label", "string"),
    }
    version = IndexVersion.open(server.config.index_root)
    category = {i: m["category"] for i, m in zip(catalog.ids, catalog.metadata, strict=True)}
    price = {i: float(m["price"]) for i, m in zip(catalog.ids, catalog.metadata, strict=True)}
    query_id = catalog.ids[5]
    vector = version.vector(version.row_of(query_id))

    # k neighbours, every one matching, for each query kind; equal to exact filtered search on Flat.
    by_embedding = client.search_embedding(vector, k=10, filter=match("category", "c2"))
    assert len(by_embedding.neighbors) == 10 and {category[n.id] for n in by_embedding.neighbors} == {"c2"}
    allowed = np.asarray([category[i] == "c2" for i in version.items.ids])
    _, truth = exact_within(version.vectors, vector[None], 10, np.flatnonzero(allowed))
    truth_ids = [version.items.ids[r] for r in truth[0]]
    overlap = len(set(truth_ids) & {n.id for n in by_embedding.neighbors}) / 10
    assert overlap == 1.0 if kind == "flat" else overlap >= 0.8
    if kind == "flat":
        assert [n.id for n in by_embedding.neighbors] == truth_ids
    by_item = client.search_item(query_id, k=10, filter=match("category", "c1"))
    assert len(by_item.neighbors) == 10 and query_id not in [n.id for n in by_item.neighbors]
    assert {category[n.id] for n in by_item.neighbors} == {"c1"}
    by_image = client.search_image(catalog.paths[5], k=10, filter=match("category", "c3"))
    assert len(by_image.neighbors) == 10 and {category[n.id] for n in by_image.neighbors} == {"c3"}

    # must / should / must_not and ranges, and SearchBatch.
    combined = pb.Filter(
        must=[condition("price", gte=10, lt=100)],
        should=[condition("category", "c0"), condition("category", "c1")],
        must_not=[condition("category", "c1")],
    )
    batch = client.search_batch(
        [pb.SearchRequest(item_id=i, k=10, filter=combined) for i in catalog.ids[:3]]
        + [pb.SearchRequest(item_id=catalog.ids[3], k=10)]
    )
    for response in batch.responses[:3]:
        assert len(response.neighbors) == 10
        assert all(category[n.id] == "c0" and 10 <= price[n.id] < 100 for n in response.neighbors)
    assert len(batch.responses[3].neighbors) == 10  # an unfiltered query beside them
    few = pb.Filter(must=[condition("price", gte=0, lte=0.6)])  # rows 0..6: 7 items
    assert len(client.search_embedding(vector, k=10, filter=few).neighbors) == 7
    none = client.search_embedding(vector, k=10, filter=match("category", "nothing-has-this"))
    assert len(none.neighbors) == 0

    # Bad input: INVALID_ARGUMENT naming the field.
    bad = {
        "colour": match("colour", "red"),
        "price": match("price", "cheap"),
        "category": pb.Filter(must=[condition("category", gte=1)]),
        "label": pb.Filter(must=[pb.Condition(field="label")]),
    }
    for field, flt in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            client.search_embedding(vector, k=5, filter=flt)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"'{field}'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.search_embedding(vector, k=5, filter=pb.Filter(must=[condition("price", gte=5, lte=1)]))
    assert "'price'" in err.value.details() and "contradictory" in err.value.details()

    # Metrics count filtered queries by path; the ANN monitor compares them with exact filtered search.
    paths = {
        s.labels["path"]: s.value
        for s in server.metrics.filtered_queries.collect()[0].samples
        if s.name.endswith("_total")
    }
    assert sum(paths.values()) == 8  # the eight filtered queries above that were answered
    assert paths[EXACT] > 0 and (paths[INDEX] > 0) == (kind != "flat")  # 25% takes the index, 7 rows exact
    assert server.monitor.ann_settled(60)
    assert server.monitor.ann_values()[10] >= (1.0 if kind == "flat" else 0.8)


@pytest.mark.slow
def test_add_keeps_the_declaration_and_probe_honours_a_filter(demo_run, tmp_path):
    from tests.support.server import start

    path, catalog = catalog_with_categories(demo_run, tmp_path)
    lines = list(csv.reader(path.open()))
    first, rest = tmp_path / "first.csv", tmp_path / "rest.csv"
    with first.open("w", newline="") as f:
        csv.writer(f).writerows(lines[: len(lines) // 2])
    with rest.open("w", newline="") as f:
        csv.writer(f).writerows(lines[:1] + lines[len(lines) // 2 :])
    cfg = BuildConfig(
        model=str(demo_run / "model"), index_root=str(tmp_path / "index"), catalog=str(first), filterable=["category"]
    )
    run_build(cfg, progress=False)
    run_add(BuildConfig(model=cfg.model, index_root=cfg.index_root, catalog=str(rest)), progress=False)
    version = IndexVersion.open(cfg.index_root)
    assert version.manifest.filterable == {"category": "string"} and len(version.items) == len(catalog)
    c3 = version.filters.mask(Filter(must=(Condition("category", value="c3"),)))
    assert rows(c3) == {r for r in range(len(catalog)) if version.items.metadata[r]["category"] == "c3"}

    # The probe's queries carry probe_filter: every answer is in its category.
    server, client = start(
        tmp_path / "index", probe_size=20, probe_filter='{"must": [{"field": "category", "value": "c3"}]}'
    )
    try:
        seen = []
        original = server.service.search_many

        async def recording(requests, timeout, **lane):
            answers = await original(requests, timeout, **lane)
            seen.extend(n.id for a in answers for n in a.neighbors)
            return answers

        server.service.search_many = recording
        assert server.run_probe() is not None
        assert seen and all(version.items.metadata[version.row_of(i)]["category"] == "c3" for i in seen)
    finally:
        client.close()
        server.stop(grace=1)


def test_bad_declarations_fail_before_embedding(demo_run, tmp_path):
    path, _ = catalog_with_categories(demo_run, tmp_path)
    with pytest.raises(ValueError, match=r"row \d+ holds 'c0', not a float"):
        run_build(
            BuildConfig(
                model=str(demo_run / "model"),
                index_root=str(tmp_path / "i"),
                catalog=str(path),
                filterable=["category:float"],
            ),
            progress=False,
        )
    with pytest.raises(ValueError, match="no column 'brand'"):
        run_build(
            BuildConfig(
                model=str(demo_run / "model"), index_root=str(tmp_path / "i"), catalog=str(path), filterable=["brand"]
            ),
            progress=False,
        )
    with pytest.raises(ValueError, match="not one of"):
        BuildConfig(filterable=["price:decimal"])


@pytest.mark.slow
def test_a_filter_with_a_min_score_answers_every_matching_row_above_it(served_filtered):
    kind, server, client, catalog = served_filtered
    version = IndexVersion.open(server.config.index_root)
    category = {i: m["category"] for i, m in zip(catalog.ids, catalog.metadata, strict=True)}
    vector = version.vector(version.row_of(catalog.ids[5]))
    scores = version.vectors @ vector
    matching = np.asarray([category[i] == "c1" for i in version.items.ids])
    threshold = float(np.sort(scores[matching])[-6])  # the 6 best c1 rows reach it
    request = pb.SearchRequest(
        embedding=pb.Embedding(values=vector.tolist()), k=0, min_score=threshold, filter=match("category", "c1")
    )
    answer = client.search(request)
    expected = {version.items.ids[r] for r in np.flatnonzero(matching & (scores >= threshold))}
    assert {n.id for n in answer.neighbors} == expected and not answer.truncated
    assert all(n.score >= threshold - 1e-6 for n in answer.neighbors)
    request.k = 3  # fewer than reach it: the best 3, and the answer says it was cut
    cut = client.search(request)
    assert len(cut.neighbors) == 3 and cut.truncated and {n.id for n in cut.neighbors} <= expected
