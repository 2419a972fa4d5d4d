"""Ray Train training of an embedding model with a metric-learning loss.

The driver prepares class-disjoint split catalogs, runs `TorchTrainer` (local Ray unless
RAY_ADDRESS names a cluster), keeps the checkpoint with the best validation Recall@1, and
evaluates it — and the untrained network — on the test classes. It publishes a run directory:
`checkpoint.pt`, `results.json`, `config.json`, `splits/`.

Each Ray Train worker (`train_loop_per_worker`) builds its model, loss, optimiser and loader, then
runs plain steps: `train_one_epoch`, `validate` on the validation classes, `update_best`, and
`save_checkpoint` / `load_checkpoint` (a resumed run), reported to Ray Train by `report`. The
options and recipes are `training/config.py`'s.

`work_directory` (the run's work directory, kept for --resume) and `fit_on_ray` (Ray started, a
`TorchTrainer` built and fitted) are the run set-up `training train-text` shares.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from core.artifacts import staging_directory, utc_now, write_json_atomic
from core.catalog import ITEM_COLUMN, read_catalog
from core.cli import init_ray, verbose
from core.config import to_jsonable
from training.config import TrainConfig, recipe_line
from training.data import (
    EvalImages,
    LazyImages,
    build_augmentation,
    collate_skipping_unreadable,
    decoding_worker_init,
    prepare_splits,
    slice_catalog,
    train_dataset,
)
from training.evaluate import (
    histogram_overlap,
    item_recall,
    pair_similarities,
    query_gallery_metrics,
    retrieval_metrics,
)
from training.losses import build_loss, loss_requires_num_classes
from training.models import (
    EmbeddingNet,
    TrunkFeatures,
    input_contract,
    random_start_notice,
)
from training.samplers import ClassBalancedBatchSampler
from training.telemetry import EpochClock, TrainingMetrics, epoch_line, epoch_logger, progress, start_line
from training.warm_start import initialise_from_features, warm_start_per_class
from training.weight_files import PACKAGE_PREFIX

if TYPE_CHECKING:
    import ray.train

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
RESULTS_FILE = "results.json"
SELECTION_SCORE = "selection_score"  # the metric Ray Train keeps checkpoints by
START_EPOCH = -1  # the history row of the network before any training step


def resolve_use_gpu(device: str, cluster_gpus: float) -> bool:
    """'auto' trains on GPUs when the Ray cluster has any; 'gpu' insists on them."""
    if device == "gpu" and cluster_gpus < 1:
        raise RuntimeError("device gpu requested but the Ray cluster reports no GPUs")
    return device == "gpu" or (device == "auto" and cluster_gpus >= 1)


def build_model(cfg: TrainConfig) -> EmbeddingNet:
    torch.manual_seed(cfg.seed)
    return EmbeddingNet(
        cfg.backbone,
        cfg.embedding_dim,
        cfg.pooling,
        cfg.pretrained,
        cfg.freeze_bn,
        image_size=cfg.image_size,
        drop_path=cfg.drop_path or 0.0,
    )


def build_loss_for(cfg: TrainConfig, num_classes: int, embedding_dim: int) -> torch.nn.Module:
    options = dict(cfg.loss_options)
    if loss_requires_num_classes(cfg.loss):
        options.update(num_classes=num_classes, embedding_dim=embedding_dim)
    return build_loss(cfg.loss, **options)


def build_optimizer(
    cfg: TrainConfig, model: EmbeddingNet, loss_fn: torch.nn.Module, steps_per_epoch: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a learning rate per group (backbone, head, proxies) and a cosine schedule.

    During the warm-up epochs the backbone's factor is 0: only the head (and proxies) learn
    while the pretrained features stay put, then the backbone follows its own cosine — after
    `warmup_steps` of linear warm-up, when the recipe has them. With `layer_decay` (a timm trunk)
    the backbone is several groups, one per layer (and weight decay or not), each at its
    `lr_scale` of the backbone's rate: the last layer at the rate, each one below at layer_decay ×
    the one above.
    """
    rates = {"backbone": cfg.backbone_lr or cfg.lr, "head": cfg.lr, "proxies": cfg.proxy_lr or cfg.lr}
    params = {**model.parameter_groups(), "proxies": [p for p in loss_fn.parameters() if p.requires_grad]}
    layered = model.layer_decay_groups(cfg.weight_decay, cfg.layer_decay) if cfg.layer_decay else None
    groups = []
    for name, ps in params.items():
        if name == "backbone" and layered is not None:
            groups += [
                {
                    "params": g["params"],
                    "lr": rates[name] * g["lr_scale"],
                    "weight_decay": g["weight_decay"],
                    "name": name,
                }
                for g in layered
                if g["params"]
            ]
        elif ps:
            groups.append({"params": ps, "lr": rates[name], "name": name})
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    total = max(1, cfg.epochs * steps_per_epoch)

    def schedule_from(start: int, warm: int):
        """0 before `start`, a linear rise over `warm` steps, then a cosine from 1 down to 0 at the last step."""
        span = max(1, total - start - warm)

        def factor(step: int) -> float:
            if step < start:
                return 0.0
            if step < start + warm:
                return (step - start + 1) / (warm + 1)
            return 0.5 * (1.0 + math.cos(math.pi * min(step - start - warm, span) / span))

        return factor

    warmup = cfg.warmup_epochs * steps_per_epoch
    factors = [
        schedule_from(warmup, cfg.warmup_steps or 0) if g["name"] == "backbone" else schedule_from(0, 0) for g in groups
    ]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The rate of each named group; of a backbone in layer-decay groups, its top layer's."""
    rates: dict[str, float] = {}
    for group in optimizer.param_groups:
        rates[group["name"]] = max(rates.get(group["name"], 0.0), group["lr"])
    return rates


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


def _load_eval(splits: dict[str, str], name: str, cfg: TrainConfig, contract) -> EvalImages | None:
    if name not in splits:
        return None
    return EvalImages(read_catalog(splits[name]), contract, cfg.data_mode, cfg.loader_workers, cfg.max_bad_fraction)


@dataclass
class Trainable:
    """What a worker trains and a checkpoint restores: the network (as Ray Train prepared it), the
    loss (its proxies), the optimiser and its schedule."""

    model: torch.nn.Module
    loss_fn: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class Record:
    """What a run has told so far, checkpointed beside the weights: the best epoch, a history row
    per epoch, and when it was resumed."""

    best: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"epoch": -1, SELECTION_SCORE: -1.0, "val_recall_at_1": None}
    )
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumed: list[dict[str, Any]] = dataclasses.field(default_factory=list)


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
    val = _load_eval(splits, "val", cfg, contract) if rank == 0 else None

    device = ray.train.torch.get_device()
    net = build_model(cfg).to(device)
    loss_fn = build_loss_for(cfg, len(train_catalog.classes), net.embedding_dim)
    if ray.train.get_checkpoint() is None and (cfg.head_init, cfg.proxy_init) != ("random", "random"):
        sample = slice_catalog(train_catalog, None, warm_start_per_class(len(train_catalog.classes)))
        images = EvalImages(sample, contract, cfg.data_mode, cfg.loader_workers, cfg.max_bad_fraction)
        features, codes = images.embed(TrunkFeatures(net), device)
        initialise_from_features(net, loss_fn, features, codes, len(images.classes), cfg.head_init, cfg.proxy_init)
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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The network itself, where Ray Train's `prepare_model` wrapped it (DDP's `.module`)."""
    return model.module if hasattr(model, "module") else model


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
    best_ckpt = result.get_best_checkpoint(SELECTION_SCORE, "max") or result.checkpoint
    if best_ckpt is None:
        raise RuntimeError("training finished without a checkpoint")
    with best_ckpt.as_directory() as d:
        state = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
    with result.checkpoint.as_directory() as d:
        last = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)

    model = build_model(cfg)
    model.load_state_dict(state["model"])
    contract = input_contract(cfg.backbone, cfg.image_size, cfg.pretrained)
    evaluation, similarities = evaluate_test_classes(cfg, splits, contract, model)

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
                "train_seconds": train_seconds,
                "num_workers": cfg.num_workers,
                "use_gpu": use_gpu,
            },
        )
    shutil.rmtree(work, ignore_errors=True)
    return out


def evaluate_test_classes(
    cfg: TrainConfig, splits: dict[str, Path], contract, model: torch.nn.Module
) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Recall@K, MAP@R and NMI on the test classes, for the trained network and where it started,
    and each one's positive and negative pair similarities (for the histogram plot).

    Where it started: with --pretrained, the pretrained network as it is (pooled trunk features,
    no head — what `export --pretrained` publishes, the figure fine-tuning has to beat);
    otherwise the untrained network. In-shop has no single test set: its queries are searched
    in its gallery.
    """
    if cfg.pretrained is not None:
        untrained_model = EmbeddingNet(cfg.backbone, None, cfg.pooling, cfg.pretrained, image_size=cfg.image_size)
    else:
        untrained_model = build_model(cfg)
    if "query" in splits:
        query = _load_eval(splits, "query", cfg, contract)
        gallery = _load_eval(splits, "gallery", cfg, contract)

        def score(net):
            (q, q_codes), (g, g_codes) = query.embed(net), gallery.embed(net)
            qlabels = np.asarray(query.classes, dtype=object)[q_codes]
            glabels = np.asarray(gallery.classes, dtype=object)[g_codes]
            return query_gallery_metrics(q, qlabels, g, glabels, cfg.ks), g, g_codes

        test_images, test_classes = len(query) + len(gallery), len(gallery.classes)
    else:
        test = _load_eval(splits, "test", cfg, contract)

        items = [m.get(ITEM_COLUMN) for m in test.catalog.metadata]

        def score(net):
            embeddings, codes = test.embed(net)
            metrics = retrieval_metrics(embeddings, codes, cfg.ks, with_nmi=True)
            # A catalog of items (several images each) is scored by item too, where every row
            # names its item and every image was read (so rows and embeddings line up).
            if all(items) and len(items) == len(embeddings):
                metrics["item_recall_at_k"] = item_recall(embeddings, items, cfg.ks)
            return metrics, embeddings, codes

        test_images, test_classes = len(test), len(test.classes)
    untrained, untrained_embeddings, labels = score(untrained_model)
    trained, trained_embeddings, _ = score(model)
    skipped = query.skipped + gallery.skipped if "query" in splits else test.skipped
    similarities = {
        "untrained": pair_similarities(untrained_embeddings, labels),
        "trained": pair_similarities(trained_embeddings, labels),
    }
    overlap = {name: histogram_overlap(*pairs) for name, pairs in similarities.items()}
    return {
        "untrained": {**untrained, "histogram_overlap": overlap["untrained"]},
        "trained": {**trained, "histogram_overlap": overlap["trained"]},
        "test_images": test_images,
        "test_classes": test_classes,
        "skipped_test_images": skipped,
    }, similarities


def write_plots(directory: Path, history: list[dict[str, Any]], similarities: dict, overlaps: dict[str, float]) -> None:
    from training.plots import plot_recall_per_epoch, plot_similarity_histograms

    if any("val_recall_at_1" in row for row in history):  # only runs with validation classes have them
        plot_recall_per_epoch(history, directory / "recall_per_epoch.png")
    plot_similarity_histograms(similarities, directory / "similarity_histograms.png", overlaps)
