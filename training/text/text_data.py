"""What `training train-text` trains and measures a text tower on: each image's caption (its
column, or its label's name), the seen classes' held-out images, the locked image model's
embeddings computed once and cached in the work directory with every distinct text's token ids
(`TextData`, its galleries), and the steps' batches of distinct captions
(`DistinctCaptionBatches`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.artifacts.layout import MANIFEST, MODEL_FILE, write_json_atomic
from core.artifacts.model_manifests import ModelManifest
from core.data.catalog import COLUMNS, LABEL, Catalog, read_catalog
from core.data.text import TOKENIZER_FILE, TextTokenizer
from core.retrieval.metrics import stable_order
from index.build.embed import check_bad_rows, embed_catalog
from index.embedder import OnnxEmbedder
from training.text.text_config import TrainTextConfig

CAPTION_COLUMN = "caption"  # the caption as the run's captions/*.csv write it
DATA_FILE = "text_data.npz"  # the work directory's cached embeddings and token ids
TEXTS_FILE = "texts.json"


def label_caption(label: str) -> str:
    """A class's name in words: a glyph's Unicode character name, otherwise the label with '-'
    and '_' as spaces (an icon's freedesktop name)."""
    from training.data.glyphs import CODE_POINT_LABEL, character_name
    from training.data.icons import icon_caption

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


def embed(catalog: Catalog, embedder: OnnxEmbedder, cfg: TrainTextConfig, name: str) -> tuple[Catalog, np.ndarray]:
    """The locked image model's embeddings of a catalog's readable images (the `name`d classes'),
    and those rows."""
    embeddings, kept, skipped = embed_catalog(
        catalog, embedder, progress=cfg.progress, desc=f"train-text: embedding the {name} images"
    )
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
    seen_kept, seen_embeddings = embed(with_captions(seen, captions["seen"]), embedder, cfg, "seen")
    held = heldout_rows(seen_kept, cfg.heldout_fraction, cfg.split_seed)
    if not held.any():
        raise ValueError(f"{seen.source}: no seen class has two images, so none can be held out to measure on")
    catalogs["train"], catalogs["heldout"] = (
        seen_kept.subset(np.flatnonzero(~held)),
        seen_kept.subset(np.flatnonzero(held)),
    )
    parts = {"heldout": (catalogs["heldout"], seen_embeddings[held])}
    if unseen is not None:
        unseen_captioned = with_captions(unseen, captions["unseen"])
        catalogs["unseen"], unseen_embeddings = embed(unseen_captioned, embedder, cfg, "unseen")
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
    from training.models.text_tokenizer import write_clip_bpe

    if not path.is_file():
        write_clip_bpe(path)


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
