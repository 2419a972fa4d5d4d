"""What a `training train` worker trains, built from the run's options: the network, the loss
(with its proxies), and the optimiser with its per-group rates and cosine schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from training.losses import build_loss, loss_requires_num_classes
from training.models.models import EmbeddingNet
from training.runs.config import TrainConfig


@dataclass
class Trainable:
    """What a worker trains and a checkpoint restores: the network (as Ray Train prepared it), the
    loss (its proxies), the optimiser and its schedule."""

    model: torch.nn.Module
    loss_fn: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The network itself, where Ray Train's `prepare_model` wrapped it (DDP's `.module`)."""
    return model.module if hasattr(model, "module") else model
