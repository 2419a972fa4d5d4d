"""Text queries (issue 49) on a real loopback server over gRPC, HTTP and the CLI: answered by the
text model the version records, equal to the offline search of that model, mixed with images as
parts, scored apart in the online Recall@K, and every bad input answered precisely."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests

from core.artifacts.layout import ArtifactError
from core.retrieval.vectors import exact_search
from index.build.build import run_build
from index.build.config import BuildConfig
from index.build.listing import describe_version
from index.embedder import OnnxTextEmbedder
from index.versions.version import IndexVersion
from protos.simsearch.v1 import search_pb2 as pb
from tests.support.index import write_images, write_tiny_model, write_tiny_text_model
from tests.support.server import start

ROOT = Path(__file__).resolve().parents[2]
PHRASES = ["a red square", "blue", "LATIN CAPITAL LETTER A", "something round and green"]


def _catalog(tmp: Path, count: int = 30) -> Path:
    paths = write_images(tmp / "images", count)
    catalog = tmp / "images" / "catalog.csv"
    with open(catalog, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "path", "label"])
        writer.writerows([p.stem, p.name, f"class{n % 5}"] for n, p in enumerate(paths))
    return catalog


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """Two index roots over one catalog: one built with a text model, one without."""
    tmp = tmp_path_factory.mktemp("text")
    model = write_tiny_model(tmp / "model")
    text = write_tiny_text_model(tmp / "text", model)
    catalog = _catalog(tmp)
    for name, text_model in (("with", str(text)), ("without", None)):
        config = BuildConfig(
            model=str(model), index_root=str(tmp / name), catalog=str(catalog), min_ann_recall=0,
            text_model=text_model, filterable=["label"],
        )  # fmt: skip
        run_build(config, progress=False)
    return tmp


@pytest.fixture(scope="module")
def served(roots):
    server, client = start(roots / "with", http_port=0)
    yield server, client
    client.close()
    server.stop(grace=1)


def _offline(root: Path, text_dir: Path, phrase: str, k: int) -> list[str]:
    version = IndexVersion.open(root)
    vector = OnnxTextEmbedder(text_dir).embed([phrase])
    _, rows = exact_search(np.asarray(version.vectors), vector, k)
    return [version.items.ids[r] for r in rows[0]]


def test_the_version_records_its_text_model(roots):
    manifest = IndexVersion.open(roots / "with").manifest
    assert manifest.text_model_id == "tinytext00000000"
    assert Path(manifest.text_model_dir) == (roots / "text").resolve()
    assert IndexVersion.open(roots / "without").manifest.text_model_id is None
    assert "  text_model=tinytext00000000  " in describe_version(manifest)  # `index list`
    assert "text_model=" not in describe_version(IndexVersion.open(roots / "without").manifest)


def test_a_served_text_query_equals_the_offline_search(roots, served):
    server, client = served
    for phrase in PHRASES:
        answer = client.search_text(phrase, k=8)
        assert [n.id for n in answer.neighbors] == _offline(roots / "with", roots / "text", phrase, 8), phrase
        over_http = requests.post(
            f"http://127.0.0.1:{server.http_port}/v1/search", json={"text": phrase, "k": 8}, timeout=60
        )
        assert over_http.status_code == 200, over_http.text
        assert [n["id"] for n in over_http.json()["neighbors"]] == [n.id for n in answer.neighbors]


def test_text_queries_take_filters_exclusions_and_min_score(roots, served):
    _, client = served
    plain = client.search_text("blue", k=10)
    first = plain.neighbors[0].id
    excluded = client.search(pb.SearchRequest(text="blue", k=10, exclude_ids=[first]))
    assert first not in [n.id for n in excluded.neighbors]
    floor = plain.neighbors[3].score
    above = client.search(pb.SearchRequest(text="blue", min_score=floor))
    assert [n.id for n in above.neighbors] == [n.id for n in plain.neighbors[:4]]
    class2 = pb.Filter(must=[pb.Condition(field="label", value="class2")])
    only = client.search(pb.SearchRequest(text="blue", k=5, filter=class2))
    assert only.neighbors and {n.label for n in only.neighbors} == {"class2"}
    grouped = client.search(pb.SearchRequest(text="blue", k=3, group_by="label", per_group=2))
    assert grouped.group_by == "label" and len({n.group for n in grouped.neighbors}) == 3
    assert [n.id for n in grouped.neighbors][:1] == [first]  # the best row leads the best group


def test_an_image_and_a_phrase_mix_as_parts(roots, served):
    _, client = served
    version = IndexVersion.open(roots / "with")
    image = Path(version.items.paths[0]).read_bytes()
    mixed = client.search(pb.SearchRequest(k=5, parts=[pb.QueryPart(image=image), pb.QueryPart(text="blue")]))
    image_vector = client.embed(image).embedding
    text_vector = OnnxTextEmbedder(roots / "text").embed(["blue"])[0]
    combined = np.asarray(image_vector, np.float64) + text_vector
    combined /= np.linalg.norm(combined)
    _, rows = exact_search(np.asarray(version.vectors), combined[None].astype(np.float32), 5)
    assert [n.id for n in mixed.neighbors] == [version.items.ids[r] for r in rows[0]]


def test_labelled_text_traffic_is_scored_apart(served):
    _, client = served
    for _ in range(3):
        client.search(pb.SearchRequest(text="blue", k=5, label="class1"))
    sources = {figure.source for figure in client.get_info().recall_at_k}
    assert "text" in sources and "traffic" not in sources
    info = client.get_info()
    assert info.text_model_id == "tinytext00000000" and info.text_context_length == 16


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "text is empty"),
        ("   ", "text is empty"),
        ("word " * 20, "the text is 22 tokens with its start and end tokens; this text model reads at most 16"),
        ("x" * 2001, "text is 2001 characters; at most 2000"),
    ],
)
def test_bad_text_is_refused_precisely(served, text, message):
    server, client = served
    with pytest.raises(grpc.RpcError) as caught:
        client.search_text(text)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    over_http = requests.post(f"http://127.0.0.1:{server.http_port}/v1/search", json={"text": text}, timeout=60)
    assert over_http.status_code == 400 and message in over_http.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:
        client.search(pb.SearchRequest(parts=[pb.QueryPart(embedding=pb.Embedding(values=[1.0] * 16)),
                                              pb.QueryPart(text=text)]))  # fmt: skip
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("parts[1]: ") and message in caught.value.details()


def test_an_index_without_a_text_model_refuses_text_naming_what_to_build(roots):
    server, client = start(roots / "without", http_port=0)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            client.search_text("blue")
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has no text model" in caught.value.details()
        assert "index build --text-model" in caught.value.details()
        over_http = requests.post(f"http://127.0.0.1:{server.http_port}/v1/search", json={"text": "blue"}, timeout=60)
        assert over_http.status_code == 400 and "has no text model" in over_http.json()["error"]["message"]
        assert client.get_info().text_model_id == ""
        cli = _query_cli(server.port, "--text", "blue")
        assert cli.returncode != 0 and "Traceback" not in cli.stderr
        assert "has no text model" in cli.stderr.strip().splitlines()[-1]
    finally:
        client.close()
        server.stop(grace=1)


def test_a_text_model_of_another_image_model_is_refused_naming_both(roots, tmp_path):
    other = write_tiny_model(tmp_path / "other", seed=7)
    foreign = write_tiny_text_model(tmp_path / "foreign", other)
    config = BuildConfig(
        model=str(roots / "model"), index_root=str(tmp_path / "root"), catalog=str(roots / "images" / "catalog.csv"),
        min_ann_recall=0, text_model=str(foreign),
    )  # fmt: skip
    with pytest.raises(ArtifactError) as caught:
        run_build(config, progress=False)
    message = str(caught.value)
    assert "tiny000000000007" in message and "tiny000000000000" in message and "tinytext00000000" in message
    assert not (tmp_path / "root" / "CURRENT").exists()


def _query_cli(port: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serving", "query", "--target", f"127.0.0.1:{port}", "--timeout", "60", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_cli_queries_by_text(served):
    server, client = served

    def query(*args: str) -> subprocess.CompletedProcess:
        return _query_cli(server.port, *args)

    proc = query("--text", "blue", "--k", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "text 'blue'" in proc.stdout
    assert [n.id for n in client.search_text("blue", k=3).neighbors][0] in proc.stdout
    empty = query("--text", " ")
    assert empty.returncode != 0 and "--text is empty" in empty.stderr
    long = query("--text", "word " * 20)
    assert long.returncode == 2 and "this text model reads at most 16" in long.stderr
