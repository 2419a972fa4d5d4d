"""What the HTTP API promises beyond its answers, on a real server on loopback over a tiny
catalog index (built in milliseconds): one default k on every route and transport, a 400 for an
upload it cannot read, the `Allow` header of a 405, a malformed request logged as one warning,
and an OpenAPI document that states the rules the service layer checks."""

from __future__ import annotations

import logging
import socket

import pytest
import requests

from protos.simsearch.v1 import search_pb2 as pb
from serving.search.checks import DEFAULT_K
from tests.support.index import write_catalog_index
from tests.support.server import connect, start

ADMIN = "admin-s3cret"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = write_catalog_index(tmp_path_factory.mktemp("contract"), items=16)
    server, client = start(root, http_port=0, admin_token=ADMIN, max_k=50)
    yield server, client, f"http://127.0.0.1:{server.http_port}"
    client.close()
    server.stop(grace=1)


def test_k_left_out_is_the_same_default_on_every_route_and_transport(served):
    server, client, base = served
    some_id = client.search(pb.SearchRequest(embedding=pb.Embedding(values=[1.0] * 16), k=1)).neighbors[0].id
    over_grpc = client.search(pb.SearchRequest(item_id=some_id))
    by_json = requests.post(f"{base}/v1/search", json={"itemId": some_id}, timeout=60)
    assert by_json.status_code == 200, by_json.text
    assert len(over_grpc.neighbors) == len(by_json.json()["neighbors"]) == DEFAULT_K
    assert [n["id"] for n in by_json.json()["neighbors"]] == [n.id for n in over_grpc.neighbors]
    png = _png()
    by_image = requests.post(f"{base}/v1/search/image", data=png, headers={"Content-Type": "image/png"}, timeout=60)
    over_grpc_image = client.search(pb.SearchRequest(image=png))
    assert by_image.status_code == 200, by_image.text
    assert len(by_image.json()["neighbors"]) == len(over_grpc_image.neighbors) == DEFAULT_K
    # With a min_score k left out is up to max_k, on both routes alike.
    wide = requests.post(f"{base}/v1/search/image?minScore=-1", data=png, headers={"Content-Type": "image/png"},
                         timeout=60)  # fmt: skip
    assert len(wide.json()["neighbors"]) == len(client.search(pb.SearchRequest(image=png, min_score=-1)).neighbors)
    assert len(wide.json()["neighbors"]) > DEFAULT_K


def _png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("path", ["/v1/embed/image", "/v1/search/image"])
@pytest.mark.parametrize(
    "content_type, body",
    [
        ("multipart/form-data", b"not multipart at all"),
        ("multipart/form-data; boundary=" + "x" * 71, b"not multipart at all"),
        ("multipart/form-data; boundary=b", b"not multipart at all"),
        ("multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="\x04"\r\n\r\nx\r\n--b--'),
    ],
)
def test_an_unreadable_multipart_upload_is_a_400_naming_the_problem(served, path, content_type, body):
    _, _, base = served
    answer = requests.post(f"{base}{path}", data=body, headers={"Content-Type": content_type}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert "multipart/form-data" in answer.json()["error"]["message"]


def test_a_405_names_the_allowed_methods(served):
    _, _, base = served
    for method, path, allowed in (("GET", "/v1/search", "POST"), ("DELETE", "/v1/info", "GET")):
        answer = requests.request(method, f"{base}{path}", timeout=60)
        assert answer.status_code == 405
        assert answer.headers["Allow"] == allowed


def test_a_malformed_request_is_one_warning_without_a_traceback(served, caplog):
    server, _, base = served
    with caplog.at_level(logging.DEBUG), socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(b"GET /v1/info HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n")
        reply = s.recv(4096)
    assert reply.split(b"\r\n")[0].endswith(b" 400 Bad Request")
    records = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert records and all(r.levelno == logging.WARNING and r.exc_info is None for r in records), [
        (r.levelname, r.getMessage(), bool(r.exc_info)) for r in records
    ]
    assert "\n" not in records[0].getMessage() and "answered 400" in records[0].getMessage()
    assert requests.get(f"{base}/v1/info", timeout=60).ok  # serving on
    connect(server).close()


def test_an_embedding_near_float32s_largest_is_searched_as_its_direction(served):
    """Its norm overflowed float32: the unit vector was all zeros (issue 40's fuzzer)."""
    _, client, base = served
    small = client.search(pb.SearchRequest(embedding=pb.Embedding(values=[1.0] * 16), k=5))
    huge = requests.post(f"{base}/v1/search", json={"embedding": {"values": [3.4e38] * 16}, "k": 5}, timeout=60)
    assert huge.status_code == 200, huge.text
    assert [n["id"] for n in huge.json()["neighbors"]] == [n.id for n in small.neighbors]


def test_the_openapi_document_states_the_rules_the_service_layer_checks(served):
    from serving.search.checks import MIN_SCORE_RANGE

    server, client, base = served
    document = requests.get(f"{base}/openapi.json", timeout=60).json()
    schemas = document["components"]["schemas"]
    search = schemas["SearchRequest"]
    limits = client.get_info().limits
    assert search["properties"]["k"]["maximum"] == limits.max_k == 50  # this server's, not the default's
    assert search["properties"]["perGroup"]["minimum"] == 1
    assert search["properties"]["perGroup"]["maximum"] == limits.max_per_group
    assert (search["properties"]["minScore"]["minimum"], search["properties"]["minScore"]["maximum"]) == MIN_SCORE_RANGE
    assert [alt["required"] for alt in search["oneOf"]] == [["image"], ["embedding"], ["itemId"], ["text"], ["parts"]]
    assert schemas["Embedding"]["properties"]["values"]["minItems"] == client.get_info().embedding_dim
    assert search["properties"]["groupBy"]["enum"] == ["", "item", "shade"]
    image = document["paths"]["/v1/search/image"]["post"]
    parameters = {p["name"]: p for p in image["parameters"]}
    assert parameters["filter"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Filter"}
    assert parameters["X-Request-Timeout"]["schema"] == {"type": "number", "minimum": 0, "exclusiveMinimum": True}
    assert parameters["k"]["schema"]["maximum"] == 50
    # {} is no longer a schema-valid SearchRequest: it has no query
    assert "required" not in search and all("required" in alt for alt in search["oneOf"])


@pytest.mark.parametrize("body", [b"[]", b'"itemId"', b"3"])
def test_a_json_body_that_is_not_an_object_is_refused(served, body):
    _, _, base = served
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"}
    answer = requests.post(f"{base}/v1/admin/reload", data=body, headers=headers, timeout=60)
    assert answer.status_code == 400, answer.text
    assert "a JSON object is expected" in answer.json()["error"]["message"]
