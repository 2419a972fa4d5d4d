"""What a soak samples and how it judges it (`benchmarks.soak`): which process under the soak is
which, each one's RSS and open file descriptors every few seconds, and its growth from the start
to the end of the run.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import psutil

from serving.listen import WORKER_ENV

SERVING = ("serve", "serve --ray", "ingress", "embedder")  # and shard-NNN, worker-N: the processes judged
# Ray's own processes that live as long as the cluster: judged on their growth like the serving
# ones (a cluster that serves for weeks must not grow in them either), not on being replaced.
RAY_SYSTEM = (
    "gcs_server", "raylet", "dashboard", "dashboard agent", "runtime env agent", "log monitor", "autoscaler monitor",
    "ServeController", "log queue",
)  # fmt: skip
# Ray's processes that are Python scripts, by the script's path under the ray package.
RAY_SCRIPTS = {
    "dashboard/agent.py": "dashboard agent",
    "runtime_env/agent/main.py": "runtime env agent",
    "_private/log_monitor.py": "log monitor",
    "autoscaler/_private/monitor.py": "autoscaler monitor",
    "_private/ray_process_reaper.py": "reaper",
    "dashboard/dashboard.py": "dashboard",
}
# Ray's actor classes named apart from the label of the script that runs them.
RAY_ACTORS = {"DashboardAgent": "dashboard agent", "RuntimeEnvAgent": "runtime env agent", "_QueueActor": "log queue"}


def serving_process(label: str) -> bool:
    return label in SERVING or label.startswith(("shard-", "worker-"))


def judged_kind(label: str) -> str:
    """ "serving" (judged on growth and on living through the run), "ray" (Ray's long-lived
    processes, judged on growth) or "other" (workers that come and go, the reaper: reported)."""
    if serving_process(label):
        return "serving"
    return "ray" if label in RAY_SYSTEM else "other"


def process_label(process: psutil.Process, server_pid: int, ray: bool) -> str | None:
    """What a process under this one is: the server (`serve`, or the `serve --ray` command), a
    worker of `serve --processes N` by its index (worker-0, …: its environment names it), a
    Serve replica by its deployment (its title `ray::ServeReplica:simsearch:shard-000`, a
    method's name after a dot while it runs one), another Ray actor by its class (the Serve
    controller, the log queue), an idle Ray worker, the raylet, the GCS, Ray's agents and
    monitors by their script; None for what is not Ray's or the server's (a compiler a package
    spawns)."""
    if process.pid == server_pid:
        return "serve --ray" if ray else "serve"
    if not ray:  # the supervisor's children
        slot = process.environ().get(WORKER_ENV)  # "I/N"
        return f"worker-{slot.partition('/')[0]}" if slot else None
    title = process.cmdline()
    if not title:
        return None
    if title[0].startswith("ray::"):
        name = title[0][len("ray::") :].split(".", 1)[0].split(" ", 1)[0]
        if name.startswith("ServeReplica:"):
            return name.rsplit(":", 1)[-1]
        return "idle worker" if name in ("", "IDLE") else RAY_ACTORS.get(name, name)
    name = os.path.basename(title[0])
    if name in ("raylet", "gcs_server"):
        return name
    for arg in title[1:4]:
        for script, label in RAY_SCRIPTS.items():
            if arg.endswith("ray/" + script):
                return label
    return None


class Sampler(threading.Thread):
    """Every `every_s` seconds, the RSS (MB) and open file descriptors of the server and — with
    `ray` — of every Ray process under this one that `process_label` names, or — with `workers` —
    of the server's children, its worker processes: a series for each (label, pid), so a replica
    replaced by another process is two series."""

    def __init__(self, server_pid: int, every_s: float, ray: bool = False, workers: bool = False) -> None:
        super().__init__(daemon=True)
        self.server_pid = server_pid
        self.ray = ray
        self.workers = workers
        self.every_s = every_s
        self.series: dict[tuple[str, int], list[tuple[float, float, int]]] = {}  # (minutes, RSS MB, fds)
        self.ticks: list[float] = []  # the minutes of each round of samples
        self.stopped = threading.Event()
        self._labels: dict[int, str | None] = {}

    def processes(self) -> list[tuple[str, psutil.Process]]:
        found = [psutil.Process(self.server_pid)]
        if self.ray:
            found += psutil.Process().children(recursive=True)
        elif self.workers:
            found += found[0].children()
        out = []
        for process in found:
            try:
                if process.pid not in self._labels:
                    self._labels[process.pid] = process_label(process, self.server_pid, self.ray)
                label = self._labels[process.pid]
            except psutil.Error:
                continue
            if label is not None:
                out.append((label, process))
        return out

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.is_set():
            now = (time.monotonic() - started) / 60
            for label, process in self.processes():
                try:
                    rss, fds = process.memory_info().rss / 2**20, process.num_fds()
                except psutil.Error:
                    continue
                self.series.setdefault((label, process.pid), []).append((now, rss, fds))
            self.ticks.append(now)
            self.stopped.wait(self.every_s)

    def of(self, label: str) -> list[tuple[float, float, int]]:
        """The samples of the first process that had `label`."""
        return next((rows for (name, _), rows in self.series.items() if name == label), [])


def memory_by_process(sampler: Sampler, warmup_min: float, max_growth_mb: float = 8.0) -> list[dict]:
    """Each sampled process's RSS at the start — the median of its samples in the first third of
    what follows `warmup_min` — and at the end — the median of the last third's — and the growth
    between; the growth it is allowed: `max_growth_mb`, or twice the growth's standard error where
    the process's own swing makes that larger (1.25 s/√n a median, s the samples' spread in each
    third: a process whose RSS swings by tens of MB under load moves its medians by more than a
    few MB with no leak); judged when at least 3 minutes follow the warm-up; whether the process
    lived through the whole run."""
    last = sampler.ticks[-1] if sampler.ticks else 0.0
    span = last - warmup_min
    third = max(span / 3, 1e-9)
    out = []
    for (label, pid), rows in sorted(sampler.series.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        start = np.array([rss for t, rss, _ in rows if warmup_min <= t < warmup_min + third])
        end = np.array([rss for t, rss, _ in rows if t >= last - third])
        out.append({
            "process": label, "pid": pid, "serving": serving_process(label), "kind": judged_kind(label),
            "first_min": rows[0][0], "last_min": rows[-1][0],
            "whole_run": rows[0][0] == sampler.ticks[0] and rows[-1][0] == last,
            "start_mb": float(np.median(start)) if len(start) else None,
            "end_mb": float(np.median(end)) if len(end) else None,
            "max_mb": max(rss for _, rss, _ in rows),
            "fds": (rows[0][2], rows[-1][2]),
            "judged": span >= 3 and len(start) > 1 and len(end) > 1,
        })  # fmt: skip
        out[-1]["slope_mb_per_min"] = minute_medians_slope(minute_medians(rows, rows[0][0]), warmup_min - rows[0][0])
        if len(start) and len(end):
            out[-1]["growth_mb"] = out[-1]["end_mb"] - out[-1]["start_mb"]
            error = 1.25 * float(np.sqrt(start.var() / len(start) + end.var() / len(end)))
            out[-1]["allowed_mb"] = max(max_growth_mb, 2 * error)
    return out


def slope_mb_per_min(samples: list[tuple[float, float, int]], from_min: float) -> float | None:
    """Least-squares slope of RSS over the samples taken at or after `from_min` minutes."""
    tail = [(t, rss) for t, rss, _ in samples if t >= from_min]
    if len(tail) < 3:
        return None
    t, rss = np.array(tail).T
    return float(np.polyfit(t, rss, 1)[0])


def minute_medians(samples: list[tuple[float, float, int]], since: float = 0.0) -> list[float]:
    """The median RSS (MB) of each whole minute's samples from minute `since` of the run (0: the
    first sample's), minute 0 first (a last minute cut short is left out): a reload holds two
    pairs for a moment, a sawtooth of a few MB that sways a fit over raw samples (and more so
    over a short window); the median of a minute does not see it."""
    minutes: dict[int, list[float]] = {}
    for t, rss, _ in samples:
        minutes.setdefault(int(t - since), []).append(rss)
    whole = int(samples[-1][0] - since) if samples else 0
    return [float(np.median(minutes[m])) for m in range(whole) if m in minutes]


def minute_medians_slope(medians: list[float], from_min: float) -> float | None:
    """Least-squares slope (MB/min) of the minute medians from minute `from_min` on."""
    keys = [m for m in range(len(medians)) if m >= from_min]
    if len(keys) < 3:
        return None
    return float(np.polyfit(keys, [medians[m] for m in keys], 1)[0])


def minute_medians_spread(medians: list[float], from_min: float) -> float | None:
    """Largest minus smallest minute median (MB) from minute `from_min` on: the acceptance
    figure (a server that holds up stays within a few MB once warm, whatever the fit says)."""
    tail = medians[int(np.ceil(from_min)) :]
    return float(max(tail) - min(tail)) if tail else None
