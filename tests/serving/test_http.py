"""The HTTP/JSON API against a real server on loopback: the same answers as gRPC from the same
service layer, admin routes behind the admin token, and a table of bad requests each answered
with its status and a message naming what was wrong — the server serving on afterwards."""

from __future__ import annotations

import io
import json
import shutil
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import requests
from PIL import Image

from core.artifacts import layout as artifacts
from core.data.catalog import read_catalog
from serving.client import SearchClient
from serving.config import ServerConfig
from tests.support.server import SearchServer

ROOT = Path(__file__).resolve().parents[2]
ADMIN, SEARCH = "admin-s3cret", "search-s3cret"


@pytest.fixture(scope="module")
def served(demo_run, tmp_path_factory):
    """A server with gRPC and HTTP over a copy of the demo index (takedowns change it)."""
    root = tmp_path_factory.mktemp("http") / "index"
    shutil.copytree(demo_run / "index", root, symlinks=True)
    server = SearchServer(
        ServerConfig.flat(
            index_root=str(root),
            port=0,
            http_port=0,
            metrics_port=None,
            admin_token=ADMIN,
            max_k=50,
            max_message_bytes=2 * 1024 * 1024,
            max_image_pixels=1_000_000,
            probe_interval_s=0,
        )
    )
    server.start()
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=60, admin_token=ADMIN)
    yield server, client, read_catalog(demo_run / "train" / "splits" / "test.csv")
    client.close()
    server.stop(grace=1)


def url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.http_port}{path}"


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def test_json_search_answers_what_grpc_answers(served):
    server, client, catalog = served
    for item in catalog.ids[:5]:
        over_grpc = client.search_item(item, k=5)
        answer = requests.post(url(server, "/v1/search"), json={"itemId": item, "k": 5}, timeout=60)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert [n["id"] for n in body["neighbors"]] == [n.id for n in over_grpc.neighbors]
        assert [n["score"] for n in body["neighbors"]] == pytest.approx([n.score for n in over_grpc.neighbors])
        assert body["indexVersion"] == over_grpc.index_version and body["truncated"] is False


def test_an_image_by_raw_body_or_multipart_answers_what_grpc_answers(served):
    server, client, catalog = served
    data = catalog.paths[3].read_bytes()
    expected = [n.id for n in client.search_image(data, k=8).neighbors]
    raw = requests.post(
        url(server, "/v1/search/image?k=8"), data=data, headers={"Content-Type": "image/png"}, timeout=60
    )
    assert raw.status_code == 200, raw.text
    assert [n["id"] for n in raw.json()["neighbors"]] == expected
    upload = requests.post(url(server, "/v1/search/image?k=8"), files={"image": ("q.png", data)}, timeout=60)
    assert [n["id"] for n in upload.json()["neighbors"]] == expected
    embedded = requests.post(
        url(server, "/v1/embed/image"), data=data, headers={"Content-Type": "image/png"}, timeout=60
    ).json()
    assert embedded["embedding"] == pytest.approx(list(client.embed(data).embedding), abs=1e-6)
    by_json = requests.post(
        url(server, "/v1/search/image"), params={"k": 3, "excludeIds": expected[0]}, data=data, timeout=60,
        headers={"Content-Type": "application/octet-stream"},
    ).json()  # fmt: skip
    assert [n["id"] for n in by_json["neighbors"]] == expected[1:4]


def test_info_feedback_batch_history_and_thumbnails(served):
    server, client, catalog = served
    info = requests.get(url(server, "/v1/info"), timeout=60).json()
    assert info["indexSize"] == client.get_info().index_size and isinstance(info["indexSize"], int)
    answer = requests.post(url(server, "/v1/search"), json={"itemId": catalog.ids[0], "k": 3}, timeout=60).json()
    feedback = requests.post(
        url(server, "/v1/feedback"),
        json={"requestId": answer["requestId"], "relevantIds": [answer["neighbors"][0]["id"]]},
        timeout=60,
    )
    assert feedback.json() == {"accepted": True}
    batch = requests.post(
        url(server, "/v1/search-batch"), json={"requests": [{"itemId": i, "k": 2} for i in catalog.ids[:3]]}, timeout=60
    ).json()
    assert [len(r["neighbors"]) for r in batch["responses"]] == [2, 2, 2]
    duplicates = requests.get(url(server, "/v1/duplicates"), timeout=60).json()
    assert duplicates == {"indexVersion": info["indexVersion"], "minScore": None, "run": None, "groups": []}
    history = requests.get(url(server, "/v1/health/history"), timeout=60).json()
    assert history["live"]["indexVersion"] == info["indexVersion"] and "feedback" in history["recall"]
    thumb = requests.get(
        url(server, f"/v1/items/{requests.utils.quote(catalog.ids[0], safe='')}/thumbnail"), timeout=60
    )
    assert thumb.status_code == 200 and thumb.headers["Content-Type"] in ("image/jpeg", "image/png")
    with Image.open(io.BytesIO(thumb.content)) as image:
        assert max(image.size) <= 160
    assert "script-src 'self'" in thumb.headers["Content-Security-Policy"]
    assert "Access-Control-Allow-Origin" not in thumb.headers  # CORS off unless --http-cors-origin


def test_openapi_document_lists_every_route(served):
    from serving.transport.routes import ROUTES

    server, _, _ = served
    document = requests.get(url(server, "/openapi.json"), timeout=60).json()
    assert document["openapi"].startswith("3.")
    for route in ROUTES:
        assert route.method.lower() in document["paths"][route.path]
    assert "itemId" in document["components"]["schemas"]["SearchRequest"]["properties"]


def test_requests_are_counted_with_their_protocol(served):
    server, client, catalog = served
    requests.post(url(server, "/v1/search"), json={"itemId": catalog.ids[0], "k": 1}, timeout=60)
    client.search_item(catalog.ids[0], k=1)
    samples = {
        (s.labels["method"], s.labels["code"], s.labels["protocol"]): s.value
        for s in server.metrics.requests.collect()[0].samples
        if s.name.endswith("_total")
    }
    assert samples[("Search", "OK", "http")] >= 1 and samples[("Search", "OK", "grpc")] >= 1


def png_bomb(side: int = 20_000) -> bytes:
    """A valid PNG header claiming side×side pixels, its data a few bytes that inflate hugely."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 65536))
        + chunk(b"IEND", b"")
    )


def bad_requests(catalog) -> list[tuple[str, str, str, dict, int, str, str]]:
    """(case, method, path, requests kwargs, HTTP status, gRPC code, what the message says)."""
    good = catalog.paths[0].read_bytes()
    png = {"Content-Type": "image/png"}
    return [
        ("non-image upload", "POST", "/v1/search/image", {"data": b"%PDF-1.4 not an image", "headers": png}, 400,
         "INVALID_ARGUMENT", "cannot decode image"),
        ("truncated image", "POST", "/v1/search/image", {"data": good[: len(good) // 2], "headers": png}, 400,
         "INVALID_ARGUMENT", "cannot decode image"),
        ("empty body", "POST", "/v1/search/image", {"data": b"", "headers": png}, 400, "INVALID_ARGUMENT",
         "body is empty"),
        ("empty JSON body", "POST", "/v1/search", {"data": b"", "headers": {"Content-Type": "application/json"}},
         400, "INVALID_ARGUMENT", "empty body"),
        ("20 MB body", "POST", "/v1/search/image", {"data": b"\0" * (20 * 1024 * 1024), "headers": png}, 413,
         "RESOURCE_EXHAUSTED", "exceeds the server's limit"),
        ("decompression bomb", "POST", "/v1/search/image", {"data": png_bomb(), "headers": png}, 413,
         "RESOURCE_EXHAUSTED", "pixels"),
        ("wrong content type", "POST", "/v1/search", {"data": b"itemId=x", "headers": {"Content-Type": "text/plain"}},
         415, "INVALID_ARGUMENT", "send application/json"),
        ("image as text", "POST", "/v1/search/image", {"data": good, "headers": {"Content-Type": "text/plain"}},
         415, "INVALID_ARGUMENT", "send the image as the body"),
        ("malformed JSON", "POST", "/v1/search", {"data": b"{\"itemId\": ", "headers": {"Content-Type":
         "application/json"}}, 400, "INVALID_ARGUMENT", "not a SearchRequest in proto3 JSON"),
        ("unknown JSON field", "POST", "/v1/search", {"json": {"itemId": catalog.ids[0], "kk": 5}}, 400,
         "INVALID_ARGUMENT", "kk"),
        ("k negative", "POST", "/v1/search", {"json": {"itemId": catalog.ids[0], "k": -1}}, 400, "INVALID_ARGUMENT",
         "k must be within 1..50, got -1"),
        ("k huge", "POST", "/v1/search", {"json": {"itemId": catalog.ids[0], "k": 10**10}}, 400, "INVALID_ARGUMENT",
         "k must be within 1..50, got 10000000000"),
        ("k past max_k", "POST", "/v1/search", {"json": {"itemId": catalog.ids[0], "k": 51}}, 400,
         "INVALID_ARGUMENT", "k must be within 1..50, got 51"),
        ("k negative in the query string", "POST", "/v1/search/image?k=-3", {"data": good, "headers": png}, 400,
         "INVALID_ARGUMENT", "k must be within 1..50, got -3"),
        ("feedback without its request id", "POST", "/v1/feedback", {"json": {"relevantIds": ["x"]}}, 400,
         "INVALID_ARGUMENT", "requestId is required"),
        ("NaN embedding", "POST", "/v1/search", {"json": {"embedding": {"values": ["NaN"] * 128}, "k": 3}}, 400,
         "INVALID_ARGUMENT", "NaN"),
        ("wrong-dimension embedding", "POST", "/v1/search", {"json": {"embedding": {"values": [0.1] * 7}, "k": 3}},
         400, "INVALID_ARGUMENT", "dimension 7"),
        ("unknown item id", "POST", "/v1/search", {"json": {"itemId": "no-such-item", "k": 3}}, 400,
         "INVALID_ARGUMENT", "unknown item id"),
        ("item id with ../", "GET", "/v1/items/..%2F..%2Fetc%2Fpasswd/thumbnail", {}, 404, "NOT_FOUND", "no item"),
        ("item id with a path", "GET", "/v1/items/../../etc/passwd/thumbnail", {}, 404, "NOT_FOUND", ""),
        ("bad filter", "POST", "/v1/search", {"json": {"itemId": catalog.ids[0], "filter": {"must": [{"field":
         "colour", "value": "red"}]}}}, 400, "INVALID_ARGUMENT", "filter"),
        ("bad filter in a query parameter", "POST", "/v1/search/image?filter=%7B", {"data": good, "headers": png},
         400, "INVALID_ARGUMENT", "filter"),
        ("unknown query parameter", "POST", "/v1/search/image?kk=3", {"data": good, "headers": png}, 400,
         "INVALID_ARGUMENT", "kk"),
        ("bad timeout header", "POST", "/v1/search", {"json": {"itemId": catalog.ids[0]}, "headers":
         {"X-Request-Timeout": "soon"}}, 400, "INVALID_ARGUMENT", "X-Request-Timeout"),
        ("admin route without a token", "POST", "/v1/admin/reload", {"json": {}}, 401, "UNAUTHENTICATED",
         "Bearer"),
        ("admin route with a wrong token", "GET", "/v1/admin/versions", {"headers": {"Authorization":
         "Bearer wrong"}}, 403, "PERMISSION_DENIED", "invalid token"),
        ("admin route with the search token", "POST", "/v1/admin/remove-items", {"json": {"ids": ["x"]},
         "headers": {"Authorization": f"Bearer {SEARCH}"}}, 403, "PERMISSION_DENIED", "invalid token"),
        ("unknown route", "GET", "/v1/nothing-here", {}, 404, "NOT_FOUND", "no route GET /v1/nothing-here"),
        ("wrong method", "GET", "/v1/search", {}, 405, "INVALID_ARGUMENT", "use POST"),
        ("unknown version made live", "POST", "/v1/admin/versions/v999/live", {"headers": admin_headers()}, 404,
         "NOT_FOUND", "no index version"),
        ("version name as a path", "GET", "/v1/admin/versions/..%2F..%2Fetc/neighbours.png",
         {"headers": admin_headers()}, 404, "NOT_FOUND", ""),
    ]  # fmt: skip


def test_a_mistake_is_said_alike_on_every_path_naming_the_field_as_its_transport_does(served):
    """k=-3 was `k must be within 0..2147483647` in the query string and `k must be at least 1` in
    a JSON body, neither the real range; a Feedback without its request id was `unknown or expired
    request_id ''` (issue 47)."""
    import grpc

    from protos.simsearch.v1 import search_pb2 as pb

    server, client, catalog = served
    item, image = catalog.ids[0], catalog.paths[0].read_bytes()

    def refused(path: str, **kwargs) -> str:
        answer = requests.post(url(server, path), timeout=60, **kwargs)
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json()["error"]["code"] == "INVALID_ARGUMENT"
        return answer.json()["error"]["message"]

    def refused_over_grpc(call, *args) -> str:
        with pytest.raises(grpc.RpcError) as caught:
            call(*args)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return caught.value.details()

    for k in (-3, 51, -(2**31), 2**31 - 1, 2**31, 10**10):
        said = f"k must be within 1..50, got {k}"  # the server's max_k
        assert refused(f"/v1/search/image?k={k}", data=image, headers={"Content-Type": "image/png"}) == said
        assert refused("/v1/search", json={"itemId": item, "k": k}) == said
        assert refused("/v1/search", json={"itemId": item, "k": str(k)}) == said  # proto3 JSON's int as a string
        batch = {"requests": [{"itemId": item, "k": 2}, {"itemId": item, "k": k}]}
        assert refused("/v1/search-batch", json=batch) == f"requests[1]: {said}"
        if -(2**31) <= k < 2**31:  # an int32 field: gRPC cannot carry more
            assert refused_over_grpc(client.search, pb.SearchRequest(item_id=item, k=k)) == said
    # a field spelled apart: the JSON name over HTTP, the proto one over gRPC
    assert refused(f"/v1/search/image?perGroup={2**40}", data=image, headers={"Content-Type": "image/png"}) == (
        f"perGroup must be within 1..16, got {2**40}"
    )
    assert refused("/v1/feedback", json={"relevantIds": [item]}).startswith("requestId is required")
    assert refused_over_grpc(client.feedback, "", [item]).startswith("request_id is required")
    assert refused("/v1/feedback", json={"requestId": "never-sent"}) == "unknown or expired requestId 'never-sent'"
    assert refused_over_grpc(client.feedback, "never-sent", []) == "unknown or expired request_id 'never-sent'"


def test_bad_requests_get_their_status_and_a_message_naming_the_problem(served):
    server, client, catalog = served
    cases = bad_requests(catalog)
    assert len(cases) >= 20
    seen = []
    for case, method, path, kwargs, status, code, says in cases:
        answer = requests.request(method, url(server, path), timeout=120, **kwargs)
        seen.append((case, answer.status_code))
        assert answer.status_code == status, (case, answer.status_code, answer.text[:300])
        body = answer.json()
        assert body["error"]["code"] == code, (case, body)
        assert says in body["error"]["message"], (case, body)
    # Still serving, both ways.
    assert requests.post(url(server, "/v1/search"), json={"itemId": catalog.ids[1], "k": 2}, timeout=60).ok
    assert len(client.search_item(catalog.ids[1], k=2).neighbors) == 2


def test_the_search_token_guards_search_but_not_the_console(demo_run, tmp_path):
    server = SearchServer(
        ServerConfig.flat(
            index_root=str(demo_run / "index"), port=0, http_port=0, metrics_port=None, search_token=SEARCH,
            probe_interval_s=0,
        )
    )  # fmt: skip
    server.start()
    try:
        item = read_catalog(demo_run / "train" / "splits" / "test.csv").ids[0]
        missing = requests.post(url(server, "/v1/search"), json={"itemId": item, "k": 3}, timeout=60)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "UNAUTHENTICATED"
        wrong = requests.post(
            url(server, "/v1/search"), json={"itemId": item, "k": 3}, headers={"Authorization": "Bearer x"}
        )
        assert wrong.status_code == 403
        right = requests.post(
            url(server, "/v1/search"), json={"itemId": item, "k": 3}, headers={"Authorization": f"Bearer {SEARCH}"}
        )
        assert right.status_code == 200
        assert requests.get(url(server, "/openapi.json"), timeout=60).status_code == 200
        admin = requests.get(url(server, "/v1/admin/versions"), headers={"Authorization": "Bearer x"}, timeout=60)
        assert admin.status_code == 403 and "admin API disabled" in admin.json()["error"]["message"]
    finally:
        server.stop(grace=0)


def test_admin_routes_list_switch_and_take_down(served):
    server, client, catalog = served
    versions = requests.get(url(server, "/v1/admin/versions"), headers=admin_headers(), timeout=60).json()["versions"]
    live = next(v for v in versions if v["live"])
    assert live["size"] == client.get_info().index_size and live["annRecall"] is not None
    sheet = requests.get(url(server, f"/v1/admin/versions/{live['version']}/neighbours.png"), headers=admin_headers())
    assert sheet.status_code == 200 and sheet.content.startswith(b"\x89PNG")

    victim = catalog.ids[2]
    removed = requests.post(
        url(server, "/v1/admin/remove-items"), json={"ids": [victim], "reason": "test takedown"},
        headers=admin_headers(), timeout=120,
    ).json()  # fmt: skip
    assert removed["removed"] == 1 and removed["previousIndexVersion"] == live["version"]
    assert victim not in [n.id for n in client.search_image(catalog.paths[2].read_bytes(), k=10).neighbors]
    audit = requests.get(url(server, "/v1/admin/audit"), headers=admin_headers(), timeout=60).json()["entries"]
    assert audit[0]["ids"] == [victim] and audit[0]["reason"] == "test takedown" and audit[0]["via"] == "http"
    assert "token sha256:" in audit[0]["who"] and ADMIN not in json.dumps(audit)

    def neighbours() -> list[str]:
        return [n.id for n in client.search_image(catalog.paths[2].read_bytes(), k=10).neighbors]

    def admin_post(path: str, **kwargs) -> requests.Response:
        return requests.post(url(server, path), headers=admin_headers(), timeout=120, **kwargs)

    # Back to the version before the takedown, by Reload or make live: the takedown stays, re-applied.
    for path, body in (
        ("/v1/admin/reload", {"indexVersion": live["version"]}),
        (f"/v1/admin/versions/{live['version']}/live", None),
    ):
        back = admin_post(path, json=body)
        assert back.status_code == 200, back.text
        now = back.json()["indexVersion"]
        assert now not in (live["version"], removed["indexVersion"]) and now == client.get_info().index_version
        assert back.json()["reappliedIds"] == [victim] and back.json()["restoredIds"] == []
        assert victim not in neighbours()
        entry = requests.get(url(server, "/v1/admin/audit"), headers=admin_headers(), timeout=60).json()["entries"][0]
        assert (entry["action"], entry["via"], entry["ids"]) == ("rollback", "http", [victim])
        assert entry["reason"] == f"rollback to {live['version']} re-applied 1 takedowns → version {now}"
    assert artifacts.current_version(server.config.index_root) == now

    # Only on request does a version come back with what was taken down since: audited by id.
    bad = admin_post(f"/v1/admin/versions/{live['version']}/live?restoreTakenDown=yes")
    assert bad.status_code == 400 and "restoreTakenDown must be true or false" in bad.text
    bad = admin_post("/v1/admin/reload", json={"restoreTakenDown": True})
    assert bad.status_code == 400 and "restore_taken_down needs index_version" in bad.text
    back = admin_post(f"/v1/admin/versions/{live['version']}/live?restoreTakenDown=true")
    assert back.status_code == 200, back.text
    assert back.json()["indexVersion"] == live["version"] == client.get_info().index_version
    assert back.json()["restoredIds"] == [victim] and victim in neighbours()
    entry = requests.get(url(server, "/v1/admin/audit"), headers=admin_headers(), timeout=60).json()["entries"][0]
    assert (entry["action"], entry["via"], entry["ids"]) == ("restore", "http", [victim])


def test_a_used_http_port_is_refused_before_loading(demo_run):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "serving", "serve", "--index-root", str(demo_run / "index"), "--port", "0",
             "--metrics-port", "none", "--http-port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: HTTP port 127.0.0.1:{port} is already in use")
    assert "serving index" not in proc.stderr


def test_cors_is_off_unless_an_origin_is_named(demo_run):
    origin = "https://console.example"
    server = SearchServer(
        ServerConfig.flat(
            index_root=str(demo_run / "index"), port=0, http_port=0, metrics_port=None, probe_interval_s=0,
            http_cors_origin=origin,
        )
    )  # fmt: skip
    server.start()
    try:
        preflight = requests.options(
            url(server, "/v1/search"),
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
            timeout=60,
        )
        assert preflight.status_code == 204 and "Authorization" in preflight.headers["Access-Control-Allow-Headers"]
        info = requests.get(url(server, "/v1/info"), headers={"Origin": origin}, timeout=60)
        assert info.headers["Access-Control-Allow-Origin"] == origin
        other = requests.get(url(server, "/v1/info"), headers={"Origin": "https://evil.example"}, timeout=60)
        assert "Access-Control-Allow-Origin" not in other.headers
        refused = requests.options(url(server, "/v1/search"), headers={"Origin": "https://evil.example"}, timeout=60)
        assert refused.status_code == 403
    finally:
        server.stop(grace=0)


def test_a_thumbnail_is_upright_and_a_missing_file_is_not_found(tmp_path):
    """A phone photo stored sideways (EXIF orientation 6) is shown upright, as the model sees it;
    an item whose file has gone since the build is 404, not the request's fault."""
    from serving.api.search_service import thumbnail_of
    from serving.errors import NotFound
    from serving.search.engine import Limits

    sideways = tmp_path / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° clockwise to view
    Image.new("RGB", (400, 200), (200, 30, 30)).save(sideways, "JPEG", exif=exif.tobytes())
    data, kind = thumbnail_of(str(sideways), 100, Limits())
    assert kind == "image/jpeg"
    with Image.open(io.BytesIO(data)) as thumb:
        assert thumb.size == (50, 100)  # upright: portrait
    with pytest.raises(NotFound, match="the image file of this item is gone: gone.jpg"):
        thumbnail_of(str(tmp_path / "gone.jpg"), 100, Limits())
