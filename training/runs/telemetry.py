"""What a training run tells the people watching it: Ray metrics and a progress display.

The metrics go through `ray.util.metrics`, so Ray's metrics agent exports them (with a `ray_`
prefix: `ray_simsearch_train_loss`, ...) on the port Prometheus already scrapes for Ray, and
the *Training* dashboard shows them next to the search service. Only rank 0 reports; the
other workers see the same figures after DDP's all-reduce.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from core.progress import track


def epoch_logger() -> logging.Logger:
    """The per-epoch progress lines: INFO to stderr even where the root logger is quieter
    (Ray workers), and not propagated, so no handler prints them twice."""
    logger = logging.getLogger("simsearch.train.progress")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


T = TypeVar("T")


class TrainingMetrics:
    """Gauges of one run, tagged with the run's name so runs side by side stay apart."""

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"run": run}
        self.loss = Gauge("simsearch_train_loss", "Mean training loss of the last epoch", tag_keys=("run",))
        self.lr = Gauge("simsearch_train_learning_rate", "Learning rate by parameter group", tag_keys=("run", "group"))
        self.throughput = Gauge(
            "simsearch_train_images_per_second", "Training images/s over all workers", tag_keys=("run",)
        )
        self.epoch = Gauge("simsearch_train_epoch", "Last finished epoch (0-based)", tag_keys=("run",))
        self.val_recall = Gauge(
            "simsearch_train_val_recall_at_k", "Validation-class Recall@K after each epoch", tag_keys=("run", "k")
        )

    def report_epoch(self, metrics: Mapping[str, Any], learning_rates: Mapping[str, float]) -> None:
        self.epoch.set(float(metrics["epoch"]), tags=self.tags)
        self.loss.set(float(metrics["loss"]), tags=self.tags)
        self.throughput.set(float(metrics["images_per_s"]), tags=self.tags)
        for group, lr in learning_rates.items():
            self.lr.set(float(lr), tags={**self.tags, "group": group})
        for key, value in metrics.items():
            if key.startswith("val_recall_at_"):
                self.val_recall.set(float(value), tags={**self.tags, "k": key.removeprefix("val_recall_at_")})


def progress(batches: Iterable[T], total: int, epoch: int, epochs: int, enabled: bool) -> Iterator[T]:
    """Batches, shown as a bar with rate and ETA when enabled (a terminal); otherwise a log line
    every ~30 s, so a long epoch is not silent in a log (the epoch line carries the figures).

    Ray forwards worker output line by line, so inside a Ray worker the bar is Ray's own
    `tqdm_ray`, which the driver redraws properly; elsewhere plain tqdm.
    """
    if not enabled:
        yield from track(
            batches, total, f"epoch {epoch + 1}/{epochs}", "batch", "lines", epoch_logger(), closing_line=False
        )
        return
    try:
        import ray.train

        ray.train.get_context()
        from ray.experimental.tqdm_ray import tqdm
    except Exception:  # noqa: BLE001 - not inside Ray Train: a terminal bar
        from tqdm import tqdm
    yield from tqdm(batches, total=total, desc=f"epoch {epoch + 1}/{epochs}", file=sys.stderr)


class EpochClock:
    """Seconds per epoch so far, for the ETA in each epoch's log line."""

    def __init__(self, epochs: int, start_epoch: int = 0) -> None:
        self.epochs, self.start_epoch, self.started = epochs, start_epoch, time.perf_counter()

    def eta_seconds(self, finished_epoch: int) -> float:
        done = finished_epoch + 1 - self.start_epoch
        per_epoch = (time.perf_counter() - self.started) / max(done, 1)
        return per_epoch * (self.epochs - finished_epoch - 1)


def _val_recall(metrics: Mapping[str, Any]) -> str:
    prefix = "val_recall_at_"
    return " ".join(f"val_R@{k.removeprefix(prefix)}={v:.4f}" for k, v in metrics.items() if k.startswith(prefix))


def start_line(metrics: Mapping[str, Any], recipe: str | None) -> str:
    """The line before the first epoch: where training starts on the validation classes."""
    return f"start (recipe {recipe}, before training) {_val_recall(metrics)}"


def epoch_line(metrics: Mapping[str, Any], learning_rates: Mapping[str, float], eta_s: float, epochs: int) -> str:
    """One human line per epoch: what CI logs show when the bar is off."""
    lrs = " ".join(f"lr[{g}]={v:.2e}" for g, v in learning_rates.items())
    return (
        f"epoch {metrics['epoch'] + 1}/{epochs} loss={metrics['loss']:.4f} {lrs} "
        f"{metrics['images_per_s']:.0f} img/s {_val_recall(metrics)} eta {eta_s:.0f}s"
    ).replace("  ", " ")
