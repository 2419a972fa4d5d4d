"""What a new user met querying a server (issue 63), on a real one on loopback with a text model:
`info` into a pipe its reader closed exits quietly, a pasted page of `--text` is quoted by its
start in the error, and an HTTP body with both an image and words says which fields it set and
how to combine them."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from core.cli import CLOSED_PIPE_EXIT
from core.data.text import MAX_TEXT_CHARS
from tests.support.index import write_catalog_index
from tests.support.server import start

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = write_catalog_index(tmp_path_factory.mktemp("query-messages"), items=6, text=True)
    server, client = start(root, http_port=0)
    yield server, root
    client.close()
    server.stop(grace=1)


def command(server, *args: str, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serving", *args, "--target", f"127.0.0.1:{server.port}", "--timeout", "60"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )


def test_info_into_a_pipe_its_reader_closed_exits_quietly(served):
    """`serving info … | head -5` ended in `ERROR simsearch: unexpected failure` and a
    BrokenPipeError traceback. The reader here is gone before the command writes a byte."""
    server, _ = served
    read, write = os.pipe()
    os.close(read)
    try:
        proc = command(server, "info", stdout=write)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (CLOSED_PIPE_EXIT, "")


def test_a_long_phrase_is_quoted_by_its_first_80_characters(served):
    """A 5,000-character --text came back whole in the error line."""
    server, _ = served
    phrase = "a red bicycle " * 400  # 5,600 characters, past the server's MAX_TEXT_CHARS
    proc = command(server, "query", "--text", phrase)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: 1 of 1 queries failed — text {phrase[:80]!r}… (5,600 characters): server answered "
        f"INVALID_ARGUMENT: text is 5600 characters; at most {MAX_TEXT_CHARS}"
    )


def test_an_image_with_words_says_which_fields_were_set_and_how_to_combine_them(served):
    """`{"image": …, "text": …}` was answered `body is not a SearchRequest in proto3 JSON: Message
    type "simsearch.v1.SearchRequest" should not have multiple "query" oneof fields at
    "SearchRequest".`; the parts it points to answer."""
    server, root = served
    image = base64.b64encode(next((root.parent / "images").glob("*.png")).read_bytes()).decode()
    url = f"http://127.0.0.1:{server.http_port}/v1/search"
    both = requests.post(url, json={"image": image, "text": "red", "k": 3}, timeout=60)
    assert both.status_code == 400
    assert both.json()["error"] == {
        "code": "INVALID_ARGUMENT",
        "message": "image and text are both set: a SearchRequest takes one query (image, embedding, itemId or "
        'text); to combine them (an image with words, say), send each as one of parts: {"parts": [{"image": …}, '
        '{"text": …}]}',
    }
    batch = requests.post(
        f"{url}-batch", json={"requests": [{"itemId": "img-0000"}, {"itemId": "img-0001", "text": "red"}]}, timeout=60
    )
    assert batch.status_code == 400
    assert batch.json()["error"]["message"].startswith(
        "requests[1]: itemId and text are both set: a SearchRequest takes one query"
    )
    in_a_part = requests.post(url, json={"parts": [{"image": image, "text": "red"}]}, timeout=60)
    assert in_a_part.json()["error"]["message"] == (
        "parts[0]: image and text are both set: a QueryPart takes one query (image, embedding, itemId or text); "
        "send each as a part of its own"
    )
    combined = requests.post(url, json={"parts": [{"image": image}, {"text": "red"}], "k": 3}, timeout=60)
    assert combined.status_code == 200, combined.text
    assert combined.json()["neighbors"]
