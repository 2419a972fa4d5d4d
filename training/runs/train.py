"""Ray Train training of an embedding model with a metric-learning loss.

The driver prepares class-disjoint split catalogs, runs `TorchTrainer` (local Ray unless
RAY_ADDRESS names a cluster), keeps the checkpoint with the best validation Recall@1, and
evaluates it — and the untrained network — on the test classes. It publishes a run directory:
`checkpoint.pt`, `results.json`, `config.json`, `splits/`.

Each Ray Train worker (`train_loop_per_worker`) builds its model, loss, optimiser and loader
(`training/runs/trainable.py`), then runs plain steps: `train_one_epoch`, `validate` on the validation
classes, `update_best`, and `save_checkpoint` / `load_checkpoint` (a resumed run,
`training/runs/checkpoints.py`), reported to Ray Train by `report`. The options and recipes are
`training/runs/config.py`'s; the run's work directory and Ray Train fit, which `training train-text`
shares, `training/runs/ray_run.py`'s; the test classes' evaluation, `training/runs/final_evaluation.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.artifacts.layout import staging_directory, utc_now, write_json_atomic
from core.config import to_jsonable
from core.data.catalog import read_catalog
from training.data.samplers import ClassBalancedBatchSampler
from training.data.splits import (
    EvalImages,
    LazyImages,
    build_augmentation,
    collate_skipping_unreadable,
    decoding_worker_init,
    prepare_splits,
    slice_catalog,
    train_dataset,
)
from training.models.models import (
    EmbeddingNet,
    TrunkFeatures,
    input_contract,
    random_start_notice,
)
from training.models.warm_start import initialise_from_features, warm_start_per_class
from training.models.weight_files import PACKAGE_PREFIX
from training.runs.checkpoints import (
    CHECKPOINT_FILE,
    SELECTION_SCORE,
    Record,
    best_and_last_states,
    resume_point,
    save_checkpoint,
)
from training.runs.config import TrainConfig, recipe_line
from training.runs.evaluate import (
    retrieval_metrics,
)
from training.runs.final_evaluation import evaluate_test_classes, split_images
from training.runs.ray_run import fit_on_ray, work_directory
from training.runs.telemetry import EpochClock, TrainingMetrics, epoch_line, epoch_logger, progress, start_line
from training.runs.trainable import Trainable, build_loss_for, build_model, build_optimizer, learning_rates, unwrap

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"
START_EPOCH = -1  # the history row of the network before any training step


def selection_score(metrics: dict[str, Any], epoch: int) -> float:
    """What picks the published checkpoint: validation Recall@1 — never a test figure — or,
    with no validation classes, the epoch itself, so the last one wins. Recall@1 of a small
    validation split moves in steps of 1/N and ties for epochs on end while the ranking keeps
    improving (icon set: 88 images, R@1 flat from epoch 2 to 9 while MAP@R rose 0.29 → 0.37), so
    MAP@R breaks a tie, then the earlier epoch (a hair less per epoch). Ray's best checkpoint is
    always the one `best_epoch` names — the start itself when no epoch beats it."""
    if "val_recall_at_1" not in metrics:
        return float(epoch)
    tie_break = 1e-6 * float(metrics.get("val_map_at_r", 0.0)) - 1e-12 * (epoch - START_EPOCH)
    return float(metrics["val_recall_at_1"]) + tie_break


def _set_threads(num_workers: int) -> None:
    # Workers share the machine's cores; oversubscription makes every worker slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_workers))


def train_one_epoch(
    trainable: Trainable,
    loader: torch.utils.data.DataLoader,
    device: torch.device,
    epoch: int,
    cfg: TrainConfig,
    show_progress: bool,
) -> tuple[list[float], int, int, float]:
    """One epoch of class-balanced batches: each batch's loss, the images seen and how many of them
    were unreadable, and the seconds it took. The backbone is held in its warm-up epochs."""
    model, loss_fn, optimizer, scheduler = trainable.model, trainable.loss_fn, trainable.optimizer, trainable.scheduler
    sampler = loader.batch_sampler
    sampler.set_epoch(epoch)
    model.train()
    if epoch < cfg.warmup_epochs:
        unwrap(model).backbone.eval()  # frozen: no BatchNorm statistics drift either
    started, losses, seen, skipped = time.perf_counter(), [], 0, 0
    for x, y, bad in progress(loader, len(sampler), epoch, cfg.epochs, show_progress):
        loss = loss_fn(model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        seen, skipped = seen + len(y) + bad, skipped + bad
    if seen and skipped / seen > cfg.max_bad_fraction:
        raise ValueError(
            f"{skipped} of {seen} training images were unreadable in epoch {epoch}, over the allowed "
            f"fraction {cfg.max_bad_fraction}"
        )
    return losses, seen, skipped, time.perf_counter() - started


def validate(model: torch.nn.Module, val: EvalImages, device: torch.device, ks: list[int]) -> dict[str, float]:
    """Recall@K and MAP@R on the validation classes: what selects the checkpoint."""
    scores = retrieval_metrics(*val.embed(unwrap(model), device), ks)
    return {**{f"val_recall_at_{k}": v for k, v in scores["recall_at_k"].items()}, "val_map_at_r": scores["map_at_r"]}


def update_best(metrics: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    """The best epoch so far, with the one `metrics` reports scored (`selection_score`); `metrics`
    gets its score and the best epoch."""
    epoch = metrics["epoch"]
    metrics[SELECTION_SCORE] = selection_score(metrics, epoch)
    if metrics[SELECTION_SCORE] > best[SELECTION_SCORE]:
        best = {"epoch": epoch, SELECTION_SCORE: metrics[SELECTION_SCORE]}
        best["val_recall_at_1"] = metrics.get("val_recall_at_1")
    metrics["best_epoch"] = best["epoch"]
    return best


def report(
    metrics: dict[str, Any],
    rates: dict[str, float],
    trainable: Trainable,
    record: Record,
    val: EvalImages | None,
    device: torch.device,
    cfg: TrainConfig,
    rank: int,
    telemetry: TrainingMetrics | None,
    clock: EpochClock,
) -> None:
    """Validate (rank 0), keep the best, checkpoint and report one history row — every rank
    reports, as Ray Train requires."""
    import ray.train

    epoch = metrics["epoch"]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = None
        if rank == 0:
            if val is not None:
                metrics.update(validate(trainable.model, val, device, cfg.ks))
            record.best = update_best(metrics, record.best)
            record.history.append(metrics)
            save_checkpoint(Path(tmp) / CHECKPOINT_FILE, trainable, record, epoch)
            ckpt = ray.train.Checkpoint.from_directory(tmp)
            if epoch == START_EPOCH:
                epoch_logger().info(start_line(metrics, cfg.recipe))
            else:
                telemetry.report_epoch(metrics, rates)
                epoch_logger().info(epoch_line(metrics, rates, clock.eta_seconds(epoch), cfg.epochs))
        ray.train.report(metrics, checkpoint=ckpt)


def warm_start(net: EmbeddingNet, loss_fn: torch.nn.Module, train_catalog, contract, cfg: TrainConfig, device) -> None:
    """The head (PCA) and proxies (class means) fitted to the pretrained features of a sample
    of the training images, before the first step (`--head-init`, `--proxy-init`)."""
    sample = slice_catalog(train_catalog, None, warm_start_per_class(len(train_catalog.classes)))
    images = EvalImages(sample, contract, cfg.data_mode, cfg.loader_workers, cfg.max_bad_fraction)
    features, codes = images.embed(TrunkFeatures(net), device)
    initialise_from_features(net, loss_fn, features, codes, len(images.classes), cfg.head_init, cfg.proxy_init)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: class-balanced batches, loss, validation, a checkpoint per epoch."""
    import ray.train
    import ray.train.torch

    cfg = TrainConfig(**config["train"])
    splits = config["splits"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    _set_threads(world)
    contract = input_contract(cfg.backbone, cfg.image_size, cfg.pretrained)
    train_catalog = read_catalog(splits["train"])
    augment = build_augmentation(cfg.augmentation, contract)
    dataset, labels, skipped_up_front = train_dataset(
        train_catalog, contract, augment, cfg.data_mode, cfg.max_bad_fraction
    )
    val = split_images(splits, "val", cfg, contract) if rank == 0 else None

    device = ray.train.torch.get_device()
    net = build_model(cfg).to(device)
    loss_fn = build_loss_for(cfg, len(train_catalog.classes), net.embedding_dim)
    if ray.train.get_checkpoint() is None and (cfg.head_init, cfg.proxy_init) != ("random", "random"):
        warm_start(net, loss_fn, train_catalog, contract, cfg, device)
    loss_fn = loss_fn.to(device)
    sampler = ClassBalancedBatchSampler(
        labels, cfg.classes_per_batch, cfg.samples_per_class, cfg.seed, rank, world, cfg.batches_per_epoch
    )
    optimizer, scheduler = build_optimizer(cfg, net, loss_fn, len(sampler))
    trainable = Trainable(ray.train.torch.prepare_model(net), loss_fn, optimizer, scheduler)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.loader_workers if isinstance(dataset, LazyImages) else 0,
        collate_fn=collate_skipping_unreadable,
        worker_init_fn=decoding_worker_init,
    )
    start_epoch, record = resume_point(trainable, device)

    telemetry = TrainingMetrics(Path(cfg.out).name) if rank == 0 else None
    clock = EpochClock(cfg.epochs, start_epoch)
    reporting = (trainable, record, val, device, cfg, rank, telemetry, clock)
    if start_epoch == 0 and "val" in splits:
        # Where training starts, on the validation classes: the first row of the history, and
        # the checkpoint published if no epoch beats it (fine-tuning that only hurts).
        report({"epoch": START_EPOCH, "skipped_images": skipped_up_front}, learning_rates(optimizer), *reporting)
    for epoch in range(start_epoch, cfg.epochs):
        losses, seen, skipped, seconds = train_one_epoch(
            trainable, loader, device, epoch, cfg, bool(cfg.progress) and rank == 0
        )
        rates = learning_rates(optimizer)
        metrics: dict[str, Any] = {
            "epoch": epoch,
            "loss": float(np.mean(losses)) if losses else math.nan,
            **{f"lr_{group}": lr for group, lr in rates.items()},
            "images_per_s": (seen - skipped) * world / max(seconds, 1e-9),
            "skipped_images": skipped_up_front + skipped,
        }
        report(metrics, rates, *reporting)


def _absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """The config with its input paths made absolute: Ray Train's workers do not run in the
    driver's working directory, so a relative --catalog would name nothing there."""
    paths = {}
    for name in ("catalog", "data_root", "data_dir", "pretrained"):
        value = getattr(cfg, name)
        if value is not None and not (name == "pretrained" and value.startswith(PACKAGE_PREFIX)):
            paths[name] = str(Path(value).resolve())
    return dataclasses.replace(cfg, **paths)


def run_training(cfg: TrainConfig) -> Path:
    """Train, select by validation, evaluate on test classes, and publish the run directory."""
    cfg.check_inputs()
    if cfg.progress is None:
        cfg = dataclasses.replace(cfg, progress=sys.stderr.isatty())
    cfg = _absolute_paths(cfg)
    out = Path(cfg.out).resolve()
    log.info(recipe_line(cfg))
    notice = random_start_notice(cfg.backbone, cfg.pretrained)
    if notice is not None:
        log.warning(notice)
    work = work_directory(cfg, out)
    splits = prepare_splits(
        cfg.catalog,
        work,
        cfg.data_dir,
        cfg.test_fraction,
        cfg.val_fraction,
        cfg.split_seed,
        cfg.max_classes,
        cfg.max_per_class,
        dataset=cfg.dataset,
        data_root=cfg.data_root,
    )
    train_classes = len(read_catalog(splits["train"]).classes)
    if train_classes < cfg.classes_per_batch:
        raise ValueError(
            f"classes_per_batch={cfg.classes_per_batch} but the training split has only "
            f"{train_classes} classes; lower --classes-per-batch or use more classes"
        )
    result, use_gpu, train_seconds = fit_on_ray(
        train_loop_per_worker,
        {"train": to_jsonable(cfg), "splits": {k: str(v) for k, v in splits.items()}},
        name="train",
        work=work,
        num_workers=cfg.num_workers,
        device=cfg.device,
        max_failures=cfg.max_failures,
        score_attribute=SELECTION_SCORE,
        metrics_export_port=cfg.metrics_export_port,
    )
    state, last = best_and_last_states(result)
    model = build_model(cfg)
    model.load_state_dict(state["model"])
    contract = input_contract(cfg.backbone, cfg.image_size, cfg.pretrained)
    evaluation, similarities = evaluate_test_classes(cfg, splits, contract, model)
    fit = {"train_seconds": train_seconds, "num_workers": cfg.num_workers, "use_gpu": use_gpu}
    publish_run(out, cfg, contract, splits, state, last, evaluation, similarities, fit)
    shutil.rmtree(work, ignore_errors=True)
    return out


def publish_run(
    out: Path,
    cfg: TrainConfig,
    contract,
    splits: dict[str, Path],
    state: dict[str, Any],
    last: dict[str, Any],
    evaluation: dict[str, Any],
    similarities: dict,
    fit: dict[str, Any],
) -> None:
    """The run directory published: the best checkpoint's weights with the config and input
    contract, the splits, the plots, and `results.json` (`fit`: how the fit ran)."""
    with staging_directory(out) as staging:
        torch.save(
            {"model": state["model"], "config": to_jsonable(cfg), "contract": contract.to_dict()},
            staging / CHECKPOINT_FILE,
        )
        for name, path in splits.items():
            (staging / "splits").mkdir(exist_ok=True)
            read_catalog(path).write(staging / "splits" / f"{name}.csv")
        write_json_atomic(staging / "config.json", to_jsonable(cfg))
        if cfg.plots:
            overlaps = {name: evaluation[name]["histogram_overlap"] for name in similarities}
            write_plots(staging, last["history"], similarities, overlaps)
        write_json_atomic(
            staging / RESULTS_FILE,
            {
                "created": utc_now(),
                "best_epoch": state["best"]["epoch"],
                "val_recall_at_1": state["best"]["val_recall_at_1"],
                **evaluation,
                "history": last["history"],
                "resumed": last.get("resumed", []),
                **fit,
            },
        )


def write_plots(directory: Path, history: list[dict[str, Any]], similarities: dict, overlaps: dict[str, float]) -> None:
    from training.runs.plots import plot_recall_per_epoch, plot_similarity_histograms

    if any("val_recall_at_1" in row for row in history):  # only runs with validation classes have them
        plot_recall_per_epoch(history, directory / "recall_per_epoch.png")
    plot_similarity_histograms(similarities, directory / "similarity_histograms.png", overlaps)
