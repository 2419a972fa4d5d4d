"""`serve --ray`'s connection to its Ray cluster: its ports claimed first where the ingress will
listen on this machine, the cluster joined (or a local Ray started, with the settings of a
serving cluster), and Ray's and Serve's own output made this command's records."""

from __future__ import annotations

import logging
import os
import socket
import sys

from serving.config import ServerConfig
from serving.logs import failure_reason, one_line


def _local_ray(address: str) -> bool:
    """Whether RAY_ADDRESS names this machine's Ray (or none): the ingress then listens here. An
    address is this machine's when a socket can bind it."""
    if address in ("", "auto", "local"):
        return True
    host = address.split("://", 1)[-1].rpartition(":")[0] or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def check_ports(config: ServerConfig) -> None:
    """Every port the ingress will listen on, claimed here first when it will listen on this
    machine: one `error:` line naming the port before anything is deployed (Serve's own failure,
    after half a minute of retries, names the deployment, not the port)."""
    from serving.listen import claim_port

    if not _local_ray(os.environ.get("RAY_ADDRESS", "")):
        return
    transport = config.transport
    for what, port, flag in (
        ("gRPC", transport.port, "--port"),
        ("HTTP", transport.http_port, "--http-port"),
        ("metrics", transport.metrics_port, "--metrics-port"),
    ):
        if port is not None:
            claim_port(what, transport.host, port, flag)


# Ray's own settings for a cluster that serves, given to a local one this command starts (an
# operator sets them on the head of theirs: docs/operations.md, deploy/k8s/rayservice-serving.yaml).
# - Ray starts its workers at nice 15, for batch work beside interactive use; here the workers
#   are the server (its shards, embedder and ingress), so they run as one would.
# - The GCS keeps the events of the last 100,000 tasks by default, for `ray list tasks`. Serve's
#   own calls (the controller's health checks and long polls, ~9 a second at S = 4) fill it at
#   ~2 kB an event: the GCS grew +1.2 MB/min and would have for ~3 hours, ~200 MB, before
#   levelling. A serving cluster keeps the last 1,000, reached in its first minutes.
SERVING_CLUSTER_ENV = {"RAY_worker_niceness": "0", "RAY_task_events_max_num_task_in_gcs": "1000"}


def connect_ray() -> None:
    """Join the cluster at RAY_ADDRESS, or start a local Ray: an address that does not answer is
    a ValueError (one `error:` line), not a minute of retries."""
    from core.cli import init_ray, verbose

    address = os.environ.get("RAY_ADDRESS", "")
    if address and address not in ("auto", "local") and "://" not in address:
        host, colon, port = address.rpartition(":")
        if not colon or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"RAY_ADDRESS={address} is not host:port (a Ray head's GCS address, such as 10.0.0.5:6379), "
                "auto, or ray://host:port"
            )
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
                pass
        except OSError as exc:
            raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {exc}") from None
    _cluster_errors_as_records()
    if not address:
        for name, value in SERVING_CLUSTER_ENV.items():  # the user's own setting wins
            os.environ.setdefault(name, value)
    with _core_warnings_held() as held:
        try:
            # Ray's "Connecting to existing Ray cluster" and Serve's progress lines are INFO: the
            # command's own output is its ports (or one error line), so they show with --verbose only.
            init_ray(log_to_driver=False, logging_level=logging.INFO if verbose() else logging.WARNING)
        except ConnectionError as exc:
            if "InvalidAuthToken" in held.text():
                raise ValueError(
                    f"the Ray cluster at RAY_ADDRESS={address} refused this process's token (InvalidAuthToken): "
                    "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, or start the cluster "
                    "with RAY_AUTH_MODE=disabled"
                ) from None
            reason = failure_reason(exc, typed=False, first=True)
            raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {reason}") from None
    _ray_lines_as_ours()


def _ray_lines_as_ours() -> None:
    """Ray's and Serve's lines in this command's log format, not their own, and their INFO lines
    with --verbose only. Serve configures its logger as it is imported: imported here first."""
    import ray.serve  # noqa: F401 - its logger configured, then made ours

    from core.cli import verbose

    for name in ("ray", "ray.serve"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
        if not verbose():  # Serve's logger has a level of its own, not the "ray" logger's
            logger.setLevel(logging.WARNING)


def _cluster_errors_as_records() -> None:
    """The errors the cluster publishes to its drivers (a worker that died or was killed, with its
    ids and likely causes; a task that failed and is retried) as records of the `ray.raylet`
    logger, one line each in this command's format. Ray's driver prints them to stdout, a
    coloured paragraph each, whatever `log_to_driver` says: its error listener
    (`ray._private.worker.listen_error_messages`) calls the module's `print_to_stdstream`, which
    Ray 2.60 has no option for, so that function is replaced here — this command's stdout is its
    ports line alone. Other output (workers' own lines, which `log_to_driver=False` keeps off)
    goes to Ray's function as before."""
    from ray._private import worker

    printed = worker.print_to_stdstream
    if getattr(printed, "as_records", False):
        return

    def as_records(data: dict, ignore_prefix: bool) -> None:
        source = data.get("pid")
        if source not in ("raylet", "autoscaler"):
            printed(data, ignore_prefix)
            return
        for message in data.get("lines") or ():
            if text := one_line(str(message)):
                logging.getLogger(f"ray.{source}").warning("%s", text)

    as_records.as_records = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = as_records


# `serve.shutdown` ends Serve's controller with `ray.kill`; the calls this process still has
# pending on it (Serve's long poll for changes, the shutdown call itself) are then published by
# Ray as failed tasks "to be retried", one `ray.raylet` warning each. At that moment they are
# what a shutdown is, not a fault: dropped then, and only then (a controller that dies while
# serving is still reported).
SERVE_SHUTDOWN_NOISE = (
    "Task ServeController.listen_for_change failed.",
    "Task ServeController.graceful_shutdown failed.",
)


def quiet_serve_shutdown() -> None:
    """Before `serve.shutdown`: its controller's expected death is not reported (--verbose reports it)."""
    from core.cli import KnownNoise, verbose

    if not verbose():
        logging.getLogger("ray.raylet").addFilter(KnownNoise(SERVE_SHUTDOWN_NOISE))


class _core_warnings_held:
    """Ray's core (C++) writes a warning to file descriptor 2 for every failed try to reach a
    cluster, a score of lines before the Python error: held here while Ray starts or joins, and
    written out after only when it started (a refusal is then said in one line, naming why)."""

    def __enter__(self) -> _core_warnings_held:
        import tempfile

        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def text(self) -> str:
        self._file.seek(0)
        return self._file.read().decode(errors="replace")

    def __exit__(self, kind: object, *_: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        if kind is None:
            sys.stderr.write(self.text())
        self._file.close()
