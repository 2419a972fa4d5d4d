"""The HTTP API fuzzed from its own OpenAPI document (schemathesis, every check, positive and
negative data): a real server on loopback over a tiny catalog index serves `/openapi.json`, and
every request drawn from it is answered without a 5xx (but a 504 for the deadline the request
set), schema-valid requests are accepted and invalid ones refused.

What a schema cannot say is supplied here, as a client would: an image field holds an image,
an item id names an indexed item, a text fits the text model's context in tokens, a Feedback
request id one the server answered, a region lies inside its image, and an item added is one the
index does not hold yet, unlabelled as the index's are. Everything else the rules of the service
layer allow is in the document."""

from __future__ import annotations

import base64
import io
import itertools
import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from PIL import Image
from schemathesis import GenerationMode
from schemathesis.config._checks import NotAServerErrorConfig
from schemathesis.specs.openapi.checks import negative_data_rejection
from schemathesis.transport.serialization import Binary

from serving.transport.routes import ROUTES
from tests.support.index import write_catalog_index
from tests.support.server import start

ADMIN = "admin-s3cret"
# Examples per operation and phase: enough to reach every rule in a minute on two cores.
EXAMPLES = int(os.environ.get("SIMSEARCH_FUZZ_EXAMPLES", "25"))
# The default suite draws the same examples every run; a run with SIMSEARCH_FUZZ_EXAMPLES set draws new ones.
DERANDOMIZE = "SIMSEARCH_FUZZ_EXAMPLES" not in os.environ
SIDE = 48  # the query images' side: room for any region the hooks make
PHRASES = ["blue", "a red square", "LATIN SMALL LETTER A"]  # a few tokens: within any text model's context


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), (30, 120, 200)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = write_catalog_index(tmp_path_factory.mktemp("fuzz"), items=16, text=True)
    # Every AddItems case accepted publishes a segment: compaction (on Ray) is not what is fuzzed here.
    server, client = start(root, http_port=0, admin_token=ADMIN, max_k=50, max_segments=1000)
    base = f"http://127.0.0.1:{server.http_port}"
    answer = requests.post(f"{base}/v1/search/image", data=png(), headers={"Content-Type": "image/png"}, timeout=60)
    ids = [n["id"] for n in answer.json()["neighbors"]]
    yield base, ids, answer.json()["requestId"]
    client.close()
    server.stop(grace=1)


@pytest.fixture(scope="module")
def api_schema(live):
    base, ids, request_id = live
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    schema.config.update(request_timeout=60)
    # A 504 is the answer to a deadline the request set: the test's own assertion allows only those.
    schema.config.checks.not_a_server_error = NotAServerErrorConfig(expected_statuses=["2xx", "3xx", "4xx", "504"])

    @schema.auth.auth()
    class Token:
        """Every route takes the admin token; schemathesis's `ignored_auth` check sends others."""

        def get(self, case, context):
            return ADMIN

        def set(self, case, token, context):
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}

    image = base64.b64encode(png()).decode()
    fresh = itertools.count()

    def json_values(value, positive: bool):
        """A JSON body with what the schema cannot say made true."""
        if isinstance(value, list):
            return [json_values(v, positive) for v in value]
        if not isinstance(value, dict):
            return value
        value = {k: json_values(v, positive) for k, v in value.items()}
        if positive:
            if isinstance(value.get("image"), str):
                value["image"] = image
            if isinstance(value.get("itemId"), str):
                value["itemId"] = ids[len(value["itemId"]) % len(ids)]
            if isinstance(value.get("text"), str):  # within the text model's context, in tokens
                value["text"] = PHRASES[len(value["text"]) % len(PHRASES)]
            if isinstance(value.get("region"), dict):
                value["region"] = {"x": 0, "y": 0, "width": SIDE // 2, "height": SIDE // 2}
            parts = value.get("parts")
            if isinstance(parts, list) and parts and all(isinstance(p, dict) for p in parts):
                # at least one positive part, and weights the parts cannot cancel out with (an
                # embedding and its opposite): rules over the parts together, which a schema cannot count
                parts[0]["negative"] = False
                for i, part in enumerate(parts):
                    part["weight"] = 0.1 / (i + 1) if part.get("negative") else 2.0**i
        return value

    @schema.hook
    def map_case(context, case):
        positive = case.meta is not None and case.meta.generation.mode.is_positive
        if not positive:
            return case
        if isinstance(case.body, dict | list) and case.media_type == "application/json":
            case.body = json_values(case.body, positive)
            if case.path == "/v1/feedback" and isinstance(case.body, dict):
                case.body["requestId"] = request_id
                case.body["relevantIds"] = ids[: len(case.body.get("relevantIds") or [])]
            if case.path == "/v1/admin/reload" and isinstance(case.body, dict):
                case.body = {}  # a version and model directory on this server's disk: CURRENT's
            if case.path == "/v1/admin/add-items" and isinstance(case.body, dict):
                for item in case.body.get("items") or []:
                    if isinstance(item, dict):  # an id not indexed yet, once; no label, as the index has none
                        item["id"] = f"fuzz-{next(fresh)}"
                        item.pop("label", None)
        elif case.path in ("/v1/search/image", "/v1/embed/image"):
            # schemathesis's own wrapper of bytes: what a `format: binary` value is
            if case.media_type == "multipart/form-data":
                case.body = {"image": Binary(png())}
            else:  # schemathesis checks a body against its media type's schema again: `image/*`'s is not found
                case.body, case.media_type = Binary(png()), "application/octet-stream"
            if case.query and "region" in case.query:
                case.query["region"] = f"0,0,{SIDE // 2},{SIDE // 2}"
            if case.query and case.query.get("groupBy") == "":  # rows per group of no grouping: refused
                case.query.pop("perGroup", None)
        if case.path_parameters and "item_id" in case.path_parameters:
            case.path_parameters["item_id"] = ids[0]
        return case

    return schema


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method} {r.path}")
def test_the_api_keeps_what_its_openapi_document_says(api_schema, route, mode):
    # schemathesis's pytest plugin (from_fixture) reads a node attribute pytest 9.2 no longer has:
    # its Hypothesis strategies are driven here instead, one operation and mode a test.
    operation = api_schema[route.path][route.method]

    @given(case=operation.as_strategy(generation_mode=mode, auth_storage=api_schema.auth))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=DERANDOMIZE,
    )
    def fuzz(case):
        # A positive case is not negative data: schemathesis checks an upload (bytes, not a JSON
        # string) against its schema again and may then take the case for a negative one.
        excluded = [negative_data_rejection] if mode is GenerationMode.POSITIVE else []
        response = case.call_and_validate(excluded_checks=excluded)
        deadline = bool(case.headers) and "X-Request-Timeout" in case.headers
        assert response.status_code < 500 or (response.status_code == 504 and deadline), response.text

    fuzz()
