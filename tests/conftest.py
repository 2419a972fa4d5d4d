"""Shared fixtures: one real chain (Ray Train → ONNX → faiss) on a slice of the glyph set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Ray starts its workers at nice 15: beside any other busy process (a second test session, a
# CPU hog) they get a few percent of a core, and the two-minute training chain takes an hour.
# Every Ray run the tests start (the demo chain, training runs) inherits this: a fair share.
os.environ.setdefault("RAY_worker_niceness", "0")
# The code under test is this checkout's, in every process the tests start: Ray's workers and the
# commands run as subprocesses import the project by path, not through the venv's editable install
# (which names one checkout — another worktree's, on a machine with several).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# A slice big enough that training must beat the untrained network on unseen classes.
SLICE = ["--max-classes", "40", "--max-per-class", "40", "--epochs", "4", "--classes-per-batch", "10"]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """Run `python -m scripts.demo` (every stage as its own command, served over gRPC) on a slice."""
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.demo", "--out", str(out), *SLICE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,  # a bound on a hang: the chain takes ~2 min alone, several on a busy machine
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads((out / "report.json").read_text())
    (out / "terminal.txt").write_text(proc.stdout + proc.stderr)  # what a person running it saw
    return out


@pytest.fixture(scope="session")
def served(demo_run):
    """A real SearchServer on a loopback port over the demo's model and index."""
    from serving.client import SearchClient
    from serving.config import ServerConfig
    from tests.support.server import SearchServer

    server = SearchServer(
        ServerConfig.flat(
            index_root=str(demo_run / "index"),
            port=0,
            metrics_port=None,
            admin_token="s3cret",
            max_k=50,
            max_image_pixels=1_000_000,
            max_message_bytes=2 * 1024 * 1024,
            probe_interval_s=0,  # no probe rounds competing with the tests' queries
        )
    )
    server.start()
    # A deadline that ends a hung call, not one that times a healthy call on a busy machine.
    client = SearchClient(f"127.0.0.1:{server.port}", timeout=60.0, admin_token="s3cret")
    client.wait_ready(60)
    yield server, client
    client.close()
    server.stop(grace=1)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray (2 CPUs) for a module whose builds or deployments join it through
    core.cli.init_ray; a module asks for it with `pytestmark = pytest.mark.usefixtures("local_ray")`."""
    import ray

    from core.cli import init_ray

    init_ray(log_to_driver=False, num_cpus=2)
    yield ray.get_runtime_context().gcs_address  # what a command joins it by (RAY_ADDRESS)
    ray.shutdown()
