"""`training train`'s options (`TrainConfig`) and the named recipes that fill the schedule's unset ones.

A recipe (`RECIPES`) names defaults for the rates, warm-up, BatchNorm and start; a backbone family
may change some of them (`FAMILY_RECIPES`: a transformer trunk is fine-tuned its authors' way). An
explicit flag always wins over the recipe. `training/runs/train.py` runs what a `TrainConfig` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import DEVICES, option
from training.data.splits import AUGMENTATIONS, DATA_MODES
from training.losses import get_loss_class
from training.models.backbone_specs import ALL_POOLINGS
from training.models.models import EmbeddingNet, backbone_spec, check_backbone
from training.models.warm_start import HEAD_INITS, PROXY_INITS
from training.models.weight_files import WEIGHTS_HELP, resolve_weights

__all__ = ["FAMILY_RECIPES", "RECIPES", "TrainConfig", "recipe_line", "recipe_values"]

# Named defaults for the optimiser's schedule and the start; every value is still its own flag.
# `finetune` (chosen when --pretrained is given) follows the ProxyAnchor authors' recipe — a
# small backbone rate, proxies at 100× it, the backbone held for a warm-up epoch, BatchNorm
# frozen — and adds what the icon set measured it needs to beat the pretrained start
# (`benchmarks/bench_finetune.py`): the head and proxies fitted to the start's features
# (`training/models/warm_start.py`) and a longer schedule.
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
            from training.data.datasets import get_dataset

            get_dataset(self.dataset)  # unknown names fail here, listing the known ones
        if self.ks is None:
            from training.data.datasets import get_dataset

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
