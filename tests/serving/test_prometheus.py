"""Alert and recording rules checked by promtool and evaluated by a real Prometheus scraping a
real search server under a little traffic."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from core.artifacts import layout as artifacts
from core.data.items import ItemTable
from serving.client import SearchClient
from serving.config import ServerConfig
from tests.support.dashboards import SERVER_DASHBOARDS
from tests.support.server import SearchServer

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
needs_prometheus = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="Debian package prometheus not installed"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_prometheus
@pytest.mark.parametrize(
    "args",
    [["check", "config", "prometheus.yml"], ["check", "rules", "rules.yml"], ["test", "rules", "rules_test.yml"]],
)
def test_promtool_accepts_the_shipped_files(args):
    proc = subprocess.run(["promtool", *args], cwd=PROM, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def rule_expressions() -> list[tuple[str, str]]:
    groups = yaml.safe_load((PROM / "rules.yml").read_text())["groups"]
    return [(rule.get("record") or rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    return json.loads(urllib.request.urlopen(url, timeout=60).read())


def query_range(port: int, expr: str, start: float, end: float) -> dict:
    """`expr` evaluated every second from `start` to `end` (Unix seconds)."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
    url = f"http://127.0.0.1:{port}/api/v1/query_range?" + urllib.parse.urlencode(params)
    return json.loads(urllib.request.urlopen(url, timeout=60).read())


def start_prometheus(tmp_path: Path, port: int, target_port: int, rules: bool = False) -> subprocess.Popen:
    """A real Prometheus on loopback scraping one target every second (with the shipped rules)."""
    config = tmp_path / "prometheus.yml"
    settings: dict = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "target", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
    }
    if rules:
        shutil.copy(PROM / "rules.yml", tmp_path / "rules.yml")
        settings["rule_files"] = ["rules.yml"]
    config.write_text(yaml.safe_dump(settings))
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=10)
            return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("Prometheus did not become ready in 120 s")


@needs_prometheus
@pytest.mark.slow
def test_every_rule_runs_against_real_metrics(demo_run, tmp_path):
    metrics_port, prom_port = free_port(), free_port()
    server = SearchServer(
        ServerConfig.flat(
            index_root=str(demo_run / "index"),
            port=0,
            metrics_port=metrics_port,
            ann_sample_rate=1.0,
            probe_size=50,
            probe_interval_s=0,  # the one probe round the rules need runs below, not on a schedule
        )
    )
    server.start()
    prometheus = start_prometheus(tmp_path, prom_port, metrics_port, rules=True)
    try:
        assert server.monitor.run_probe(server.run_probe)  # source="probe" for the probe alerts
        items = ItemTable.read(artifacts.version_dir(demo_run / "index") / "items.parquet")
        with SearchClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            client.wait_ready(60)
            for round_ in range(8):  # traffic spread over several scrapes, so rate() has points
                for i in range(round_ * 10, round_ * 10 + 10):
                    r = client.search_image(
                        Path(items.paths[i]).read_bytes(), k=10, exclude_ids=[items.ids[i]], label=items.labels[i]
                    )
                    client.feedback(r.request_id, [n.id for n in r.neighbors if n.label == items.labels[i]])
                try:
                    client.search_item("no-such-item", k=3)
                except Exception:  # noqa: BLE001 - an error on purpose, for the error-ratio rule
                    pass
                time.sleep(1.0)
        deadline = time.time() + 120  # a bound on a hang: Prometheus scrapes every second
        names = set()
        for _, expr in rule_expressions():
            names |= set(re.findall(r"\b((?:simsearch|process)_[a-z_]+)", expr))  # process_*: the process collector
        while time.time() < deadline:
            missing = [n for n in names if not query(prom_port, n)["data"]["result"]]
            if not missing:
                break
            time.sleep(1)
        assert not missing, f"metrics named in the rules but never scraped: {missing}"
        for name, expr in rule_expressions():
            answer = query(prom_port, expr)
            assert answer["status"] == "success", (name, answer)
        from tests.support.dashboards import dashboard_expressions

        for title, expr in dashboard_expressions(SERVER_DASHBOARDS):  # every panel shows data, no typo'd name
            if "simsearch_shard_" in expr:  # a sharded server's panels: tests/serving/test_ray_serve.py's
                continue
            concrete = expr.replace("$instance", ".+").replace("$k", "1")
            deadline = time.time() + 120
            while not query(prom_port, concrete)["data"]["result"] and time.time() < deadline:
                time.sleep(1)
            assert query(prom_port, concrete)["data"]["result"], f"panel {title!r} is empty: {concrete}"
        for name, _ in rule_expressions():
            if ":" in name:  # recording rules must produce series from the real metrics
                deadline = time.time() + 120
                while not query(prom_port, name)["data"]["result"] and time.time() < deadline:
                    time.sleep(1)
                assert query(prom_port, name)["data"]["result"], f"recording rule {name} produced nothing"
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        server.stop(0)


@needs_prometheus
@pytest.mark.slow
def test_training_dashboard_shows_a_real_ray_training_run(tmp_path):
    """Ray Train's loop exports its gauges through Ray's metrics agent; every Training panel
    must show data from a real run scraped by a real Prometheus."""
    import os

    ray_port, prom_port = free_port(), free_port()
    prometheus = start_prometheus(tmp_path, prom_port, ray_port)
    env = {**os.environ, "RAY_metrics_report_interval_ms": "1000"}  # export every second, not every 10
    from tests.support.training import TINY, output_of, start_training

    # Eight epochs of the tiny run: long enough for several scrapes after the first epoch.
    began = time.time()
    training = start_training(
        tmp_path / "run", "--epochs", "8", "--metrics-export-port", str(ray_port), base=TINY, env=env
    )
    from tests.support.dashboards import dashboard_expressions

    panels = dashboard_expressions(("training.json",))
    assert panels
    shown: set[str] = set()
    runs: set[str] = set()
    try:
        while training.poll() is None and len(shown) < len(panels):
            for title, expr in panels:
                concrete = expr.replace("$instance", ".+").replace("$k", "1")
                result = query(prom_port, concrete)["data"]["result"]
                if result:
                    shown.add(title)
                    runs |= {r["metric"].get("run") for r in result}
            time.sleep(0.5)
        training.wait(timeout=600)
        assert training.returncode == 0, output_of(training)
        # A panel this loop did not catch while the run lasted (its series go stale once the
        # run ends) is looked up over the whole run: whether it showed data, not how soon.
        for title, expr in panels:
            if title not in shown:
                concrete = expr.replace("$instance", ".+").replace("$k", "1")
                result = query_range(prom_port, concrete, began, time.time())["data"]["result"]
                if result:
                    shown.add(title)
                    runs |= {r["metric"].get("run") for r in result}
        missing = sorted({title for title, _ in panels} - shown)
        assert not missing, f"Training panels that never showed data: {missing}"
        assert runs == {"run"}  # every series labelled with the run's name
    finally:
        if training.poll() is None:
            training.kill()
        prometheus.terminate()
        prometheus.wait(timeout=30)
