"""docs/http.md is generated from the HTTP API's OpenAPI document and must match it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_http_reference_matches_the_openapi_document():
    done = subprocess.run(
        [sys.executable, "-m", "scripts.gen_http_doc", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_route_and_message_is_in_the_reference():
    from serving.transport.routes import ROUTES

    text = (ROOT / "docs" / "http.md").read_text()
    for route in ROUTES:
        assert f"### `{route.method} {route.path}`" in text
        for message in (route.request, route.response):
            if message is not None:
                assert f"### {message.DESCRIPTOR.name}\n" in text
