"""Deploy files that must work as written: images, compose stack, Kubernetes and KubeRay manifests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_copy_existing_files_and_run_unprivileged(dockerfile):
    steps = instructions(dockerfile)
    for op, arg in steps:
        if op == "COPY":
            *sources, _ = arg.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{dockerfile.name} must end as a non-root user"
    if dockerfile.name.startswith("serving"):
        assert any(op == "HEALTHCHECK" and "deploy/healthcheck.py" in arg for op, arg in steps)
        exposed = " ".join(arg for op, arg in steps if op == "EXPOSE").split()
        assert {"50051", "9100"} <= set(exposed)
        installs = " ".join(arg for op, arg in steps if op == "RUN")
        assert "torch" not in installs and "[train]" not in installs, "the serving image must carry no torch"


def test_healthcheck_script_against_a_real_server(served):
    server, _ = served
    ok = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), f"127.0.0.1:{server.port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    down = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), f"127.0.0.1:{closed}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert down.returncode == 1 and "unhealthy" in down.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian package docker-compose not installed")
def test_compose_file_is_valid_and_references_existing_files(tmp_path):
    proc = subprocess.run(
        ["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./"):
                assert (DEPLOY / host).exists(), f"{name}: {host} missing"
            else:
                assert host.startswith("../runs"), f"{name}: undocumented host path {host}"  # made by make demo
    assert set(compose["services"]) == {"simsearch", "ray-head", "prometheus", "grafana"}
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"simsearch:9100", "ray-head:8080"}  # the compose services and their metrics ports


def k8s_documents() -> list[dict]:
    return [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]


def test_kubernetes_manifests_validate_against_the_schemas():
    standard = [p for p in sorted((DEPLOY / "k8s").glob("*.yaml")) if not p.name.startswith(("rayjob", "rayservice"))]
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", *map(str, standard)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = {doc["kind"] for doc in k8s_documents()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "RayJob", "CronJob"} <= kinds
    assert "RayService" in kinds


def test_manifests_reference_what_exists():
    docs = k8s_documents()
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    text = "\n".join(p.read_text() for p in (DEPLOY / "k8s").glob("*.yaml"))
    for claim in re.findall(r"claimName: ([\w-]+)", text):
        assert claim in claims, f"PVC {claim} is not defined"
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"]["port"] == 50051 == container["livenessProbe"]["grpc"]["port"]
    for job in (d for d in docs if d["kind"] == "RayJob"):  # no schema for the CRD here: check its shape
        spec = job["spec"]
        assert job["apiVersion"] == "ray.io/v1"
        assert spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
        assert spec["rayClusterSpec"]["workerGroupSpecs"]
        for module, command in re.findall(r"python -m (\w+) (\w+)", spec["entrypoint"]):
            help_text = subprocess.run(
                [sys.executable, "-m", module, command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
            )
            assert help_text.returncode == 0, f"RayJob runs unknown command {module} {command}"
            for flag in re.findall(r"(--[\w-]+)", spec["entrypoint"].split(f"-m {module} {command}")[1].split("&&")[0]):
                assert flag in help_text.stdout, f"{module} {command} has no flag {flag}"


def test_the_rayservice_deploys_what_serve_ray_deploys():
    """No schema for the CRD here: its shape, the application builder it imports, options
    `serve` takes, one shard replica a node (each shard asks for a slot the shard workers offer)."""
    import importlib

    from core.config import options
    from serving.config import ServerConfig

    service = next(d for d in k8s_documents() if d["kind"] == "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    module, attribute = application["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attribute))
    known = {opt.name for opt in options(ServerConfig)}
    assert set(application["args"]) <= known, set(application["args"]) - known
    assert ServerConfig.flat(ray=True, **application["args"]).sharding.ray
    deployments = {d["name"]: d for d in application["deployments"]}
    shards = sorted(name for name in deployments if name.startswith("shard-"))
    assert shards == [f"shard-{n:03d}" for n in range(len(shards))] and {"ingress", "embedder"} <= set(deployments)
    for name in shards:
        assert deployments[name]["ray_actor_options"]["resources"] == {"shard_slot": 1}
    cluster = service["spec"]["rayClusterConfig"]
    offered = [g for g in cluster["workerGroupSpecs"] if "shard_slot" in g["rayStartParams"].get("resources", "")]
    assert offered and json.loads(json.loads(offered[0]["rayStartParams"]["resources"])) == {"shard_slot": 1}
    assert offered[0]["minReplicas"] >= len(shards)
    # The head (where the GCS runs) starts with the settings `serve --ray` gives a local cluster.
    from serving.ray_serve.cluster import SERVING_CLUSTER_ENV

    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    head_env = {e["name"]: e.get("value") for e in head["env"]}
    assert {name: head_env.get(name) for name in SERVING_CLUSTER_ENV} == SERVING_CLUSTER_ENV
    claims = {d["metadata"]["name"] for d in k8s_documents() if d["kind"] == "PersistentVolumeClaim"}
    assert "simsearch-artifacts" in claims
