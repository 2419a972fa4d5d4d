"""Ray Train training of an embedding model with a metric-learning loss.

The driver prepares class-disjoint split catalogs, runs `TorchTrainer` (local Ray unless
RAY_ADDRESS names a cluster), keeps the checkpoint with the best validation Recall@1, and
evaluates it — and the untrained network — on the test classes. It publishes a run directory:
`checkpoint.pt`, `results.json`, `config.json`, `splits/`.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.artifacts import staging_directory, utc_now, write_json_atomic
from core.catalog import read_catalog
from core.cli import init_ray, verbose
from core.config import DEVICES, option, to_jsonable
from training.data import (
    AUGMENTATIONS,
    DATA_MODES,
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
    pair_similarities,
    query_gallery_metrics,
    retrieval_metrics,
)
from training.losses import build_loss, get_loss_class, loss_requires_num_classes
from training.models import (
    ALL_POOLINGS,
    PACKAGE_PREFIX,
    WEIGHTS_HELP,
    EmbeddingNet,
    TrunkFeatures,
    backbone_spec,
    check_backbone,
    input_contract,
    resolve_weights,
)
from training.samplers import ClassBalancedBatchSampler
from training.telemetry import EpochClock, TrainingMetrics, epoch_line, epoch_logger, progress, start_line
from training.warm_start import HEAD_INITS, PROXY_INITS, initialise_from_features, warm_start_per_class

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
RESULTS_FILE = "results.json"
SELECTION_SCORE = "selection_score"  # the metric Ray Train keeps checkpoints by
START_EPOCH = -1  # the history row of the network before any training step

# Named defaults for the optimiser's schedule and the start; every value is still its own flag.
# `finetune` (chosen when --pretrained is given) follows the ProxyAnchor authors' recipe — a
# small backbone rate, proxies at 100× it, the backbone held for a warm-up epoch, BatchNorm
# frozen — and adds what the icon set measured it needs to beat the pretrained start
# (`benchmarks/bench_finetune.py`): the head and proxies fitted to the start's features
# (`training/warm_start.py`) and a longer schedule.
RECIPES: dict[str, dict[str, Any]] = {
    "scratch": {
        "lr": 1e-3,
        "backbone_lr": None,
        "proxy_lr": None,
        "warmup_epochs": 0,
        "freeze_bn": False,
        "head_init": "random",
        "proxy_init": "random",
        "epochs": 6,
        "weight_decay": 1e-4,
        "layer_decay": None,
        "warmup_steps": 0,
        "drop_path": 0.0,
    },
    "finetune": {
        "lr": 1e-4,
        "backbone_lr": 1e-4,
        "proxy_lr": 1e-2,
        "warmup_epochs": 1,
        "freeze_bn": True,
        "head_init": "pca",
        "proxy_init": "class_means",
        "epochs": 10,
        "weight_decay": 1e-4,
        "layer_decay": None,
        "warmup_steps": 0,
        "drop_path": 0.0,
    },
}
# What a recipe changes for a transformer trunk (a timm ViT: DINOv2, CLIP, SigLIP towers), on
# top of the recipe. Fine-tuning a ViT the way its authors fine-tune one (BEiT, MAE, DINOv2's
# linear-probe-then-finetune; timm's fine-tuning defaults): AdamW at weight decay 0.05, none on
# norms, biases, position embeddings and class token; layer-wise rate decay 0.75, so the patch
# embedding and first blocks — the general features a metric-learning loss on a few thousand
# images would otherwise overwrite first — move at a few percent of the last block's rate; a
# linear warm-up of the backbone over 100 steps rather than a held epoch (the layer decay already
# keeps the trunk near its start, and there is no BatchNorm whose statistics a held epoch protects);
# drop path 0.1 (DeiT-S/ViT-S's own). The backbone's top rate is 3e-5: Hyp-ViT and OML's ViT-S/16
# fine-tunes on SOP use 1e-5 to 3e-5 for the trunk, 10× below a CNN's, because a ViT's pretrained
# features are richer and its optimisation less forgiving. CNNs keep the recipe as it is.
FAMILY_RECIPES: dict[tuple[str, str], dict[str, Any]] = {
    ("finetune", "transformer"): {
        "backbone_lr": 3e-5,
        "weight_decay": 0.05,
        "layer_decay": 0.75,
        "warmup_epochs": 0,
        "warmup_steps": 100,
        "drop_path": 0.1,
        "freeze_bn": False,
    },
}


def recipe_values(recipe: str, family: str) -> dict[str, Any]:
    """The defaults of `recipe` for a backbone of `family` (transformer or cnn)."""
    return {**RECIPES[recipe], **FAMILY_RECIPES.get((recipe, family), {})}


@dataclass
class TrainConfig:
    """`training train`: one Ray Train run, from data to the published run directory."""

    out: str = option("runs/train", help="run directory to publish")
    catalog: str | None = option(None, help="catalog file or class-folder tree (default: the embedded glyph set)")
    dataset: str | None = option(None, help="a benchmark in its published layout: cub, cars196, sop, inshop")
    data_root: str | None = option(None, help="folder holding the --dataset (never downloaded)")
    data_dir: str = option("data/glyphs", help="glyph set cache directory")
    backbone: str = option(
        "small_cnn",
        help="small_cnn, resnet18, resnet50, googlenet, efficientnet_b0, mobilenet_v2, mobilenet_v3_large; "
        "timm trunks vit_small_patch16, vit_small_patch14_dinov2, vit_base_patch16_clip, convnext_tiny, "
        "efficientnetv2_s, or any timm architecture as timm:<architecture>",
    )
    embedding_dim: int | None = option(128, help="the head's width, or 'none': no head (the trunk's pooled features)")
    pooling: str | None = option(
        None,
        choices=ALL_POOLINGS,
        help="how the trunk's features become a vector: gap/gmp/gap+gmp of a CNN's map, a transformer's cls "
        "token, mean of its patch tokens, or map (its attention pooling); default: the backbone's own",
    )
    pretrained: str | None = option(
        None,
        help=WEIGHTS_HELP,
    )
    image_size: int | None = option(None, help="input side in px (default: the backbone's)")
    loss: str = option("raw_vthm", help="loss name from the registry (raw_vthm, proxy_anchor, ...)")
    loss_options: dict[str, Any] = option(
        default_factory=dict, help="the loss's options as JSON, e.g. '{\"alpha\": 2}'"
    )
    epochs: int | None = option(None, help="default: the recipe's (scratch 6, finetune 10)")
    classes_per_batch: int = option(20, help="classes in a batch (C of the C×K sampler)")
    samples_per_class: int = option(5, help="images of each class in a batch (K)")
    batches_per_epoch: int | None = option(None, help="an epoch's length (default: the training images once)")
    recipe: str | None = option(
        None,
        choices=tuple(RECIPES),
        help="named defaults for the rates, warm-up and BatchNorm (default: finetune with --pretrained, else scratch)",
    )
    lr: float | None = option(None, help="the head's rate (default: the recipe's)")
    backbone_lr: float | None = option(None, help="the backbone's rate (default: the recipe's; scratch: --lr)")
    proxy_lr: float | None = option(None, help="the proxies' rate (default: the recipe's; scratch: --lr)")
    weight_decay: float | None = option(
        None, help="AdamW weight decay (default: the recipe's; transformers 0.05, none on norms and biases)"
    )
    warmup_epochs: int | None = option(
        None, help="epochs with the backbone frozen (rate 0, BatchNorm statistics kept; default: the recipe's)"
    )
    warmup_steps: int | None = option(
        None, help="steps of the backbone's linear warm-up to its rate (default: the recipe's; transformers 100)"
    )
    layer_decay: float | None = option(
        None,
        help="layer-wise rate decay of a timm trunk: each layer below the last at this × the rate of the one above "
        "(default: the recipe's; transformers 0.75; 1 or none: off)",
    )
    drop_path: float | None = option(
        None, help="stochastic depth rate of a timm trunk (default: the recipe's; transformers 0.1)"
    )
    freeze_bn: bool | None = option(None, help="BatchNorm frozen throughout (default: the recipe's)")
    head_init: str | None = option(
        None, choices=HEAD_INITS, help="random, or pca: fitted to the start's features (default: the recipe's)"
    )
    proxy_init: str | None = option(
        None,
        choices=PROXY_INITS,
        help="random, or class_means: of the start's embeddings (default: the recipe's)",
    )
    augment: str | None = option(
        None, choices=AUGMENTATIONS, help="default: crop+flip for photos, none for the glyph set"
    )
    data_mode: str = option(
        "auto", choices=DATA_MODES, help="memory, lazy (decode per batch), auto (memory when it fits 1 GiB)"
    )
    loader_workers: int = option(2, help="decoding processes per Ray worker in lazy mode")
    seed: int = option(0, help="model initialisation and sampling seed")
    split_seed: int = option(0, help="seed of the class-disjoint train/val/test split")
    test_fraction: float = option(0.5, help="fraction of the classes held out for testing")
    val_fraction: float = option(0.1, help="fraction of the training classes held out for model selection")
    max_classes: int | None = option(None, help="use a slice of the classes (quick runs)")
    max_per_class: int | None = option(None, help="use at most N images per class")
    ks: list[int] | None = option(None, help="K values for Recall@K (default: the dataset's usual; else 1,2,4,8)")
    num_workers: int = option(1, help="Ray Train workers")
    device: str = option("auto", choices=DEVICES, help="where Ray Train's workers run: gpu when the cluster has GPUs")
    max_bad_fraction: float = option(0.01, help="fail when more of the images than this cannot be read")
    max_failures: int = option(2, help="worker failures Ray Train recovers from (from the last checkpoint)")
    resume: bool = option(False, help="continue the stopped run that left its work directory beside --out")
    progress: bool | None = option(None, help="progress bar and lines (default: a bar when stderr is a terminal)")
    metrics_export_port: int | None = option(None, help="local Ray: export its (and training's) metrics on this port")
    plots: bool = option(True, help="write PNG plots beside the results")

    def __post_init__(self) -> None:
        self._apply_recipe()
        if self.embedding_dim is not None and self.embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be positive (or none: no head), got {self.embedding_dim}")
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"head_init must be one of {', '.join(HEAD_INITS)}, got {self.head_init!r}")
        if self.proxy_init not in PROXY_INITS:
            raise ValueError(f"proxy_init must be one of {', '.join(PROXY_INITS)}, got {self.proxy_init!r}")
        positive = ("epochs", "classes_per_batch", "samples_per_class", "num_workers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        # Unknown names, a pooling or an input size the backbone cannot take fail here, before any
        # data is touched; the pooling left to the backbone becomes its own.
        self.pooling = check_backbone(self.backbone, self.pooling, self.image_size, self.drop_path)
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise ValueError(f"layer_decay must be in (0, 1], got {self.layer_decay}")
        if self.layer_decay is not None and self.layer_decay < 1 and backbone_spec(self.backbone).layer_groups is None:
            raise ValueError(
                f"--layer-decay {self.layer_decay}: {self.backbone} has no layers to decay over (timm trunks have)"
            )
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        get_loss_class(self.loss)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.catalog is not None and self.dataset is not None:
            raise ValueError("give either catalog or dataset, not both")
        if self.dataset is not None:
            from training.datasets import get_dataset

            get_dataset(self.dataset)  # unknown names fail here, listing the known ones
        if self.ks is None:
            from training.datasets import get_dataset

            self.ks = list(get_dataset(self.dataset).recall_ks) if self.dataset else [1, 2, 4, 8]
        if not self.ks or min(self.ks) <= 0:
            raise ValueError(f"ks must be positive integers, got {self.ks}")
        for name in ("warmup_epochs", "warmup_steps", "loader_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be fewer than epochs ({self.epochs})")
        for name in ("backbone_lr", "proxy_lr"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.augment is not None and self.augment not in AUGMENTATIONS:
            raise ValueError(f"augment must be one of {', '.join(AUGMENTATIONS)}, got {self.augment!r}")
        if self.data_mode not in DATA_MODES:
            raise ValueError(f"data_mode must be one of {', '.join(DATA_MODES)}, got {self.data_mode!r}")

    def check_inputs(self) -> None:
        """What reads files, before Ray starts: the catalog, the dataset's folder, the weights."""
        if self.catalog is not None and not Path(self.catalog).exists():
            raise ValueError(f"catalog not found: {self.catalog}")
        if self.dataset is not None and (self.data_root is None or not Path(self.data_root).is_dir()):
            raise ValueError(f"dataset {self.dataset} needs data_root, an existing folder; got {self.data_root}")
        if self.pretrained is not None:
            try:
                resolve_weights(self.pretrained)
            except FileNotFoundError as exc:
                raise ValueError(str(exc)) from None
            # Weights of another architecture, a truncated file: refused before anything is written.
            EmbeddingNet(self.backbone, None, self.pooling, self.pretrained, image_size=self.image_size)

    @property
    def family(self) -> str:
        """transformer or cnn: which of a recipe's variants applies (`FAMILY_RECIPES`)."""
        return "transformer" if backbone_spec(self.backbone).transformer else "cnn"

    def _apply_recipe(self) -> None:
        """Fill the schedule's unset values from the recipe for the backbone's family (an
        explicit flag always wins)."""
        if self.recipe is None:
            self.recipe = "finetune" if self.pretrained is not None else "scratch"
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; available: {', '.join(RECIPES)}")
        values = recipe_values(self.recipe, self.family)
        explicit = {name for name in values if getattr(self, name) is not None}
        for name, value in values.items():
            if name not in explicit:
                setattr(self, name, value)
        if "warmup_epochs" not in explicit and self.epochs > 0:
            self.warmup_epochs = min(self.warmup_epochs, self.epochs - 1)  # a 1-epoch run still trains

    @property
    def augmentation(self) -> str:
        # Mirrored characters are other characters (b/d, p/q): the glyph set is not flipped.
        if self.augment is not None:
            return self.augment
        return "none" if self.catalog is None and self.dataset is None else "crop+flip"


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


def recipe_line(cfg: TrainConfig) -> str:
    """What the recipe chose, for the log: every value below is also a flag."""
    line = (
        f"recipe {cfg.recipe} for a {cfg.family} ({cfg.backbone}): {cfg.epochs} epochs, head lr {cfg.lr:g}, "
        f"backbone lr {cfg.backbone_lr or cfg.lr:g}, proxy lr {cfg.proxy_lr or cfg.lr:g}, weight decay "
        f"{cfg.weight_decay:g}, {cfg.warmup_epochs} warm-up epoch(s) with the backbone held"
    )
    if cfg.warmup_steps:
        line += f", the backbone warmed up linearly over {cfg.warmup_steps} steps"
    if cfg.layer_decay and cfg.layer_decay < 1:
        line += f", layer-wise rate decay {cfg.layer_decay:g}"
    if cfg.drop_path:
        line += f", drop path {cfg.drop_path:g}"
    norm = "BatchNorm frozen" if cfg.freeze_bn else "BatchNorm training"
    if cfg.family == "transformer":
        norm = "LayerNorm training (no BatchNorm to freeze)"
    head = "none" if cfg.embedding_dim is None else f"{cfg.embedding_dim}-d, {cfg.head_init} init"
    return f"{line}, {norm}, head {head}, proxies {cfg.proxy_init}"


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
    model = ray.train.torch.prepare_model(net)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.loader_workers if isinstance(dataset, LazyImages) else 0,
        collate_fn=collate_skipping_unreadable,
        worker_init_fn=decoding_worker_init,
    )
    start_epoch, best = 0, {"epoch": -1, SELECTION_SCORE: -1.0, "val_recall_at_1": None}
    history: list[dict[str, Any]] = []
    resumed: list[dict[str, Any]] = []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / CHECKPOINT_FILE, map_location=device, weights_only=False)
        _unwrap(model).load_state_dict(state["model"])
        loss_fn.load_state_dict(state["loss"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best, history = state["epoch"] + 1, state["best"], state["history"]
        resumed = [*state.get("resumed", []), {"at_epoch": start_epoch, "time": utc_now()}]
        log.info("resuming at epoch %d from the last checkpoint", start_epoch)

    telemetry = TrainingMetrics(Path(cfg.out).name) if rank == 0 else None
    clock = EpochClock(cfg.epochs, start_epoch)

    def report(metrics: dict[str, Any], rates: dict[str, float]) -> None:
        """Validate (rank 0), keep the best, checkpoint and report one history row — every
        rank reports, as Ray Train requires."""
        nonlocal best
        epoch = metrics["epoch"]
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            if rank == 0:
                if val is not None:
                    scores = retrieval_metrics(*val.embed(_unwrap(model), device), cfg.ks)
                    metrics.update({f"val_recall_at_{k}": v for k, v in scores["recall_at_k"].items()})
                    metrics["val_map_at_r"] = scores["map_at_r"]
                metrics[SELECTION_SCORE] = selection_score(metrics, epoch)
                if metrics[SELECTION_SCORE] > best[SELECTION_SCORE]:
                    best = {"epoch": epoch, SELECTION_SCORE: metrics[SELECTION_SCORE]}
                    best["val_recall_at_1"] = metrics.get("val_recall_at_1")
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
                        "resumed": resumed,
                    },
                    Path(tmp) / CHECKPOINT_FILE,
                )
                ckpt = ray.train.Checkpoint.from_directory(tmp)
                if epoch == START_EPOCH:
                    epoch_logger().info(start_line(metrics, cfg.recipe))
                else:
                    telemetry.report_epoch(metrics, rates)
                    epoch_logger().info(epoch_line(metrics, rates, clock.eta_seconds(epoch), cfg.epochs))
            ray.train.report(metrics, checkpoint=ckpt)

    if start_epoch == 0 and "val" in splits:
        # Where training starts, on the validation classes: the first row of the history, and
        # the checkpoint published if no epoch beats it (fine-tuning that only hurts).
        report({"epoch": START_EPOCH, "skipped_images": skipped_up_front}, learning_rates(optimizer))
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        if epoch < cfg.warmup_epochs:
            _unwrap(model).backbone.eval()  # frozen: no BatchNorm statistics drift either
        started, losses, seen, skipped = time.perf_counter(), [], 0, 0
        for x, y, bad in progress(loader, len(sampler), epoch, cfg.epochs, bool(cfg.progress) and rank == 0):
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
        seconds = time.perf_counter() - started
        rates = learning_rates(optimizer)
        metrics: dict[str, Any] = {
            "epoch": epoch,
            "loss": float(np.mean(losses)) if losses else math.nan,
            **{f"lr_{group}": lr for group, lr in rates.items()},
            "images_per_s": (seen - skipped) * world / max(seconds, 1e-9),
            "skipped_images": skipped_up_front + skipped,
        }
        report(metrics, rates)


def _absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """The config with its input paths made absolute: Ray Train's workers do not run in the
    driver's working directory, so a relative --catalog would name nothing there."""
    paths = {}
    for name in ("catalog", "data_root", "data_dir", "pretrained"):
        value = getattr(cfg, name)
        if value is not None and not (name == "pretrained" and value.startswith(PACKAGE_PREFIX)):
            paths[name] = str(Path(value).resolve())
    return dataclasses.replace(cfg, **paths)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


# Options that may differ between a stopped run and its --resume (they change no result).
RESUMABLE_CHANGES = {"resume", "progress", "metrics_export_port", "max_failures", "plots", "out"}


def _work_directory(cfg: TrainConfig, out: Path) -> Path:
    """The run's work directory (splits, Ray storage): kept for --resume, fresh otherwise."""
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


def run_training(cfg: TrainConfig) -> Path:
    """Train, select by validation, evaluate on test classes, and publish the run directory."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    cfg.check_inputs()
    if cfg.progress is None:
        cfg = dataclasses.replace(cfg, progress=sys.stderr.isatty())
    cfg = _absolute_paths(cfg)
    out = Path(cfg.out).resolve()
    log.info(recipe_line(cfg))
    work = _work_directory(cfg, out)
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
    local = not os.environ.get("RAY_ADDRESS")
    init_ray(**({"_metrics_export_port": cfg.metrics_export_port} if cfg.metrics_export_port and local else {}))
    use_gpu = resolve_use_gpu(cfg.device, ray.cluster_resources().get("GPU", 0))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"train": to_jsonable(cfg), "splits": {k: str(v) for k, v in splits.items()}},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=use_gpu,
            resources_per_worker=None if use_gpu else {"CPU": 1},
        ),
        run_config=ray.train.RunConfig(
            name="train",  # the same (storage_path, name) is what lets --resume pick the run up
            storage_path=str(work / "ray"),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute=SELECTION_SCORE, checkpoint_score_order="max"
            ),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            # Ray Train narrates every checkpoint and report at INFO (configured by Ray itself,
            # in each worker); the epoch lines say what matters.
            logging_config=ray.train.LoggingConfig(log_level="INFO" if verbose() else "WARNING"),
        ),
    )
    started = time.perf_counter()
    result = trainer.fit()
    train_seconds = time.perf_counter() - started
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

        def score(net):
            embeddings, codes = test.embed(net)
            return retrieval_metrics(embeddings, codes, cfg.ks, with_nmi=True), embeddings, codes

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
