"""`python -m training train` (or `train-text`) in a process of its own, as the training-run tests start it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import ROOT

# Slow enough per epoch (~3 s) that a kill lands inside training, small enough to stay quick.
TINY = [
    "--max-classes",
    "30",
    "--max-per-class",
    "20",
    "--classes-per-batch",
    "8",
    "--epochs",
    "4",
    "--batches-per-epoch",
    "80",
    "--no-plots",
]


def start_training(
    out: Path, *extra: str, base: tuple[str, ...] | list[str] = TINY, env=None, command: str = "train"
) -> subprocess.Popen:
    """`python -m training <command>` (train, or train-text) in its own process (and session, so a test
    can kill it all).

    Output goes to a file beside `out`, not a pipe: Ray is chatty, and a full pipe nobody
    reads would stall the run.
    """
    log = open(out.with_name(f"{out.name}.log"), "a")  # noqa: SIM115 - the child owns it
    process = subprocess.Popen(
        [sys.executable, "-m", "training", command, "--out", str(out), *base, *extra],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    process.log_path = Path(log.name)  # what a failed assertion shows
    return process


def output_of_run(out: Path) -> str:
    return out.with_name(f"{out.name}.log").read_text()


def output_of(process: subprocess.Popen) -> str:
    return process.log_path.read_text()[-4000:]


def wait_for_checkpoint(out: Path, process: subprocess.Popen, timeout: float = 240, run: str = "train") -> None:
    """Until the first epoch's checkpoint is registered (the one before it is the start's, the
    untrained network: resuming from it would look like starting over). `run`: the Ray Train run's
    name, its folder under the work directory's storage."""
    storage = out.with_name(f".{out.name}.work") / "ray" / run
    deadline = time.time() + timeout
    while time.time() < deadline:
        # Ray has registered a checkpoint (not just written it) once its snapshot names one.
        snapshot = storage / "checkpoint_manager_snapshot.json"
        try:
            if len(set(re.findall(r"checkpoint_[0-9T:.\-_]+", snapshot.read_text()))) >= 2:
                return
        except OSError:
            pass
        assert process.poll() is None, output_of(process)
        time.sleep(0.2)
    raise AssertionError("no checkpoint appeared")


def finish(process: subprocess.Popen, timeout: float = 400) -> None:
    process.wait(timeout=timeout)
    assert process.returncode == 0, output_of(process)


def kill_run(process: subprocess.Popen) -> None:
    """SIGKILL the driver and its local Ray cluster at once, as on a lost machine."""
    import psutil

    family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for p in family:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    process.wait(timeout=30)
