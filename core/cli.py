"""Shared command-line behaviour: user errors become one clear line and exit code 2, and logs
hold what a person reads — known third-party chatter is quiet unless `--verbose`."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

from core.artifacts.layout import ArtifactError
from core.config import ConfigError
from core.data.catalog import CatalogError
from core.data.preprocess import ImageDecodeError

USER_ERRORS: tuple[type[BaseException], ...] = (
    ArtifactError,
    CatalogError,
    ConfigError,
    ImageDecodeError,
    FileNotFoundError,
    ValueError,
)


# Loggers that speak at INFO/WARNING about things a user cannot act on: faiss lists every CPU
# variant it tries to load, Ray Train's placement-group cleaner warns at every shutdown that the
# controller it watches has gone, the ONNX exporter narrates each pass.
THIRD_PARTY_NOISE: dict[str, int] = {
    "faiss.loader": logging.WARNING,
    "faiss": logging.WARNING,
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": logging.CRITICAL,
    "ray.train.v2._internal.callbacks.placement_group_callback": logging.ERROR,
    "onnxscript": logging.WARNING,
    "onnx_ir": logging.WARNING,
    "torch.onnx": logging.WARNING,
    "torch._dynamo": logging.WARNING,
    "torch.export": logging.WARNING,
    # "Token authentication is enabled for this Ray cluster" at every local start: the default
    # since Ray 2.5x, nothing for the user to act on.
    "ray._private.authentication.authentication_token_setup": logging.ERROR,
    # Ray Train's controller registers its workers' resources with Ray Data's autoscaling
    # coordinator, waiting 5 s (a constant, no knob); on a busy machine the wait runs out and it
    # logs "Failed to send resource request ... safe to ignore" with a 20-line GetTimeoutError
    # traceback. The request only informs an autoscaler (a local cluster has none) and is resent
    # every 20 s; a cluster that really lacks the resources still fails the run with Ray Train's
    # own worker-group start timeout, which is not quieted.
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client": logging.ERROR,
}
# Known-harmless records by their message, dropped whatever their level (a library may reset
# its loggers' levels as it configures its own logging): the logger that makes them, and what
# their message starts with.
NOISE_BY_MESSAGE: dict[str, tuple[str, ...]] = {
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client": (
        "Failed to send resource request",
        "Failed to cancel resource request",
    ),
}


class KnownNoise(logging.Filter):
    """Drops the records whose message starts with one of `NOISE_BY_MESSAGE`'s fragments."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 — a record that cannot format is not ours to judge
            return True
        return not message.startswith(self.fragments)


# A single-node local cluster cannot be preempted; Ray Train's preemption watcher there only
# prints a core-worker error about its restartable constructor arguments.
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# Ray Train's worker context logs every report at INFO under a logger named by its file path,
# outside `ray.train` (which RunConfig's LoggingConfig quiets).
NOISE_BY_FILE = ("ray", "train/v2/_internal/execution/context.py")
VERBOSE_ENV = "SIMSEARCH_VERBOSE"


def quiet_third_party() -> None:
    """Raise the known noisy loggers' levels (also Ray's `worker_process_setup_hook`, so the
    actors and workers it starts are as quiet as the driver)."""
    if verbose():
        return
    for name, level in THIRD_PARTY_NOISE.items():
        logging.getLogger(name).setLevel(level)
    fragments = tuple(f for by_logger in NOISE_BY_MESSAGE.values() for f in by_logger)
    # On the loggers that make the records, and on the handlers they propagate to (the root's
    # and Ray's, present now), so neither a level reset nor a record re-logged elsewhere lets one out.
    places = [logging.getLogger(name) for name in NOISE_BY_MESSAGE]
    places += logging.getLogger().handlers + logging.getLogger("ray").handlers
    for place in places:
        if not any(isinstance(f, KnownNoise) for f in place.filters):
            place.addFilter(KnownNoise(fragments))
    package, path = NOISE_BY_FILE
    spec = importlib.util.find_spec(package)  # located, not imported: serving never loads Ray
    if spec is not None and spec.origin:  # None: Ray not installed (the serving image)
        logging.getLogger(os.path.join(os.path.dirname(spec.origin), path)).setLevel(logging.WARNING)


def configure_logging(verbose: bool = False) -> None:
    """INFO to stderr with a timestamp; third-party noise quiet unless `verbose` (which child
    processes and Ray workers inherit through the environment)."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_third_party()


def verbose() -> bool:
    return bool(os.environ.get(VERBOSE_ENV))


def ray_worker_setup() -> None:
    """Ray's `worker_process_setup_hook`: quiet logging like the driver's, and RAY_ADDRESS set to
    the worker's own cluster. Ray Train's placement-group cleaner calls Ray's state API, which
    otherwise looks for "the" local cluster and dies of "Found multiple active Ray instances"
    when two jobs run side by side on one machine (a training beside a rebuild)."""
    quiet_third_party()
    if not os.environ.get("RAY_ADDRESS"):
        try:
            import ray

            os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 — a worker without a context keeps Ray's own lookup
            logging.getLogger(__name__).debug("no Ray context to read the cluster address from", exc_info=True)


def ray_runtime_env() -> dict:
    """What every `ray.init` passes: workers set up like the driver (`ray_worker_setup`)."""
    return {"worker_process_setup_hook": "core.cli.ray_worker_setup"}


# A local start on a loaded machine: the driver's core worker waits RAY_raylet_start_wait_time_s
# (10 s by default) for its raylet to register with the GCS, and Ray's node start waits a fixed
# 30 s; a machine at load 10-30 ran past the first. The wait is raised here, and a start that
# still fails is tried again from nothing, then reported in one line (`RayStartError`).
LOCAL_RAY_START_ENV = {"RAY_raylet_start_wait_time_s": "60"}
LOCAL_RAY_START_TRIES = 3
# The raylet calls its disk full past a fraction of it (0.95), and then logs an error every 10 s
# to every driver's terminal: on CI's 252 GB disk with 10 GB free, five lines in a two-minute
# demo. A fraction is the wrong measure on a big disk; what a local cluster must keep free is room
# to spill its object store (Ray's default: 30% of the memory). FS_THRESHOLD_ENV is set to that.
FS_THRESHOLD_ENV = "RAY_local_fs_capacity_threshold"
RAY_DEFAULT_FS_THRESHOLD = 0.95
OBJECT_STORE_SHARE = 0.3


def local_fs_capacity_threshold(disk_bytes: int, memory_bytes: int) -> float:
    """The full fraction of a disk of `disk_bytes` at which a local raylet should call it full:
    what keeps room to spill an object store of Ray's default size on a machine of
    `memory_bytes`, never stricter than Ray's own 0.95."""
    keep_free = OBJECT_STORE_SHARE * memory_bytes
    return max(RAY_DEFAULT_FS_THRESHOLD, 1.0 - keep_free / disk_bytes)


def _local_fs_threshold_env() -> dict[str, str]:
    temp = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    threshold = local_fs_capacity_threshold(shutil.disk_usage(temp).total, memory)
    return {FS_THRESHOLD_ENV: f"{threshold:.4f}"}


class RayStartError(RuntimeError):
    """A local Ray that did not start: one line for the user, not Ray's traceback."""


def init_ray(log_to_driver: bool = True, **options) -> None:
    """Join the cluster at RAY_ADDRESS, or start a local one; every stage starts Ray this way.

    A local cluster also gets `LOCAL_RAY_ENV` (where the user has not set those variables), a
    longer wait for its raylet on a busy machine, and up to `LOCAL_RAY_START_TRIES` starts; a
    local start that fails every time raises `RayStartError`."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    runtime_env = ray_runtime_env()
    # Ray's own INFO lines ("Started a local Ray instance.") are its news, not the user's stage's.
    options = {
        "include_dashboard": False,
        "log_to_driver": log_to_driver,
        "runtime_env": runtime_env,
        "logging_level": logging.WARNING,
        **options,
    }
    if address:
        ray.init(address=address, **options)
        return
    # The user's own setting of a variable wins.
    runtime_env["env_vars"] = {name: os.environ.get(name, value) for name, value in LOCAL_RAY_ENV.items()}
    for name, value in {**LOCAL_RAY_START_ENV, **_local_fs_threshold_env()}.items():
        os.environ.setdefault(name, value)  # read by this process's core worker and the raylet it starts
    for attempt in range(1, LOCAL_RAY_START_TRIES + 1):
        try:
            ray.init(**options)
            return
        except (TypeError, ValueError):  # the options, not the machine: no second try helps
            raise
        except Exception as exc:  # noqa: BLE001 — Ray raises bare Exception for a node that timed out
            _stop_failed_start(exc)
            reason = " ".join(str(exc).split()) or type(exc).__name__
            logging.getLogger(__name__).warning(
                "a local Ray did not start (try %d of %d): %s", attempt, LOCAL_RAY_START_TRIES, reason[:200]
            )
            if attempt == LOCAL_RAY_START_TRIES:
                raise RayStartError(
                    f"could not start a local Ray in {LOCAL_RAY_START_TRIES} tries (last: {reason[:200]}); the "
                    "machine may be overloaded: try again when it is quieter, or start Ray yourself "
                    "(ray start --head) and set RAY_ADDRESS"
                ) from None
            time.sleep(2.0 * attempt)


def _stop_failed_start(exc: BaseException) -> None:
    """End what a failed local start left running, so the next try starts from nothing: Ray's
    shutdown for a node it registered, else the processes of the half-made node in the
    exception's frames (ray.init drops its only reference to it)."""
    import ray
    from ray._private.node import Node

    ray.shutdown()
    frame = exc.__traceback__
    while frame is not None:
        node = frame.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            try:
                node.kill_all_processes(check_alive=False, allow_graceful=False)
            except Exception:  # noqa: BLE001 — best effort: the reaper ends them when this process exits
                logging.getLogger(__name__).debug("could not stop a failed start's processes", exc_info=True)
            return
        frame = frame.tb_next


# The name `pip install` puts on PATH: every parser's usage line starts with it (`simsearch index
# build …`), the command a user types, though `python -m PACKAGE` runs the same parser.
COMMAND = "simsearch"


def add_verbose_flag(subparsers: argparse._SubParsersAction) -> None:
    """`--verbose` on every subcommand (after the command name, where people type it)."""
    for parser in subparsers.choices.values():
        parser.add_argument(
            "--verbose", action="store_true", default=None, help="also show third-party log lines (faiss, Ray, ONNX)"
        )


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML/TOML file with any of the options below (flags win)")


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """How a long stage shows progress is the terminal's business, not the artifact's: a flag only."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a bar on a terminal, a line every ~30 s otherwise (default: on)",
    )


# What a shell reports for a writer that a closed pipe's SIGPIPE ended (`yes | head`): Python
# ignores SIGPIPE and raises BrokenPipeError instead, so a command exits with it itself.
CLOSED_PIPE_EXIT = 128 + 13


def run_cli(command: Callable[[], None], verbose: bool = False) -> int:
    """Run a command; print user errors without a traceback (exit 2), keep tracebacks for bugs.
    A reader that stops early (`| head`) ends it quietly."""
    configure_logging(verbose)
    try:
        command()
        sys.stdout.flush()  # a pipe its reader closed fails here, inside the handler, not at exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return CLOSED_PIPE_EXIT
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RayStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        logging.getLogger("simsearch").exception("unexpected failure")
        return 1
    return 0


def _stdout_to_devnull() -> None:
    """Python's documented way out of a closed pipe: what is still buffered for stdout goes
    nowhere, so the interpreter's flush at exit does not raise the error a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
