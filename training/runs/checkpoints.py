"""A training run's checkpoints: a worker's `Trainable` and what the run has told so far (`Record`)
saved and loaded, where a worker starts (`resume_point`), and the best and last checkpoints of a
finished fit read back."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.artifacts.layout import utc_now
from training.runs.trainable import Trainable, unwrap

if TYPE_CHECKING:
    import ray.train

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
SELECTION_SCORE = "selection_score"  # the metric Ray Train keeps checkpoints by


@dataclass
class Record:
    """What a run has told so far, checkpointed beside the weights: the best epoch, a history row
    per epoch, and when it was resumed."""

    best: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"epoch": -1, SELECTION_SCORE: -1.0, "val_recall_at_1": None}
    )
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumed: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def save_checkpoint(path: Path, trainable: Trainable, record: Record, epoch: int) -> None:
    torch.save(
        {
            "model": unwrap(trainable.model).state_dict(),
            "loss": trainable.loss_fn.state_dict(),
            "optimizer": trainable.optimizer.state_dict(),
            "scheduler": trainable.scheduler.state_dict(),
            "epoch": epoch,
            "best": record.best,
            "history": record.history,
            "resumed": record.resumed,
        },
        path,
    )


def load_checkpoint(path: Path, trainable: Trainable, device: torch.device) -> tuple[int, Record]:
    """Restore `trainable` from a checkpoint file: the epoch to go on from, and the run's record
    with this resumption added."""
    state = torch.load(path, map_location=device, weights_only=False)
    unwrap(trainable.model).load_state_dict(state["model"])
    trainable.loss_fn.load_state_dict(state["loss"])
    trainable.optimizer.load_state_dict(state["optimizer"])
    trainable.scheduler.load_state_dict(state["scheduler"])
    start_epoch = state["epoch"] + 1
    resumed = [*state.get("resumed", []), {"at_epoch": start_epoch, "time": utc_now()}]
    return start_epoch, Record(state["best"], state["history"], resumed)


def resume_point(trainable: Trainable, device: torch.device) -> tuple[int, Record]:
    """Where a Ray Train worker starts: epoch 0 with an empty record, or after the checkpoint Ray
    Train restored (a resumed run, or a worker restarted after a failure), `trainable` loaded."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, Record()
    with checkpoint.as_directory() as d:
        start_epoch, record = load_checkpoint(Path(d) / CHECKPOINT_FILE, trainable, device)
    log.info("resuming at epoch %d from the last checkpoint", start_epoch)
    return start_epoch, record


def best_and_last_states(result: ray.train.Result) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint states of a finished fit: the best by `SELECTION_SCORE` (the last where none
    is ranked) and the last, whose record holds the whole history."""
    best_ckpt = result.get_best_checkpoint(SELECTION_SCORE, "max") or result.checkpoint
    if best_ckpt is None:
        raise RuntimeError("training finished without a checkpoint")
    with best_ckpt.as_directory() as d:
        state = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
    with result.checkpoint.as_directory() as d:
        last = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
    return state, last
