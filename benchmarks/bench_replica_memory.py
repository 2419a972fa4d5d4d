"""Memory of every `serve --ray` process, a replica at a time (issue 47; docs/operations.md,
"Memory a replica"): S shards of ROWS × DIM Flat rows with a tiny model, one replica a shard,
after QUERIES queries and again 70 s after a reload to a second version, beside an empty Serve
replica (Ray's own floor) on the same cluster. Prints one JSON line of MB by deployment.

    python -m benchmarks.bench_replica_memory [--rows 200000] [--dim 128] [--shards 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from core.cli import init_ray
from protos.simsearch.v1 import search_pb2 as pb
from serving.client import SearchClient
from tests.support import shards as support


def replica_memory_mb() -> dict[str, int]:
    """Resident MB of every Serve replica of this cluster, by deployment (summed over replicas)."""
    import ray

    found: dict[str, int] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if not name.startswith("SERVE_REPLICA::"):
            continue
        handle = ray.get_actor(name, namespace="serve")
        pid = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        kb = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
        deployment = name.split("#")[1]
        found[deployment] = found.get(deployment, 0) + kb // 1024
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args(argv)
    import ray
    from ray import serve

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        init_ray(log_to_driver=False, num_cpus=2)
        model = support.model(out / "model", args.dim)
        data = support.catalog(args.rows, args.dim, max(1, args.rows // 10))
        root = out / "root"
        support.publish(root, data, model, args.shards)
        support.publish(root, data, model, args.shards)  # a second version, to reload to
        ray.shutdown()
        init_ray(log_to_driver=False, num_cpus=2)  # fresh workers: none ran the build's tasks
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        command = [
            sys.executable, "-m", "serving", "serve", "--ray", "--index-root", str(root), "--port", "0",
            "--metrics-port", "none", "--probe-interval-s", "0", "--admin-token", "t",
        ]  # fmt: skip
        server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            ports = json.loads(server.stdout.readline())
            client = SearchClient(f"127.0.0.1:{ports['port']}", timeout=60, admin_token="t")
            client.wait_ready(120)
            rng = np.random.default_rng(0)

            def load(count: int) -> None:
                for vector in rng.standard_normal((count, args.dim)).astype(np.float32):
                    client.search(pb.SearchRequest(embedding=pb.Embedding(values=vector.tolist()), k=10, group_by=""))

            load(args.queries)
            queried = replica_memory_mb()
            live = client.get_info().index_version
            other = next(p.name for p in (root / "versions").iterdir() if p.name != live)
            client.reload(other)
            load(args.queries)
            time.sleep(70)
            load(50)
            reloaded = replica_memory_mb()
        finally:
            server.terminate()
            server.wait(60)

        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class Empty:
            def __call__(self) -> int:
                return 1

        serve.run(Empty.bind(), name="floor", route_prefix=None).remote().result()
        floor = replica_memory_mb()
        ray.shutdown()
    print(json.dumps({"after_queries_mb": queried, "after_reload_mb": reloaded, "empty_replica_mb": floor["Empty"]}))


if __name__ == "__main__":
    main()
