"""`training train-text`: a text tower trained into a locked image model's space (LiT).

Locked-image text Tuning (Zhai et al., CVPR 2022): the image model — an exported model artifact,
`--model` — stays as it is. Its embeddings of the catalog's images are computed once, by the ONNX
Runtime embedder index and serving use (so the tower learns the space queries are searched in),
and a text tower (`training/text_models.py`: open_clip's `TextTransformer`, CLIP's BPE ids) learns
to put each image's caption near them under a symmetric InfoNCE loss with a learned temperature
(`training/losses/image_text.py`).

Data. The seen classes are the image model's own training classes (its manifest's
`training_data` splits `train` and `val`), or `--catalog`'s. An image's caption is its
`--caption-field` column or, by default, its label's name (`label_caption`: a glyph's Unicode
character name, "LATIN CAPITAL LETTER A"; any other label with '-' and '_' as spaces, an icon's
"document open"). A seeded `--heldout-fraction` of each seen class's images (the glyph set: some
of its fonts) never reaches text training. The unseen classes are the image model's test split
(or `--unseen-catalog`): neither tower trained on them, and their names were never read.

Batches. Captions are mostly class-level, many images sharing one. A step takes `--batch-size`
distinct captions and one image of each (`DistinctCaptionBatches`), so every in-batch negative is
another caption's image; with two images of one caption in a batch, the loss would push each away
from the caption they share.

Evaluation, before the first epoch and after each: text → image Recall@K (`core.metrics`). Each
distinct caption of a gallery's images queries it by exact inner product; a hit is an image of the
caption's class among the K nearest. `seen`: the seen classes' captions against their held-out
images; `unseen`: the unseen classes' captions against their images. Beside each, the Recall@K a
random ranking has on that gallery (`chance_recall_at_k`). The tower published is the last
epoch's: no figure selects it, so both are honest.

Ray Train runs the steps (`TorchTrainer`, one worker: a few million parameters over cached vectors
gain nothing from DDP) with a checkpoint per epoch through `ray.train.report`. `--resume` continues
a stopped run from its work directory beside `--out`, the cached embeddings included.

The run directory (`--out`) is what `training export --text` reads; `load_text_run(run)` returns it
as a `TextRun` (the tower built and loaded, and what its manifest needs):

- `checkpoint.pt` (`RUN_CHECKPOINT`), a `torch.save` dict with the keys `RUN_KEYS`:
  `model` — the `TextEmbeddingNet`'s state_dict, for `build_lit_tower(embedding_dim, LitTowerSpec(**spec))`;
  `spec` — `LitTowerSpec.to_dict()`; `image_model_id`, `embedding_dim` — the locked image model's
  (`ModelManifest`); `parity_texts` — up to `PARITY_TEXTS` captions, seen then unseen, for the
  export's parity check; `temperature` — the learned one; `config` — the resolved `TrainTextConfig`.
- `results.json`: `evaluation` (`{"seen": …, "unseen": …}`, each `recall_at_k`, `chance_recall_at_k`,
  `captions`, `images`, `classes`; `unseen` absent without unseen classes), `history` (a row per
  epoch, the first before training), `image_model`, `train_images`, `train_captions`,
  `train_seconds`, `use_gpu`, `resumed`.
- `config.json`: the resolved options.
- `captions/{train,heldout,unseen}.csv`: the catalogs trained and measured on, with a `caption` column.
- `text_training.png` (unless `--no-plots`): loss and Recall@K per epoch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.artifacts import MANIFEST, MODEL_FILE, staging_directory, utc_now, write_json_atomic
from core.catalog import COLUMNS, LABEL, Catalog, read_catalog
from core.config import DEVICES, option, to_jsonable
from core.metrics import query_gallery_recall_at_k, stable_order
from core.model_manifests import ModelManifest
from core.text import TOKENIZER_FILE, TextTokenizer
from index.build.embed import check_bad_rows, embed_catalog
from index.embedder import OnnxEmbedder
from training.losses.image_text import ImageTextContrastiveLoss
from training.telemetry import EpochClock, epoch_logger
from training.text_models import LitTowerSpec, TextEmbeddingNet, build_lit_tower
from training.train import (
    CHECKPOINT_FILE,
    RESULTS_FILE,
    START_EPOCH,
    Trainable,
    fit_on_ray,
    resume_point,
    save_checkpoint,
    unwrap,
    work_directory,
)

log = logging.getLogger(__name__)

RUN_CHECKPOINT = "checkpoint.pt"
RUN_KEYS = ("model", "spec", "image_model_id", "embedding_dim", "parity_texts", "temperature", "config")
PARITY_TEXTS = 64
CAPTION_COLUMN = "caption"  # the caption as the run's captions/*.csv write it
PLOT_FILE = "text_training.png"
DATA_FILE = "text_data.npz"  # the work directory's cached embeddings and token ids
TEXTS_FILE = "texts.json"
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
    progress: bool = option(False, help="a progress bar while the images are embedded")
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


# ---------------------------------------------------------------------------------------------
# Captions and the data the worker trains on


def label_caption(label: str) -> str:
    """A class's name in words: a glyph's Unicode character name, otherwise the label with '-'
    and '_' as spaces (an icon's freedesktop name)."""
    from training.glyphs import CODE_POINT_LABEL, character_name
    from training.icons import icon_caption

    return character_name(label) if CODE_POINT_LABEL.fullmatch(label) else icon_caption(label)


def captions_of(catalog: Catalog, field: str | None, flag: str) -> list[str]:
    """Each row's caption: its `field` column, else its label's name; ValueError naming the
    rows without one."""
    labels = catalog.require_labels("text → image evaluation")
    if field is None:
        return [label_caption(label) for label in labels]
    if field == LABEL:
        return list(labels)
    if not any(field in m for m in catalog.metadata):
        columns = [*COLUMNS, *sorted({k for m in catalog.metadata for k in m})]
        raise ValueError(
            f"--caption-field {field}: {catalog.source} ({flag}) has no such column; its columns: {', '.join(columns)}"
        )
    captions = [m.get(field, "").strip() for m in catalog.metadata]
    empty = [row + 1 for row, text in enumerate(captions) if not text]
    if empty:
        shown = ", ".join(map(str, empty[:5])) + (" ..." if len(empty) > 5 else "")
        raise ValueError(
            f"{catalog.source} ({flag}): {len(empty)} of {len(captions)} rows have an empty caption in column "
            f"{field} (row {shown}); every image needs one"
        )
    return captions


def heldout_rows(catalog: Catalog, fraction: float, seed: int) -> np.ndarray:
    """A mask of the rows held out of text training: `fraction` of each class's images (at least
    one where the class has two or more), chosen by a seeded stable order of their ids."""
    labels = np.asarray(catalog.require_labels("held-out images"), dtype=object)
    order = stable_order(catalog.ids, seed)
    held = np.zeros(len(catalog), dtype=bool)
    for label in dict.fromkeys(labels):
        rows = order[labels[order] == label]
        if len(rows) >= 2:
            held[rows[: min(len(rows) - 1, max(1, round(fraction * len(rows))))]] = True
    return held


@dataclass
class Gallery:
    """One evaluation: images (their embeddings and class codes) and the distinct captions that
    query them (text indices and class codes)."""

    embeddings: np.ndarray
    labels: np.ndarray
    query_texts: np.ndarray
    query_labels: np.ndarray


@dataclass
class TextData:
    """What the worker reads: every distinct text's token ids, the training images' embeddings
    with the text each is captioned by, and the galleries measured."""

    token_ids: np.ndarray  # (texts, context_length) int64
    train_embeddings: np.ndarray
    train_texts: np.ndarray
    galleries: dict[str, Gallery]

    @property
    def embedding_dim(self) -> int:
        return int(self.train_embeddings.shape[1])

    def save(self, path: Path) -> None:
        arrays = {
            "token_ids": self.token_ids,
            "train_embeddings": self.train_embeddings,
            "train_texts": self.train_texts,
        }
        for name, gallery in self.galleries.items():
            arrays.update({f"{name}.{k}": v for k, v in dataclasses.asdict(gallery).items()})
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path: Path) -> TextData:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
        names = sorted({k.split(".")[0] for k in arrays if "." in k})
        galleries = {
            n: Gallery(**{f.name: arrays[f"{n}.{f.name}"] for f in dataclasses.fields(Gallery)}) for n in names
        }
        return cls(arrays["token_ids"], arrays["train_embeddings"], arrays["train_texts"], galleries)


def check_model(model: str) -> ModelManifest:
    """The image model's manifest; ValueError saying what is missing."""
    directory = Path(model)
    if not directory.is_dir():
        raise ValueError(f"--model {model}: no such directory; export an image model first (python -m training export)")
    for name in (MANIFEST, MODEL_FILE):
        if not (directory / name).is_file():
            raise ValueError(f"--model {model} has no {name}: not an image model artifact (training export writes one)")
    return ModelManifest.read(directory)


def source_catalogs(cfg: TrainTextConfig, manifest: ModelManifest) -> tuple[Catalog, Catalog | None]:
    """(the seen classes' catalog, the unseen classes' or None), read and checked."""

    def read(path: str, flag: str) -> Catalog:
        if not Path(path).exists():
            raise ValueError(f"{flag} {path}: no such file")
        catalog = read_catalog(path)
        catalog.require_labels("text → image evaluation")
        return catalog

    if cfg.catalog is not None:
        seen = read(cfg.catalog, "--catalog")
        unseen = read(cfg.unseen_catalog, "--unseen-catalog") if cfg.unseen_catalog else None
    else:
        splits = (manifest.training_data or {}).get("splits") or {}
        if "train" not in splits:
            raise ValueError(
                f"--model {cfg.model} names no training splits (a pretrained export, or one made elsewhere): "
                "give --catalog"
            )
        for name, path in splits.items():
            if not Path(path).is_file():
                raise ValueError(
                    f"--model {cfg.model}: its {name} split {path} is gone (the training run was moved or removed): "
                    "give --catalog"
                )
        parts = [read_catalog(splits[name]) for name in ("train", "val") if name in splits]
        seen = Catalog(
            [i for c in parts for i in c.ids],
            [p for c in parts for p in c.paths],
            [label for c in parts for label in c.require_labels("text training")],
            [m for c in parts for m in c.metadata],
            source=f"{cfg.model}'s training splits",
        )
        unseen_path = cfg.unseen_catalog or splits.get("test")
        unseen = (
            read(unseen_path, "--unseen-catalog" if cfg.unseen_catalog else "the model's test split")
            if unseen_path
            else None
        )
    if unseen is not None:
        shared = set(seen.classes) & set(unseen.classes)
        if shared:
            raise ValueError(
                f"{unseen.source} shares {len(shared)} class(es) with the seen classes "
                f"({', '.join(sorted(shared)[:5])}): unseen classes must be others"
            )
    return seen, unseen


def tokenize(texts: Sequence[str], tokenizer: TextTokenizer) -> np.ndarray:
    """Token ids of every text; ValueError naming a caption the context cannot hold."""
    for text in texts:
        n = len(tokenizer.token_ids(text))
        if n > tokenizer.context_length:
            raise ValueError(
                f"caption {text!r} is {n} tokens with its start and end; --context-length {tokenizer.context_length} "
                "holds fewer: raise it or shorten the caption"
            )
    return tokenizer.encode(list(texts))


def embed(catalog: Catalog, embedder: OnnxEmbedder, cfg: TrainTextConfig) -> tuple[Catalog, np.ndarray]:
    """The locked image model's embeddings of a catalog's readable images, and those rows."""
    embeddings, kept, skipped = embed_catalog(catalog, embedder, progress=cfg.progress)
    check_bad_rows(len(catalog), len(kept), skipped, cfg.max_bad_fraction)
    return catalog.subset(kept), embeddings


def prepare_data(
    cfg: TrainTextConfig, manifest: ModelManifest, work: Path
) -> tuple[TextData, list[str], dict[str, Catalog]]:
    """Check the captions, embed the images once, and write what the worker trains on under
    `work`: the data, every distinct text, and the captioned catalogs (train, heldout, unseen)."""
    seen, unseen = source_catalogs(cfg, manifest)
    captions = {
        "seen": captions_of(seen, cfg.caption_field, "--catalog" if cfg.catalog else "the model's training splits")
    }
    if unseen is not None:
        captions["unseen"] = captions_of(unseen, cfg.caption_field, "the unseen classes")
    texts = list(dict.fromkeys(t for part in captions.values() for t in part))
    if len(set(captions["seen"])) < 2:
        raise ValueError(
            f"{seen.source}: the seen images have {len(set(captions['seen']))} distinct caption(s); "
            "contrastive training needs two or more"
        )
    write_clip_bpe_once(work / TOKENIZER_FILE)
    token_ids = tokenize(texts, TextTokenizer(work / TOKENIZER_FILE, cfg.context_length))
    text_index = {t: i for i, t in enumerate(texts)}

    catalogs: dict[str, Catalog] = {}
    embedder = OnnxEmbedder(cfg.model, provider=cfg.device)
    seen_kept, seen_embeddings = embed(with_captions(seen, captions["seen"]), embedder, cfg)
    held = heldout_rows(seen_kept, cfg.heldout_fraction, cfg.split_seed)
    if not held.any():
        raise ValueError(f"{seen.source}: no seen class has two images, so none can be held out to measure on")
    catalogs["train"], catalogs["heldout"] = (
        seen_kept.subset(np.flatnonzero(~held)),
        seen_kept.subset(np.flatnonzero(held)),
    )
    parts = {"heldout": (catalogs["heldout"], seen_embeddings[held])}
    if unseen is not None:
        catalogs["unseen"], unseen_embeddings = embed(with_captions(unseen, captions["unseen"]), embedder, cfg)
        parts["unseen"] = (catalogs["unseen"], unseen_embeddings)

    def texts_of(catalog: Catalog) -> np.ndarray:
        return np.array([text_index[m[CAPTION_COLUMN]] for m in catalog.metadata], dtype=np.int64)

    galleries = {}
    for name, (catalog, embeddings) in parts.items():
        classes = catalog.classes
        labels = np.asarray(catalog.label_codes(classes), dtype=np.int64)
        queries = dict.fromkeys(zip(texts_of(catalog).tolist(), labels.tolist(), strict=True))
        galleries["seen" if name == "heldout" else name] = Gallery(
            embeddings, labels, np.array([q[0] for q in queries], np.int64), np.array([q[1] for q in queries], np.int64)
        )
    data = TextData(token_ids, seen_embeddings[~held], texts_of(catalogs["train"]), galleries)
    data.save(work / DATA_FILE)
    write_json_atomic(work / TEXTS_FILE, texts)
    for name, catalog in catalogs.items():
        catalog.write(work / "captions" / f"{name}.csv")
    return data, texts, catalogs


def with_captions(catalog: Catalog, captions: list[str]) -> Catalog:
    """The catalog with each row's caption in its `caption` column (what captions/*.csv keep)."""
    metadata = [{**m, CAPTION_COLUMN: c} for m, c in zip(catalog.metadata, captions, strict=True)]
    return dataclasses.replace(catalog, metadata=metadata)


def write_clip_bpe_once(path: Path) -> None:
    from training.text_tokenizer import write_clip_bpe

    if not path.is_file():
        write_clip_bpe(path)


# ---------------------------------------------------------------------------------------------
# The worker's steps


class DistinctCaptionBatches:
    """Steps of `batch_size` distinct captions (all of them when there are fewer), with one image
    of each drawn at random; the draws are a function of (seed, epoch), so a resumed run repeats
    what an unbroken one would have drawn."""

    def __init__(self, row_texts: np.ndarray, batch_size: int, steps: int, seed: int) -> None:
        self.texts = np.unique(row_texts)
        self.rows_of = [np.flatnonzero(row_texts == t) for t in self.texts]
        self.batch_size = min(batch_size, len(self.texts))
        self.steps, self.seed = steps, seed

    def __len__(self) -> int:
        return self.steps

    def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(text indices, image rows) of each step."""
        rng = np.random.default_rng([self.seed, epoch])
        for _ in range(self.steps):
            picks = rng.choice(len(self.texts), self.batch_size, replace=False)
            rows = np.array([self.rows_of[p][rng.integers(len(self.rows_of[p]))] for p in picks])
            yield self.texts[picks], rows


def build_optimizer(
    cfg: TrainTextConfig, net: torch.nn.Module, loss_fn: torch.nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW, the tower with weight decay and the temperature without (decay would pull it
    towards 1); a linear warm-up, then a cosine to 0 at the last step."""
    optimizer = torch.optim.AdamW(
        [
            {"params": list(net.parameters()), "weight_decay": cfg.weight_decay, "name": "tower"},
            {"params": list(loss_fn.parameters()), "weight_decay": 0.0, "name": "temperature"},
        ],
        lr=cfg.lr,
    )
    warm = min(cfg.warmup_steps, max(0, total_steps - 1))
    span = max(1, total_steps - warm)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warm, span) / span))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def embed_texts(net: torch.nn.Module, token_ids: np.ndarray, device: torch.device | str = "cpu") -> np.ndarray:
    """L2-normalised embeddings of token ids, in eval mode."""
    net = unwrap(net)
    was_training = net.training
    net.eval()
    with torch.no_grad():
        out = torch.cat(
            [net(torch.from_numpy(token_ids[i : i + 256]).to(device)).cpu() for i in range(0, len(token_ids), 256)]
        )
    net.train(was_training)
    return out.numpy().astype(np.float32)


def chance_recall(query_labels: np.ndarray, gallery_labels: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """Recall@K of a random ranking: 1 − P(none of K images drawn without replacement is of the
    query's class), averaged over the queries."""
    n = len(gallery_labels)
    counts = np.bincount(gallery_labels, minlength=int(max(query_labels.max(), gallery_labels.max())) + 1)
    result = {}
    for k in ks:
        misses = np.ones(len(query_labels))
        for i in range(min(k, n)):
            misses *= np.clip((n - counts[query_labels] - i) / (n - i), 0, 1)
        result[int(k)] = float(np.mean(1 - misses))
    return result


def text_to_image_recall(
    net: torch.nn.Module, data: TextData, ks: Sequence[int], device: torch.device | str = "cpu"
) -> dict[str, dict[int, float]]:
    """Text → image Recall@K of each gallery."""
    texts = embed_texts(net, data.token_ids, device)
    return {
        name: query_gallery_recall_at_k(texts[g.query_texts], g.query_labels, g.embeddings, g.labels, ks)
        for name, g in data.galleries.items()
    }


def train_one_epoch(
    trainable: Trainable, data: TextData, batches: DistinctCaptionBatches, epoch: int, device: torch.device
) -> tuple[list[float], float]:
    """One epoch of distinct-caption steps: each step's loss, and the seconds it took."""
    model, loss_fn, optimizer, scheduler = trainable.model, trainable.loss_fn, trainable.optimizer, trainable.scheduler
    ids = torch.from_numpy(data.token_ids)
    images = torch.from_numpy(data.train_embeddings)
    model.train()
    started, losses = time.perf_counter(), []
    for texts, rows in batches.epoch(epoch):
        loss = loss_fn(model(ids[texts].to(device)), images[rows].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - started


def recall_columns(recalls: dict[str, dict[int, float]]) -> dict[str, float]:
    return {f"{name}_recall_at_{k}": v for name, by_k in recalls.items() for k, v in by_k.items()}


def epoch_text(metrics: dict[str, Any], epochs: int, eta_s: float) -> str:
    """One log line per epoch."""
    recall = " ".join(f"{k.replace('_recall_at_', ' R@')}={v:.3f}" for k, v in metrics.items() if "_recall_at_" in k)
    return (
        f"text epoch {metrics['epoch'] + 1}/{epochs} loss={metrics['loss']:.4f} T={metrics['temperature']:.4f} "
        f"{recall} eta {eta_s:.0f}s"
    )


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train worker: distinct-caption steps, text → image Recall@K and a checkpoint a
    epoch."""
    import ray.train
    import ray.train.torch

    cfg = TrainTextConfig(**config["train"])
    data = TextData.load(Path(config["data"]))
    device = ray.train.torch.get_device()
    torch.manual_seed(cfg.seed)
    net = build_lit_tower(data.embedding_dim, cfg.spec).to(device)
    loss_fn = ImageTextContrastiveLoss(cfg.temperature).to(device)
    steps = cfg.steps_per_epoch or math.ceil(len(data.train_texts) / cfg.batch_size)
    batches = DistinctCaptionBatches(data.train_texts, cfg.batch_size, steps, cfg.seed)
    optimizer, scheduler = build_optimizer(cfg, net, loss_fn, cfg.epochs * steps)
    trainable = Trainable(ray.train.torch.prepare_model(net), loss_fn, optimizer, scheduler)
    start_epoch, record = resume_point(trainable, device)
    clock = EpochClock(cfg.epochs, start_epoch)

    def report(metrics: dict[str, Any]) -> None:
        import tempfile

        metrics.update(recall_columns(text_to_image_recall(trainable.model, data, cfg.ks, device)))
        record.history.append(metrics)
        if metrics["epoch"] != START_EPOCH:  # the untrained tower's row is chance: the history keeps it
            epoch_logger().info(epoch_text(metrics, cfg.epochs, clock.eta_seconds(metrics["epoch"])))
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(Path(tmp) / CHECKPOINT_FILE, trainable, record, metrics["epoch"])
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    if start_epoch == 0:
        report({"epoch": START_EPOCH})  # an untrained tower: the chance a trained one must beat
    for epoch in range(start_epoch, cfg.epochs):
        losses, seconds = train_one_epoch(trainable, data, batches, epoch, device)
        report(
            {
                "epoch": epoch,
                "loss": float(np.mean(losses)),
                "lr": scheduler.get_last_lr()[0],
                "temperature": loss_fn.temperature,
                "captions_per_s": len(losses) * batches.batch_size / max(seconds, 1e-9),
            }
        )


# ---------------------------------------------------------------------------------------------
# The driver


def gallery_evaluation(net: torch.nn.Module, data: TextData, ks: Sequence[int]) -> dict[str, dict[str, Any]]:
    """results.json's `evaluation`: each gallery's text → image Recall@K, a random ranking's, and
    its captions, images and classes."""
    final = text_to_image_recall(net, data, ks)
    return {
        name: {
            "recall_at_k": {str(k): v for k, v in final[name].items()},
            "chance_recall_at_k": {str(k): v for k, v in chance_recall(g.query_labels, g.labels, ks).items()},
            "captions": len(g.query_texts),
            "images": len(g.labels),
            "classes": len(np.unique(g.labels)),
        }
        for name, g in data.galleries.items()
    }


def run_text_training(cfg: TrainTextConfig) -> Path:
    """Embed the images with the locked model, train the tower on Ray Train, publish the run."""
    manifest = check_model(cfg.model)
    cfg = dataclasses.replace(
        cfg, **{n: str(Path(v).resolve()) for n in ("model", "catalog", "unseen_catalog") if (v := getattr(cfg, n))}
    )
    out = Path(cfg.out).resolve()
    work = work_directory(cfg, out)
    if cfg.resume and (work / DATA_FILE).is_file():
        data, texts = TextData.load(work / DATA_FILE), json.loads((work / TEXTS_FILE).read_text())
    else:
        try:
            data, texts, _ = prepare_data(cfg, manifest, work)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)  # nothing to resume: a refused input leaves nothing behind
            raise
    log.debug(  # the demo's screen is full; results.json and the command's summary carry these counts
        "text tower for %s: %d training images, %d distinct texts; galleries %s",
        manifest.model_id,
        len(data.train_texts),
        len(texts),
        ", ".join(f"{n} {len(g.labels)} images / {len(g.query_texts)} captions" for n, g in data.galleries.items()),
    )
    # No checkpoint score (the last epoch's tower is published) and no metrics port (Ray's own).
    result, use_gpu, train_seconds = fit_on_ray(
        train_loop_per_worker,
        {"train": to_jsonable(cfg), "data": str(work / DATA_FILE)},
        name="train-text",
        work=work,
        num_workers=1,  # a few million parameters over cached vectors gain nothing from DDP
        device=cfg.device,
        max_failures=cfg.max_failures,
    )
    if result.checkpoint is None:
        raise RuntimeError("text training finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        last = torch.load(Path(d) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)

    net = build_lit_tower(data.embedding_dim, cfg.spec)
    net.load_state_dict(last["model"])
    temperature = 1.0 / min(math.exp(float(last["loss"]["logit_scale"])), 100.0)
    evaluation = gallery_evaluation(net, data, cfg.ks)
    seen_texts = [texts[i] for i in dict.fromkeys(data.galleries["seen"].query_texts.tolist())]
    unseen_texts = (
        [texts[i] for i in dict.fromkeys(data.galleries["unseen"].query_texts.tolist())]
        if "unseen" in data.galleries
        else []
    )
    with staging_directory(out) as staging:
        torch.save(
            {
                "model": last["model"],
                "spec": cfg.spec.to_dict(),
                "image_model_id": manifest.model_id,
                "embedding_dim": data.embedding_dim,
                "parity_texts": (seen_texts + unseen_texts)[:PARITY_TEXTS],
                "temperature": temperature,
                "config": to_jsonable(cfg),
            },
            staging / RUN_CHECKPOINT,
        )
        shutil.copytree(work / "captions", staging / "captions")
        write_json_atomic(staging / "config.json", to_jsonable(cfg))
        if cfg.plots:
            from training.plots import plot_loss_and_recall

            plot_loss_and_recall(last["history"], staging / PLOT_FILE)
        write_json_atomic(
            staging / RESULTS_FILE,
            {
                "created": utc_now(),
                "image_model": {"model_id": manifest.model_id, "dir": cfg.model, "embedding_dim": data.embedding_dim},
                "evaluation": evaluation,
                "train_images": len(data.train_texts),
                "train_captions": len(np.unique(data.train_texts)),
                "temperature": temperature,
                "history": last["history"],
                "resumed": last.get("resumed", []),
                "train_seconds": train_seconds,
                "use_gpu": use_gpu,
            },
        )
    shutil.rmtree(work, ignore_errors=True)
    return out


@dataclass
class TextRun:
    """A published train-text run, as `training export --text` takes it."""

    net: TextEmbeddingNet
    spec: LitTowerSpec
    image_model_id: str
    embedding_dim: int
    parity_texts: list[str]
    evaluation: dict[str, Any]
    source: dict[str, Any]


def load_text_run(run: str | Path) -> TextRun:
    """The run directory's tower (built, loaded, in eval mode) and what its manifest needs."""
    run = Path(run)
    path = run / RUN_CHECKPOINT
    if not path.is_file():
        raise ValueError(f"{run} has no {RUN_CHECKPOINT}: not a train-text run (python -m training train-text)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    missing = [k for k in RUN_KEYS if k not in state]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not a train-text run's checkpoint")
    spec = LitTowerSpec(**state["spec"])
    net = build_lit_tower(state["embedding_dim"], spec)
    net.load_state_dict(state["model"])
    results = json.loads((run / RESULTS_FILE).read_text()) if (run / RESULTS_FILE).is_file() else {}
    return TextRun(
        net=net.eval(),
        spec=spec,
        image_model_id=state["image_model_id"],
        embedding_dim=state["embedding_dim"],
        parity_texts=list(state["parity_texts"]),
        evaluation=results.get("evaluation", {}),
        source={"kind": "lit", "run": str(run.resolve()), "spec": spec.to_dict(), "temperature": state["temperature"]},
    )
