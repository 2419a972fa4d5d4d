"""`python -m serving query` and `info` as a user runs them, against a real server: every query
kind and option a request has, a failing query named without losing the others' answers, and
every mistake one `error:` line naming what was wrong."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from core.data.catalog import read_catalog
from index.build.build import run_build
from index.build.config import BuildConfig
from serving.__main__ import target_address
from serving.client import SearchClient
from serving.config import ServerConfig
from tests.support.server import SearchServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(demo_run, tmp_path_factory):
    """A Flat version of the demo's test split with `label` filterable, behind a real server."""
    root = tmp_path_factory.mktemp("query-cli")
    run_build(
        BuildConfig(
            model=str(demo_run / "model"),
            index_root=str(root),
            catalog=str(demo_run / "train" / "splits" / "test.csv"),
            filterable=["label"],
        ),
        progress=False,
    )
    server = SearchServer(ServerConfig.flat(index_root=str(root), port=0, metrics_port=None, probe_interval_s=0))
    server.start()
    yield server, read_catalog(demo_run / "train" / "splits" / "test.csv")
    server.stop(grace=1)


def query(server, *args: str, command: str = "query") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serving", command, "--target", f"127.0.0.1:{server.port}", "--timeout", "60", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_a_failing_query_is_named_and_the_others_still_answered(server, tmp_path):
    server, catalog = server
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image at all")
    good = str(catalog.paths[0])
    proc = query(server, good, str(tmp_path), str(garbage), str(tmp_path / "missing.png"), "--json")
    last = error_line(proc)
    assert last.startswith("error: 3 of 4 queries failed"), last
    assert f"{tmp_path}: cannot read: Is a directory" in last
    assert f"{garbage}: server answered INVALID_ARGUMENT: cannot decode image" in last
    assert f"{tmp_path / 'missing.png'}: cannot read: No such file or directory" in last
    answers = {a["query"]: a for a in json.loads(proc.stdout)}
    assert len(answers[good]["neighbors"]) == 10  # the good image's answer was kept
    assert "error" in answers[str(tmp_path)] and "error" in answers[str(garbage)]


def test_item_id_exclusions_filter_and_label_reach_the_server(server):
    server, catalog = server
    item, label = catalog.ids[0], catalog.labels[0]
    plain = json.loads(query(server, "--item-id", item, "--k", "5", "--json").stdout)[0]
    ids = [n["id"] for n in plain["neighbors"]]
    assert len(ids) == 5 and item not in ids
    excluded = json.loads(query(server, "--item-id", item, "--k", "5", "--exclude-id", ids[0], "--json").stdout)[0]
    assert [n["id"] for n in excluded["neighbors"]] == ids[1:] + [excluded["neighbors"][-1]["id"]]
    other = next(lab for lab in catalog.labels if lab != label)
    a_filter = json.dumps({"must": [{"field": "label", "value": other}]})
    filtered = json.loads(query(server, "--item-id", item, "--filter", a_filter, "--json").stdout)[0]
    assert len(filtered["neighbors"]) == 10 and {n["label"] for n in filtered["neighbors"]} == {other}

    before = len(server.monitor.traffic)
    assert query(server, str(catalog.paths[0]), "--label", label).returncode == 0
    assert len(server.monitor.traffic) == before + 1  # scored into the traffic Recall@K


def test_an_answer_grouped_by_label_shows_the_label_once(server):
    """A folder per class gives the field `label`: grouped by it, the group column is the label,
    and the table had a second `label` column beside it (issue 47)."""
    server, catalog = server
    proc = query(server, str(catalog.paths[0]), "--k", "3", "--group-by", "label")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "grouped by label, 1 per group" in lines[0]
    assert lines[1].split() == ["rank", "score", "label", "id"]
    rows = [line.split() for line in lines[2:5]]
    assert rows[0][2] == catalog.labels[0] and len({row[2] for row in rows}) == 3  # a label a row
    assert all(len(row) == 4 for row in rows)


def test_mistakes_are_one_line_naming_the_flag(server):
    server, catalog = server
    proc = query(server, str(catalog.paths[0]), "--k", "10000000000")
    assert proc.returncode == 2 and "argument --k: must be within 0..2147483647" in proc.stderr
    assert "--filter is not a filter in proto3 JSON" in error_line(query(server, "--item-id", "x", "--filter", "{"))
    assert "nothing to search with" in error_line(query(server))
    assert "--k must be at least 1" in error_line(query(server, "--item-id", "x", "--k", "0"))


def test_an_unreachable_server_gets_a_hint(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "serving", "info", "--target", f"127.0.0.1:{port}", "--timeout", "5"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert error_line(proc).startswith(f"error: cannot reach the server at 127.0.0.1:{port} — is it running there?")


def test_info_prints_counts_as_json_numbers(server):
    server, _ = server
    proc = query(server, command="info")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert isinstance(info["indexSize"], int) and info["indexSize"] > 0  # int64 would be a string
    assert isinstance(info["limits"]["maxImagePixels"], int)


def test_scores_never_leave_the_cosine_range(server):
    server, catalog = server
    with SearchClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        for item in catalog.ids[:50]:
            answer = client.search_item(item, k=3)
            version = server.engine.pair.index_version
            vector = client.search_embedding(version.vector(version.row_of(item)).tolist(), k=1)
            assert all(-1.0 <= n.score <= 1.0 for n in [*answer.neighbors, *vector.neighbors])
            assert vector.neighbors[0].id == item


@pytest.mark.parametrize(
    ("given", "address"),
    [
        ("localhost", "localhost:50051"),
        ("localhost:7000", "localhost:7000"),
        ("10.0.0.2", "10.0.0.2:50051"),
        ("[::1]", "[::1]:50051"),
        ("[::1]:7000", "[::1]:7000"),
        ("::1", "[::1]:50051"),
        ("dns:///search.internal:443", "dns:///search.internal:443"),
        ("unix:/run/simsearch.sock", "unix:/run/simsearch.sock"),
    ],
)
def test_a_target_without_a_port_goes_to_the_servers_default(given, address):
    assert target_address(given) == address


@pytest.fixture(scope="module")
def catalog_server(tmp_path_factory):
    """A tiny index whose rows name their item (`item`: grouped by default) behind a real server."""
    import numpy as np
    from PIL import Image

    from tests.support.index import SIDE, write_tiny_model

    tmp = tmp_path_factory.mktemp("query-cli-items")
    (tmp / "images").mkdir()
    paths = []
    for n in range(12):  # four items of three photos: an item's own pattern, a little noise each
        base = np.random.default_rng(n // 3).integers(0, 256, (SIDE, SIDE, 3))
        noise = np.random.default_rng(100 + n).integers(-8, 9, (SIDE, SIDE, 3))
        paths.append(tmp / "images" / f"img-{n:04d}.png")
        Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(paths[-1])
    lines = ["id,path,item"] + [f"{p.stem},{p.name},it{n // 3}" for n, p in enumerate(paths)]
    (tmp / "images" / "catalog.csv").write_text("\n".join(lines) + "\n")
    run_build(
        BuildConfig(
            model=str(write_tiny_model(tmp / "model")),
            index_root=str(tmp / "index"),
            catalog=str(tmp / "images" / "catalog.csv"),
            min_ann_recall=0,
        ),
        progress=False,
    )
    server = SearchServer(
        ServerConfig.flat(index_root=str(tmp / "index"), port=0, metrics_port=None, probe_interval_s=0)
    )
    server.start()
    yield server, paths
    server.stop(grace=1)


def test_grouped_answers_show_their_group_and_grouping_is_a_flag(catalog_server):
    server, paths = catalog_server
    grouped = query(server, str(paths[0]), "--k", "3")
    assert grouped.returncode == 0, grouped.stderr
    lines = grouped.stdout.splitlines()
    assert "grouped by item, 1 per group" in lines[0]
    assert lines[1].split() == ["rank", "score", "item", "label", "id"]
    assert [line.split()[2] for line in lines[2:5]] == ["it0", *[line.split()[2] for line in lines[3:5]]]
    assert len({line.split()[2] for line in lines[2:5]}) == 3  # three items, one row each

    two = json.loads(query(server, str(paths[0]), "--k", "2", "--per-group", "3", "--json").stdout)[0]
    assert two["groupBy"] == "item" and [n["group"] for n in two["neighbors"]][:3] == ["it0"] * 3
    assert len(two["neighbors"]) == 6
    plain = query(server, str(paths[0]), "--k", "3", "--group-by", "")
    assert plain.returncode == 0, plain.stderr
    assert "grouped" not in plain.stdout and plain.stdout.splitlines()[1].split() == ["rank", "score", "label", "id"]
    assert sorted(line.split()[-1] for line in plain.stdout.splitlines()[2:5]) == ["img-0000", "img-0001", "img-0002"]
    assert "--per-group must be at least 1" in error_line(query(server, str(paths[0]), "--per-group", "0"))
    assert "group_by: 'colour' is not a declared field" in error_line(
        query(server, str(paths[0]), "--group-by", "colour")
    )
