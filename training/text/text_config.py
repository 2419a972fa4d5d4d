"""`training train-text`'s options (`TrainTextConfig`), checked as they are made."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import DEVICES, option
from training.models.text_models import LitTowerSpec

DEFAULT_MODEL = "runs/model"


@dataclass
class TrainTextConfig:
    """`training train-text`: a LiT text tower for a locked image model, on Ray Train."""

    out: str = option("runs/text", help="run directory to publish (what `training export --text` reads)")
    model: str = option(DEFAULT_MODEL, help="the image model artifact, locked: its images are embedded once")
    catalog: str | None = option(
        None, help="catalog of the seen classes (default: the image model's training splits, train and val)"
    )
    unseen_catalog: str | None = option(
        None,
        help="catalog of classes the text tower never sees, measured apart (default: the image model's test "
        "split when --catalog is not given)",
    )
    caption_field: str | None = option(
        None,
        help="the catalog column holding each image's caption (default: the label's name — a glyph's Unicode "
        "name, any other label with '-' and '_' as spaces)",
    )
    heldout_fraction: float = option(
        0.2, help="fraction of each seen class's images held out of text training, to measure on"
    )
    split_seed: int = option(0, help="seed of the held-out images")
    context_length: int = option(
        LitTowerSpec.context_length, help="token ids a caption may take, start and end included"
    )
    tower_width: int = option(LitTowerSpec.width, help="the text transformer's width")
    tower_heads: int = option(LitTowerSpec.heads, help="its attention heads")
    tower_layers: int = option(LitTowerSpec.layers, help="its layers")
    epochs: int = option(10, help="passes over the training images")
    batch_size: int = option(64, help="distinct captions a step, one image each (at most the distinct captions)")
    steps_per_epoch: int | None = option(None, help="an epoch's steps (default: the training images once)")
    lr: float = option(5e-4, help="AdamW learning rate (peak, then cosine to 0)")
    weight_decay: float = option(0.01, help="AdamW weight decay of the tower (none on the temperature)")
    warmup_steps: int = option(50, help="steps of linear warm-up to the rate")
    temperature: float = option(0.07, help="the starting temperature of the loss; learned")
    seed: int = option(0, help="tower initialisation and sampling seed")
    ks: list[int] = option(default_factory=lambda: [1, 5, 10], help="K values of text → image Recall@K")
    device: str = option("auto", choices=DEVICES, help="where the image embedding and Ray Train's worker run")
    max_bad_fraction: float = option(0.01, help="fail when more of the images than this cannot be read")
    max_failures: int = option(2, help="worker failures Ray Train recovers from (from the last checkpoint)")
    resume: bool = option(False, help="continue the stopped run that left its work directory beside --out")
    progress: bool = option(
        True, help="while the images are embedded: a bar on a terminal, a line every ~30 s otherwise (default: on)"
    )
    plots: bool = option(True, help="write the loss and recall plot beside the results")

    def __post_init__(self) -> None:
        for name in ("context_length", "tower_width", "tower_heads", "tower_layers", "epochs", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.context_length < 3:
            raise ValueError(f"context_length must be at least 3 (start, one token, end), got {self.context_length}")
        if self.tower_width % self.tower_heads:
            raise ValueError(f"tower_width ({self.tower_width}) must be a multiple of tower_heads ({self.tower_heads})")
        if self.steps_per_epoch is not None and self.steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch must be positive, got {self.steps_per_epoch}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be between 0 and 1, got {self.heldout_fraction}")
        for name in ("lr", "temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("weight_decay", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.ks or min(self.ks) <= 0:
            raise ValueError(f"ks must be positive integers, got {self.ks}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.caption_field is not None and not self.caption_field.strip():
            raise ValueError("caption_field is empty: name a catalog column, or leave it out for the label's name")

    @property
    def spec(self) -> LitTowerSpec:
        return LitTowerSpec(self.context_length, self.tower_width, self.tower_heads, self.tower_layers)
