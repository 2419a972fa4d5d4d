"""Ray Train training of an embedding model with a metric-learning loss.

The driver prepares class-disjoint split catalogs, runs `TorchTrainer` (local Ray unless
RAY_ADDRESS names a cluster), keeps the checkpoint with the best validation Recall@1, and
evaluates it — and the untrained network — on the test classes. It publishes a run directory:
`checkpoint.pt`, `results.json`, `config.json`, `splits/`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index.artifacts import staging_directory, utc_now, write_json_atomic
from index.catalog import read_catalog
from index.config import to_jsonable
from training.data import load_images, prepare_splits
from training.evaluate import embed_images, retrieval_metrics
from training.losses import build_loss, get_loss_class, loss_requires_num_classes
from training.models import EmbeddingNet, backbone_spec, input_contract
from training.samplers import ClassBalancedBatchSampler

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
RESULTS_FILE = "results.json"


@dataclass
class TrainConfig:
    out: str = "runs/train"
    catalog: str | None = None  # None: the embedded glyph set
    data_dir: str = "data/glyphs"
    backbone: str = "small_cnn"
    embedding_dim: int = 128
    pooling: str = "gap"
    pretrained: str | None = None
    image_size: int | None = None
    loss: str = "raw_vthm"
    loss_options: dict[str, Any] = field(default_factory=dict)
    epochs: int = 6
    classes_per_batch: int = 20
    samples_per_class: int = 5
    batches_per_epoch: int | None = None
    lr: float = 1e-3
    proxy_lr: float | None = None
    weight_decay: float = 1e-4
    seed: int = 0
    split_seed: int = 0
    test_fraction: float = 0.5
    val_fraction: float = 0.1
    max_classes: int | None = None
    max_per_class: int | None = None
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_workers: int = 1
    use_gpu: str = "auto"
    max_bad_fraction: float = 0.01

    def __post_init__(self) -> None:
        positive = ("embedding_dim", "epochs", "classes_per_batch", "samples_per_class", "num_workers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not self.ks or min(self.ks) <= 0:
            raise ValueError(f"ks must be positive integers, got {self.ks}")
        if self.use_gpu not in ("auto", "true", "false"):
            raise ValueError(f"use_gpu must be auto, true or false, got {self.use_gpu!r}")
        backbone_spec(self.backbone)  # unknown names fail here, before any data is touched
        get_loss_class(self.loss)
        if self.pooling not in ("gap", "gmp", "gap+gmp"):
            raise ValueError(f"pooling must be gap, gmp or gap+gmp, got {self.pooling!r}")
        if self.catalog is not None and not Path(self.catalog).exists():
            raise ValueError(f"catalog not found: {self.catalog}")
        if self.pretrained is not None and not Path(self.pretrained).is_file():
            raise ValueError(f"pretrained weights file not found: {self.pretrained}")


def resolve_use_gpu(setting: str, cluster_gpus: float) -> bool:
    """'auto' trains on GPUs when the Ray cluster has any; 'true' insists on them."""
    if setting == "true" and cluster_gpus < 1:
        raise RuntimeError("use_gpu=true but the Ray cluster reports no GPUs")
    return setting == "true" or (setting == "auto" and cluster_gpus >= 1)


def build_model(cfg: TrainConfig) -> EmbeddingNet:
    torch.manual_seed(cfg.seed)
    return EmbeddingNet(cfg.backbone, cfg.embedding_dim, cfg.pooling, cfg.pretrained)


def build_loss_for(cfg: TrainConfig, num_classes: int) -> torch.nn.Module:
    options = dict(cfg.loss_options)
    if loss_requires_num_classes(cfg.loss):
        options.update(num_classes=num_classes, embedding_dim=cfg.embedding_dim)
    return build_loss(cfg.loss, **options)


def _set_threads(num_workers: int) -> None:
    # Workers share the machine's cores; oversubscription makes every worker slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_workers))


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: class-balanced batches, loss, validation, a checkpoint per epoch."""
    import ray.train
    import ray.train.torch

    cfg = TrainConfig(**config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    _set_threads(world)
    contract = input_contract(cfg.backbone, cfg.image_size)
    train = load_images(read_catalog(config["splits"]["train"]), contract, cfg.max_bad_fraction)
    val = (
        load_images(read_catalog(config["splits"]["val"]), contract, cfg.max_bad_fraction)
        if rank == 0 and "val" in config["splits"]
        else None
    )

    device = ray.train.torch.get_device()
    model = ray.train.torch.prepare_model(build_model(cfg))
    loss_fn = build_loss_for(cfg, len(train.classes)).to(device)
    groups = [{"params": list(model.parameters()), "lr": cfg.lr}]
    if any(True for _ in loss_fn.parameters()):
        groups.append({"params": list(loss_fn.parameters()), "lr": cfg.proxy_lr or cfg.lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    sampler = ClassBalancedBatchSampler(
        train.labels,
        cfg.classes_per_batch,
        cfg.samples_per_class,
        cfg.seed,
        rank,
        world,
        cfg.batches_per_epoch,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * len(sampler))
    start_epoch, best = 0, {"epoch": -1, "val_recall_at_1": -1.0}
    history: list[dict[str, Any]] = []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / CHECKPOINT_FILE, map_location=device, weights_only=False)
        _unwrap(model).load_state_dict(state["model"])
        loss_fn.load_state_dict(state["loss"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best, history = state["epoch"] + 1, state["best"], state["history"]

    images = torch.from_numpy(train.images)
    labels = torch.from_numpy(train.labels)
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        started, losses = time.perf_counter(), []
        for batch in sampler:
            x, y = images[batch].to(device), labels[batch].to(device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        seconds = time.perf_counter() - started
        metrics: dict[str, Any] = {
            "epoch": epoch,
            "loss": float(np.mean(losses)) if losses else math.nan,
            "lr": scheduler.get_last_lr()[0],
            "images_per_s": len(losses) * sampler.batch_size * world / max(seconds, 1e-9),
        }
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if rank == 0:
                if val is not None:
                    scores = retrieval_metrics(
                        embed_images(_unwrap(model), val.images, device=device), val.labels, cfg.ks
                    )
                    metrics.update({f"val_recall_at_{k}": v for k, v in scores["recall_at_k"].items()})
                    metrics["val_map_at_r"] = scores["map_at_r"]
                else:  # no validation classes: the last epoch is kept
                    metrics["val_recall_at_1"] = float(epoch)
                if metrics["val_recall_at_1"] > best["val_recall_at_1"]:
                    best = {"epoch": epoch, "val_recall_at_1": metrics["val_recall_at_1"]}
                metrics["best_epoch"] = best["epoch"]
                history.append(metrics)
                torch.save(
                    {
                        "model": _unwrap(model).state_dict(),
                        "loss": loss_fn.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "epoch": epoch,
                        "best": best,
                        "history": history,
                    },
                    Path(tmp) / CHECKPOINT_FILE,
                )
                ckpt = ray.train.Checkpoint.from_directory(tmp)
                log.info("epoch %d: %s", epoch, json.dumps(metrics))
            ray.train.report(metrics, checkpoint=ckpt)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def run_training(cfg: TrainConfig) -> Path:
    """Train, select by validation, evaluate on test classes, and publish the run directory."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    out = Path(cfg.out).resolve()
    work = out.with_name(f".{out.name}.work")
    splits = prepare_splits(
        cfg.catalog,
        work,
        cfg.data_dir,
        cfg.test_fraction,
        cfg.val_fraction,
        cfg.split_seed,
        cfg.max_classes,
        cfg.max_per_class,
    )
    train_classes = len(read_catalog(splits["train"]).classes)
    if train_classes < cfg.classes_per_batch:
        raise ValueError(
            f"classes_per_batch={cfg.classes_per_batch} but the training split has only "
            f"{train_classes} classes; lower --classes-per-batch or use more classes"
        )
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True, include_dashboard=False)
    use_gpu = resolve_use_gpu(cfg.use_gpu, ray.cluster_resources().get("GPU", 0))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"train": to_jsonable(cfg), "splits": {k: str(v) for k, v in splits.items()}},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=use_gpu,
            resources_per_worker=None if use_gpu else {"CPU": 1},
        ),
        run_config=ray.train.RunConfig(
            name="train",
            storage_path=str(work / "ray"),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_recall_at_1", checkpoint_score_order="max"
            ),
            failure_config=ray.train.FailureConfig(max_failures=2),
        ),
    )
    started = time.perf_counter()
    result = trainer.fit()
    train_seconds = time.perf_counter() - started
    best_ckpt = result.get_best_checkpoint("val_recall_at_1", "max") or result.checkpoint
    if best_ckpt is None:
        raise RuntimeError("training finished without a checkpoint")
    with best_ckpt.as_directory() as d:
        state = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)

    contract = input_contract(cfg.backbone, cfg.image_size)
    test = load_images(read_catalog(splits["test"]), contract, cfg.max_bad_fraction)
    untrained = retrieval_metrics(embed_images(build_model(cfg), test.images), test.labels, cfg.ks)
    model = build_model(cfg)
    model.load_state_dict(state["model"])
    trained = retrieval_metrics(embed_images(model, test.images), test.labels, cfg.ks)
    with result.checkpoint.as_directory() as d:
        history = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)["history"]

    with staging_directory(out) as staging:
        torch.save(
            {"model": state["model"], "config": to_jsonable(cfg), "contract": contract.to_dict()},
            staging / CHECKPOINT_FILE,
        )
        for name, path in splits.items():
            (staging / "splits").mkdir(exist_ok=True)
            read_catalog(path).write(staging / "splits" / f"{name}.csv")
        write_json_atomic(staging / "config.json", to_jsonable(cfg))
        write_json_atomic(
            staging / RESULTS_FILE,
            {
                "created": utc_now(),
                "best_epoch": state["best"]["epoch"],
                "val_recall_at_1": state["best"]["val_recall_at_1"],
                "untrained": untrained,
                "trained": trained,
                "history": history,
                "train_seconds": train_seconds,
                "num_workers": cfg.num_workers,
                "use_gpu": use_gpu,
                "test_images": len(test.ids),
                "test_classes": len(test.classes),
                "skipped_test_images": test.skipped,
            },
        )
    shutil.rmtree(work, ignore_errors=True)
    return out
