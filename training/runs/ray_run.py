"""The run set-up `training train` and `train-text` share: the run's work directory beside its
output (kept for --resume), and Ray started and a `TorchTrainer` fitted (`fit_on_ray`), on GPUs
when asked for and the cluster has them (`resolve_use_gpu`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from core.artifacts.layout import write_json_atomic
from core.cli import init_ray, verbose
from core.config import to_jsonable

if TYPE_CHECKING:
    import ray.train

log = logging.getLogger(__name__)


def resolve_use_gpu(device: str, cluster_gpus: float) -> bool:
    """'auto' trains on GPUs when the Ray cluster has any; 'gpu' insists on them."""
    if device == "gpu" and cluster_gpus < 1:
        raise RuntimeError("device gpu requested but the Ray cluster reports no GPUs")
    return device == "gpu" or (device == "auto" and cluster_gpus >= 1)


# Options that may differ between a stopped run and its --resume (they change no result).
RESUMABLE_CHANGES = {"resume", "progress", "metrics_export_port", "max_failures", "plots", "out"}


def work_directory(cfg: Any, out: Path) -> Path:
    """The run's work directory (splits or cached data, Ray storage) beside `out`: kept for
    --resume, fresh otherwise. `cfg`: the command's resolved options (`TrainConfig`,
    `TrainTextConfig`), a dataclass with `resume`; a resumed run's must match the stopped one's
    but for `RESUMABLE_CHANGES`."""
    work = out.with_name(f".{out.name}.work")
    saved = work / "config.json"
    wanted = to_jsonable(cfg)
    if cfg.resume:
        if not saved.is_file():
            raise ValueError(f"nothing to resume: no stopped run at {work} (it is removed when a run finishes)")
        before = json.loads(saved.read_text())
        changed = sorted(k for k in wanted if k not in RESUMABLE_CHANGES and before.get(k) != wanted[k])
        if changed:
            raise ValueError(f"--resume with different options than the stopped run: {', '.join(changed)}")
        return work
    if work.exists():
        log.warning("removing the work directory of an earlier, unfinished run: %s (use --resume)", work)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json_atomic(saved, wanted)
    return work


class RayFit(NamedTuple):
    """What `fit_on_ray` returns: Ray Train's result, whether its workers ran on GPUs, and the
    seconds the fit took."""

    result: ray.train.Result
    use_gpu: bool
    train_seconds: float


def fit_on_ray(
    train_loop: Callable[[dict[str, Any]], None],
    loop_config: dict[str, Any],
    *,
    name: str,
    work: Path,
    num_workers: int,
    device: str,
    max_failures: int,
    score_attribute: str | None = None,
    metrics_export_port: int | None = None,
) -> RayFit:
    """Start Ray (a local one unless RAY_ADDRESS names a cluster) and fit `train_loop` with
    `loop_config` on Ray Train (`TorchTrainer`), the Ray Train set-up `training train` and
    `train-text` share.

    `num_workers` workers, on GPUs as `device` and the cluster say (`resolve_use_gpu`), one CPU
    each otherwise. Two checkpoints kept, ranked by `score_attribute` (the higher the better)
    where one is given, by recency otherwise. `max_failures` worker failures recovered from the
    last checkpoint. The run is stored as `name` under `work`/ray: the same (storage path, name)
    is what lets --resume pick it up. `metrics_export_port`: Ray's metrics port, for a local Ray
    only (a cluster has its own).
    """
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    local = not os.environ.get("RAY_ADDRESS")
    init_ray(**({"_metrics_export_port": metrics_export_port} if metrics_export_port and local else {}))
    use_gpu = resolve_use_gpu(device, ray.cluster_resources().get("GPU", 0))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers,
            use_gpu=use_gpu,
            resources_per_worker=None if use_gpu else {"CPU": 1},
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(work / "ray"),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute=score_attribute, checkpoint_score_order="max"
            ),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            # Ray Train narrates every checkpoint and report at INFO (configured by Ray itself,
            # in each worker); the epoch lines say what matters.
            logging_config=ray.train.LoggingConfig(log_level="INFO" if verbose() else "WARNING"),
        ),
    )
    started = time.perf_counter()
    result = trainer.fit()
    return RayFit(result, use_gpu, time.perf_counter() - started)
