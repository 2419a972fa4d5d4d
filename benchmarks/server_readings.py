"""What a running server says of itself, for benchmarks that watch one under load: its /metrics
(Recall@K by source and each one's sample size, the stages' counts) and the resident memory of
every process that serves (a `serve --ray`'s Ray actors included)."""

from __future__ import annotations

import contextlib
import re
import urllib.request

import psutil

K = 10

METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")


def parse_metrics(text: str, names: set[str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, sorted labels) → value of every sample of the metrics in `names`."""
    out = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m and m.group(1) in names:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


RECALL_METRICS = {"simsearch_recall_at_k", "simsearch_recall_samples", "simsearch_ann_recall_at_k",
                  "simsearch_index_size", "simsearch_stage_latency_seconds_count"}  # fmt: skip


def recall_figures(metrics: dict, k: int = K) -> dict:
    """Recall@k by source (probe, traffic, ann) and each one's sample size; None where absent."""
    key = str(k)
    out = {}
    for source in ("probe", "traffic"):
        labels = (("k", key), ("source", source))
        out[source] = metrics.get(("simsearch_recall_at_k", labels))
        out[f"{source}_n"] = metrics.get(("simsearch_recall_samples", labels))
    out["ann"] = metrics.get(("simsearch_ann_recall_at_k", (("k", key),)))
    out["ann_n"] = metrics.get(("simsearch_recall_samples", (("k", key), ("source", "ann"))))
    out["index_size"] = metrics.get(("simsearch_index_size", ()))
    # Queries embedded: the probe's, the only image queries here (the callers send embeddings) —
    # whether probe rounds still run, as the probe gauge keeps its last round's value. (Not the
    # decode stage: serve --ray decodes on its embedder replicas, and the ingress times no decode.)
    for stage in ("decode", "embed"):
        counts = [v for (name, labels), v in metrics.items()
                  if name == "simsearch_stage_latency_seconds_count" and ("stage", stage) in labels]  # fmt: skip
        out[f"{stage}_count"] = sum(counts) if counts else None
    return out


def scrape(metrics_port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return recall_figures(parse_metrics(text, RECALL_METRICS))


def process_label(proc: psutil.Process) -> str:
    """A process's name in the tables: a Ray actor's title (`ray::ServeReplica:app:Shard`) less
    the method it is running (Ray retitles an actor's process for each call:
    `ray::ServeController.listen_for_change`), else its command's module (`-m serving`) or name."""
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0].split(".")[0]
    if "-m" in cmd and cmd.index("-m") + 1 < len(cmd):
        return " ".join(cmd[cmd.index("-m") + 1 : cmd.index("-m") + 3])
    return proc.name()


def serving_processes(server: int, ray: bool) -> list[psutil.Process]:
    """The server and its children; with `ray`, this process's descendants that are Ray actors
    (the local Ray's workers hosting Serve's replicas, controller and proxy), idle ones aside."""
    procs = []
    with contextlib.suppress(psutil.NoSuchProcess):
        top = psutil.Process(server)
        procs = [top, *top.children(recursive=True)]
    if ray:
        seen = {p.pid for p in procs}
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = p.cmdline()
                if p.pid not in seen and cmd and cmd[0].startswith("ray::") and not cmd[0].startswith("ray::IDLE"):
                    procs.append(p)
    return procs


def memory(server: int, ray: bool) -> dict[str, float]:
    """Resident MiB of each serving process, by `label pid`."""
    out = {}
    for p in serving_processes(server, ray):
        with contextlib.suppress(psutil.Error):
            out[f"{process_label(p)} {p.pid}"] = p.memory_info().rss / 2**20
    return out
