"""`python -m training train` in a process of its own, as the training-run tests start it."""

from __future__ import annotations

import subprocess
import sys
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


def start_training(out: Path, *extra: str, base: tuple[str, ...] | list[str] = TINY, env=None) -> subprocess.Popen:
    """`python -m training train` in its own process (and session, so a test can kill it all).

    Output goes to a file beside `out`, not a pipe: Ray is chatty, and a full pipe nobody
    reads would stall the run.
    """
    log = open(out.with_name(f"{out.name}.log"), "a")  # noqa: SIM115 - the child owns it
    process = subprocess.Popen(
        [sys.executable, "-m", "training", "train", "--out", str(out), *base, *extra],
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
