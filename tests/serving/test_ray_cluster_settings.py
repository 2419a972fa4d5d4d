"""A local Ray that `serve --ray` starts runs with the serving cluster's settings (issue 59): its
GCS keeps a bounded table of task events, its workers run at normal priority — and an operator's
own value of each wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving.ray_serve.cluster import SERVING_CLUSTER_ENV

ROOT = Path(__file__).resolve().parents[2]

SETTINGS_OF_A_LOCAL_SERVING_CLUSTER = """
import json

import psutil
import ray

from serving.ray_serve.cluster import connect_ray

connect_ray()
found = {}
for process in psutil.Process().children(recursive=True):
    if process.name() in ("gcs_server", "raylet"):
        found[process.name()] = {k: v for k, v in process.environ().items() if k.startswith("RAY_")}
print(json.dumps(found), flush=True)
ray.shutdown()
"""


def settings(**env: str) -> dict[str, dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in SERVING_CLUSTER_ENV}
    done = subprocess.run(
        [sys.executable, "-c", SETTINGS_OF_A_LOCAL_SERVING_CLUSTER],
        cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_local_serving_cluster_bounds_the_gcs_task_events_and_the_operator_wins():
    ours = settings()
    assert set(ours) == {"gcs_server", "raylet"}
    for process in ours.values():
        for name, value in SERVING_CLUSTER_ENV.items():
            assert process.get(name) == value, (name, process)
    assert int(SERVING_CLUSTER_ENV["RAY_task_events_max_num_task_in_gcs"]) > 0  # bounded, not unlimited (-1)
    theirs = settings(RAY_task_events_max_num_task_in_gcs="5000")
    assert theirs["gcs_server"]["RAY_task_events_max_num_task_in_gcs"] == "5000"
