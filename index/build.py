"""Build an index version: embed a catalog with the model artifact, build faiss, gate, publish."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from core import artifacts
from core.artifacts import utc_now
from core.catalog import ITEM_COLUMN, Catalog, CatalogError, read_catalog, read_probe_catalog
from core.config import DEVICES, option, to_jsonable
from core.items import ItemTable
from core.manifests import IndexManifest, ModelManifest, QualityGate, QualityReport, RowCounts, check_model_index_pair
from core.metrics import recall_at_k, recall_from_neighbor_labels
from core.preprocess import DEFAULT_MAX_PIXELS, ImageDecodeError, RegionError, load_image
from core.progress import Progress
from index.contact_sheet import contact_sheet, sample_neighbours
from index.embedder import OnnxEmbedder
from index.faiss_index import (
    ann_recall,
    build_index,
    check_trainable,
    empty_index,
    l2_normalized,
    save_index,
    search,
    search_effort,
    search_leaving_out_self,
    searchable,
    select_device,
    tune_search_effort,
    with_default_rerank,
)
from index.filters import FieldSpec, FilterIndex, check_catalog_fields, declared_json, parse_filterable, specs_of
from index.grouping import Groups, item_recall_at_k
from index.lifecycle import drop_rows, warn_of_returning_items
from index.version import IndexVersion

log = logging.getLogger(__name__)


class QualityGateError(ValueError):
    """The new index is worse than allowed; it was not published."""


DEFAULT_MODEL = "runs/model"


@dataclass
class BuildConfig:
    """`index build` and `index add` (and, with RebuildConfig's two more, `index rebuild`)."""

    model: str | None = option(
        None,
        help=f"model artifact directory (model.onnx + manifest.json) (default: {DEFAULT_MODEL}; index add: "
        "the live version's model)",
    )
    index_root: str = option("runs/index", help="index root (versions/ and CURRENT)")
    catalog: str | None = option(None, help="catalog to index (default: the test split the model manifest records)")
    probe_catalog: str | None = option(
        None, help="held-out labelled images for probe Recall@K (default: leave-one-out over the index)"
    )
    factory: str = option("Flat", help="faiss factory string: Flat, IVF256,Flat, IVF4000,PQ32, HNSW32, ...")
    search_params: dict[str, float] = option(
        default_factory=dict, help='faiss search parameters as JSON, e.g. \'{"nprobe": 16, "rerank": 10}\''
    )
    nprobe: int | None = option(
        None,
        help="IVF: lists searched per query, over --search-params' nprobe (default: the least reaching "
        "--target-ann-recall, measured at build)",
    )
    target_ann_recall: float = option(
        0.95,
        help="IVF without nprobe, HNSW without efSearch: the build raises the search effort until ANN "
        "recall@10 against exact search reaches this",
    )
    train_size: int | None = option(None, help="vectors sampled to train IVF/PQ (default: all)")
    device: str = option("auto", choices=DEVICES, help="where faiss builds")
    provider: str = option("auto", choices=DEVICES, help="where ONNX Runtime embeds")
    batch_size: int = option(256, help="images embedded per batch")
    decode_threads: int = option(4, help="threads decoding images")
    max_pixels: int = option(DEFAULT_MAX_PIXELS, help="larger images are skipped as oversized")
    max_bad_fraction: float = option(0.01, help="fail when more of the catalog than this cannot be read")
    ks: list[int] = option(default_factory=lambda: [1, 2, 4, 8], help="K values for probe Recall@K")
    quality_sample: int = option(1000, cli=False, help="queries sampled for the ANN recall measurement")
    ann_k: int = option(10, cli=False, help="k of the ANN recall measurement")
    min_ann_recall: float = option(0.9, help="quality gate: least ANN recall@10 against exact search")
    min_probe_recall_at_1: float = option(0.0, help="quality gate: least probe Recall@1")
    max_recall_drop: float | None = option(
        None, help="quality gate: most probe Recall@1 may fall below the live version's"
    )
    force: bool = option(False, help="publish even if the quality gate fails")
    upsert: bool = option(
        False, help="index add: rows whose id is already indexed replace its vector, label and metadata"
    )
    keep: int = option(5, help="versions to retain")
    filterable: list[str] = option(
        default_factory=list,
        help="fields queries may filter on, NAME[:string|int|float] (string by default): metadata columns "
        "or label, e.g. category,brand,price:float; index add keeps the live version's",
    )

    item_field: str | None = option(
        None,
        help="the catalog column naming each row's item (a product with several photos, an icon in several "
        "themes; label for a labelled set): answers can be grouped by it and item Recall@K is measured "
        f"(default: {ITEM_COLUMN} when the catalog has that column); declared filterable",
    )

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.decode_threads <= 0 or self.quality_sample <= 0:
            raise ValueError("batch_size, decode_threads and quality_sample must be positive")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError("max_bad_fraction must be within [0, 1]")
        if self.keep < 1:
            raise ValueError("keep must be at least 1")
        if not self.ks or min(self.ks) <= 0:
            raise ValueError(f"ks must be positive, got {self.ks}")
        if self.nprobe is not None and self.nprobe < 1:
            raise ValueError(f"nprobe must be at least 1, got {self.nprobe}")
        if not 0 < self.target_ann_recall <= 1:
            raise ValueError(f"target_ann_recall must be within (0, 1], got {self.target_ann_recall}")
        select_device(self.device, num_gpus=1)  # validates the name only
        parse_filterable(self.filterable)

    @property
    def filterable_fields(self) -> list[FieldSpec]:
        return parse_filterable(self.filterable)

    def with_item_field(self, catalog: Catalog) -> BuildConfig:
        """The item field resolved against the catalog (`item` when it has that column and none
        was named) and declared filterable — grouping reads a field's value → rows structure."""
        name = self.item_field
        if name is None and any(ITEM_COLUMN in meta for meta in catalog.metadata):
            name = ITEM_COLUMN
        if name is None:
            return self
        declared = self.filterable if name in {s.name for s in self.filterable_fields} else [*self.filterable, name]
        return dataclasses.replace(self, item_field=name, filterable=declared)

    @property
    def given_search_params(self) -> dict[str, float]:
        """The search parameters the user gave: --search-params, with --nprobe over its nprobe."""
        return {**self.search_params, **({"nprobe": self.nprobe} if self.nprobe is not None else {})}

    def factory_index(self) -> faiss.Index:
        """The factory's index, empty, at the model's dimension (the model manifest is read)."""
        return empty_index(ModelManifest.read(self.model).embedding_dim, self.factory)

    def check_inputs(self) -> None:
        """What reads files, before any image is embedded: the probe catalog exists and is
        labelled, and the factory string makes an index of the model's dimension."""
        if self.probe_catalog is not None:
            read_probe_catalog(self.probe_catalog)
        self.factory_index()

    def check_catalog(self, catalog: Catalog, trains_index: bool = True) -> None:
        """Before any of its images is embedded: the catalog has every declared filterable field,
        and its numeric ones parse (CatalogError naming the column and first bad row); and, for a
        new index (`trains_index`), it has the vectors the factory's training needs (an IVF's
        lists, a PQ's codes), or --train-size does."""
        try:
            check_catalog_fields(self.filterable_fields, catalog.labels, catalog.metadata)
        except ValueError as exc:
            raise CatalogError(f"{catalog.source}: {exc}") from None
        index = self.factory_index() if trains_index else None
        if index is not None and not index.is_trained:
            vectors = min(len(catalog), self.train_size or len(catalog))
            try:
                check_trainable(index, self.factory, vectors)
            except ValueError as exc:
                source = f"{catalog.source} ({len(catalog)} rows" + (
                    f", --train-size {self.train_size})" if vectors < len(catalog) else ")"
                )
                raise ValueError(f"{source}: {exc}") from None


def default_catalog(model_manifest: ModelManifest) -> str:
    if model_manifest.test_split is None:
        raise ValueError(
            "no --catalog given and the model manifest records no test split "
            "(a pretrained export has no training run): pass --catalog"
        )
    return model_manifest.test_split


def embed_catalog(
    catalog: Catalog,
    embedder: OnnxEmbedder,
    batch_size: int = 256,
    threads: int = 4,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: bool = True,
) -> tuple[np.ndarray, list[int], dict[str, int]]:
    """Embeddings of every decodable row, the rows kept, and counts of skipped rows by reason."""
    skipped: dict[str, int] = {}
    bad_regions: list[tuple[int, str]] = []
    counting = threading.Lock()  # decode threads skip rows at once: a get-then-set could lose one
    regions = catalog.regions

    def decode(row: int) -> np.ndarray | None:
        path = catalog.paths[row]
        try:
            return load_image(path, embedder.contract, max_pixels, regions[row])
        except RegionError as exc:  # the catalog's own mistake, not an unreadable file: refused below
            with counting:
                bad_regions.append((row + 1, str(exc)))
            return None
        except ImageDecodeError as exc:
            with counting:
                skipped[exc.reason] = skipped.get(exc.reason, 0) + 1
            log.warning("skipping %s: %s", path, exc)
            return None

    parts, kept = [], []
    with (
        ThreadPoolExecutor(max_workers=threads) as pool,
        Progress(len(catalog), "embed", "img", "auto" if progress else "off") as bar,
    ):
        for start in range(0, len(catalog), batch_size):
            rows = range(start, min(start + batch_size, len(catalog)))
            arrays = list(pool.map(decode, rows))
            good = [(r, a) for r, a in zip(rows, arrays, strict=True) if a is not None]
            if good:
                parts.append(embedder.embed(np.stack([a for _, a in good])))
                kept.extend(r for r, _ in good)
            bar.update(len(rows))
    if bad_regions:
        bad_regions.sort()
        shown = "; ".join(f"row {n}: {why}" for n, why in bad_regions[:5]) + (" ..." if len(bad_regions) > 5 else "")
        raise CatalogError(f"{catalog.source}: {len(bad_regions)} row(s) whose bbox does not fit the image ({shown})")
    embeddings = np.concatenate(parts) if parts else np.zeros((0, embedder.dim), np.float32)
    return embeddings, kept, skipped


def probe_catalog_recall(index, labels: list[str] | None, cfg: BuildConfig) -> tuple[dict[str, float], str]:
    """Recall@K of held-out labelled images querying the built index (nothing to exclude),
    and where it comes from. An index without labels cannot say which answers are right: the
    probe images then query each other (leave-one-out), which measures the model alone."""
    embedder = OnnxEmbedder(cfg.model, provider=cfg.provider)
    probe = read_probe_catalog(cfg.probe_catalog)
    vectors, kept, _ = embed_catalog(probe, embedder, cfg.batch_size, cfg.decode_threads, cfg.max_pixels, False)
    if not kept:
        raise ValueError(f"no image of the probe catalog {cfg.probe_catalog} could be read")
    source = str(Path(cfg.probe_catalog).resolve())
    if labels is None:
        ks = [kk for kk in cfg.ks if kk < len(kept)]
        recall = recall_at_k(vectors, [probe.labels[r] for r in kept], ks) if ks else {}
        source += " (leave-one-out among its images: the catalog has no labels)"
        return {str(kk): v for kk, v in recall.items()}, source
    k = min(max(cfg.ks), index.ntotal)
    _, rows = search(index, vectors, k)
    label_array = np.asarray(labels, dtype=object)
    neighbor_labels = np.where(rows >= 0, label_array[np.maximum(rows, 0)], None)
    query_labels = np.asarray([probe.labels[r] for r in kept], dtype=object)
    ks = [kk for kk in cfg.ks if kk <= k]
    recall = recall_from_neighbor_labels(neighbor_labels, query_labels, ks)
    return {str(kk): v for kk, v in recall.items()}, source


NO_PROBE = "none: the catalog has no labels and no --probe-catalog was given"


def quality_figures(
    index, embeddings: np.ndarray, labels: list[str] | None, cfg: BuildConfig, items: Groups | None = None
) -> QualityReport:
    """ANN recall vs exact search, and probe Recall@K, on a fixed sample of the catalog.
    Without labels (`labels` None) the probe comes from --probe-catalog or is absent. With
    `items` (the rows grouped by the item field), item Recall@K of the same sample too."""
    n = len(embeddings)
    sample = sample_rows(n, cfg.quality_sample, seed=0)
    ann_k = min(cfg.ann_k, n)
    report = QualityReport(
        sample_size=int(len(sample)),
        ann_k=ann_k,
        ann_recall_at_k=ann_recall(index, embeddings, embeddings[sample], ann_k),
        labelled=labels is not None,
    )
    if items is not None:
        item_recall = item_recall_at_k(index, embeddings, items, sample, cfg.ks)
        report.item_recall_at_k = None if item_recall is None else {str(k): v for k, v in item_recall.items()}
    if cfg.probe_catalog:
        report.probe_recall_at_k, report.probe_source = probe_catalog_recall(index, labels, cfg)
    if labels is None:
        report.probe_source = report.probe_source or NO_PROBE
        return report
    label_array = np.asarray(labels)
    depth = min(max(cfg.ks), n - 1)
    ks = [kk for kk in cfg.ks if kk <= depth]
    if not cfg.probe_catalog and ks:
        # Probe: sampled items query the built index itself, excluding their own row.
        _, rows = search_leaving_out_self(index, embeddings, sample, depth)
        neighbor_labels = np.where(rows >= 0, label_array.astype(object)[np.maximum(rows, 0)], None)
        report.probe_source = "leave-one-out sample of the catalog"
        report.probe_recall_at_k = {
            str(kk): v for kk, v in recall_from_neighbor_labels(neighbor_labels, label_array[sample], ks).items()
        }
    if n <= 20000:
        report.exact_recall_at_k = {str(kk): v for kk, v in recall_at_k(embeddings, labels, ks).items()} if ks else {}
    return report


def sample_rows(n: int, size: int, seed: int) -> np.ndarray:
    """`size` of `n` rows (all when fewer), sorted: a fixed sample for a given seed."""
    return np.sort(np.random.default_rng(seed).choice(n, size=min(size, n), replace=False))


def describe_quality(figures: QualityReport) -> str:
    """The quality figures in one line, as the build logs them."""
    line = (
        f"ANN recall@{figures.ann_k} {figures.ann_recall_at_k:.4f} against exact search ({figures.sample_size} queries)"
    )
    if figures.probe_recall_at_k:
        recall = ", ".join(f"R@{k} {v:.4f}" for k, v in figures.probe_recall_at_k.items())
        line += f"; probe {recall} ({figures.probe_source})"
    else:
        line += f"; probe Recall@K {figures.probe_source or NO_PROBE}"
    if figures.item_recall_at_k:
        line += "; item " + ", ".join(f"R@{k} {v:.4f}" for k, v in figures.item_recall_at_k.items())
    return line


def write_contact_sheet(path: Path, index, embeddings: np.ndarray, paths: list[str], labels: list[str] | None) -> None:
    """`neighbours.png`: a dozen catalog items querying the index, their top 8 framed by label."""
    picked, rows, scores = sample_neighbours(index, embeddings)
    query_labels = [labels[r] for r in picked] if labels is not None else None
    contact_sheet([paths[r] for r in picked], query_labels, rows, scores, paths, labels).save(path)


def check_quality(figures: QualityReport, cfg: BuildConfig, live: IndexManifest | None) -> list[str]:
    """Reasons to refuse publishing (empty when the gate passes)."""
    reasons = []
    if figures.ann_recall_at_k < cfg.min_ann_recall:
        reasons.append(
            f"ANN recall@{figures.ann_k} {figures.ann_recall_at_k:.4f} < floor {cfg.min_ann_recall} "
            "(search harder: --nprobe, or efSearch in --search-params; or a finer index)"
        )
    probe = figures.probe_recall_at_1
    if probe is None and cfg.min_probe_recall_at_1 > 0:
        reasons.append(f"a probe Recall@1 floor is set ({cfg.min_probe_recall_at_1}) but there is no probe: {NO_PROBE}")
    if probe is not None and probe < cfg.min_probe_recall_at_1:
        reasons.append(f"probe Recall@1 {probe:.4f} < floor {cfg.min_probe_recall_at_1}")
    if cfg.max_recall_drop is not None and live is not None and probe is not None:
        live_probe = live.quality.probe_recall_at_1 if live.quality is not None else None
        if live_probe is not None and probe < live_probe - cfg.max_recall_drop:
            reasons.append(
                f"probe Recall@1 {probe:.4f} is more than {cfg.max_recall_drop} below the live "
                f"version's {live_probe:.4f}"
            )
    return reasons


def check_bad_rows(total: int, kept: int, skipped: dict[str, int], max_bad_fraction: float) -> None:
    bad = total - kept
    if total and bad / total > max_bad_fraction:
        raise ValueError(
            f"{bad} of {total} catalog rows could not be embedded ({skipped}), over the "
            f"allowed fraction {max_bad_fraction}"
        )


def run_build(cfg: BuildConfig, progress: bool = True) -> Path:
    """Embed a catalog in this process, build a new index and publish it; returns its directory."""
    cfg = dataclasses.replace(cfg, model=cfg.model or DEFAULT_MODEL)
    cfg.check_inputs()
    started = time.perf_counter()
    catalog_path = cfg.catalog or default_catalog(ModelManifest.read(cfg.model))
    catalog = read_catalog(catalog_path)
    cfg = cfg.with_item_field(catalog)
    cfg.check_catalog(catalog)  # before the model's session is even loaded
    embedder = OnnxEmbedder(cfg.model, provider=cfg.provider)
    embeddings, kept, skipped = embed_catalog(
        catalog, embedder, cfg.batch_size, cfg.decode_threads, cfg.max_pixels, progress
    )
    check_bad_rows(len(catalog), len(kept), skipped, cfg.max_bad_fraction)
    seconds = time.perf_counter() - started
    new = NewVersion.of_catalog(embedder.model_id, catalog_path, catalog, embeddings, kept, skipped, started, seconds)
    return publish_index_version(cfg, new)


@dataclass
class NewVersion:
    """What `index build`, `add` and `rebuild` each hand to `publish_index_version`."""

    model_id: str
    embeddings: np.ndarray  # the exact vectors, row for row with `items`
    items: Catalog | ItemTable
    catalog: str | Path  # the catalog the rows came from
    rows: RowCounts
    started: float  # time.perf_counter() when the command started
    embed_seconds: float
    index: faiss.Index | None = None  # None: built from `embeddings` with the config's factory
    parent_version: str | None = None  # `index add`: the version it extends
    engine: dict | None = None  # `index rebuild`: what embedded the catalog
    deleted: np.ndarray | None = None  # rows removed but kept in the index (HNSW tombstones)

    @classmethod
    def of_catalog(
        cls,
        model_id: str,
        catalog_path: str | Path,
        catalog: Catalog,
        embeddings: np.ndarray,
        kept: list[int],
        skipped: dict[str, int],
        started: float,
        embed_seconds: float,
        engine: dict | None = None,
    ) -> NewVersion:
        """A whole catalog embedded (`embed_catalog`'s answer): its `kept` rows, `skipped` counted."""
        return cls(
            model_id=model_id,
            embeddings=embeddings,
            items=catalog.subset(kept),
            catalog=catalog_path,
            rows=RowCounts(catalog=len(catalog), indexed=len(kept), skipped=skipped),
            started=started,
            embed_seconds=embed_seconds,
            engine=engine,
        )


def publish_index_version(cfg: BuildConfig, new: NewVersion) -> Path:
    """Build the faiss index (unless given), gate it on quality, and publish a new version of
    `cfg.index_root`: the one publish path of build, add and rebuild; returns its directory."""
    device = select_device(cfg.device)
    embeddings = new.embeddings
    index = new.index
    if index is None:
        index = build_index(embeddings, cfg.factory, cfg.given_search_params, cfg.train_size, device)
    search_params = with_default_rerank(index, cfg.given_search_params)
    items = new.items
    labels = list(items.labels) if items.labelled else None
    paths = [str(Path(p).resolve()) for p in items.paths]
    table = ItemTable(ids=list(items.ids), labels=labels, paths=paths, metadata=list(items.metadata))
    # Built from the new version's own rows, whichever command made them (build, add, rebuild,
    # a removal's subset), so a version's structure always describes its rows.
    specs = cfg.filterable_fields
    filter_index = FilterIndex.build(table, specs) if specs else None
    searched = searchable(index, search_params, embeddings)
    effort = search_effort(index)
    tuning = None
    if effort is not None and effort[0] not in search_params:
        # Tuned on a sample of its own, so the gate's figure below is measured, not the tuning's.
        queries = embeddings[sample_rows(len(embeddings), cfg.quality_sample, seed=1)]
        k = min(cfg.ann_k, len(embeddings))
        tuning = tune_search_effort(searched, embeddings, queries, k, cfg.target_ann_recall)
        search_params = {**search_params, tuning.parameter: tuning.value}
        (log.info if tuning.reached else log.warning)("search effort: %s", tuning)
    item_groups = Groups.of(cfg.item_field, filter_index.fields[cfg.item_field], len(table)) if cfg.item_field else None
    quality = quality_figures(searched, embeddings, labels, cfg, item_groups)
    quality.search_tuning = tuning.to_dict() if tuning is not None else None
    log.info("quality: %s; search parameters %s", describe_quality(quality), search_params or "none")
    root = Path(cfg.index_root)
    live = IndexVersion.live(root)
    # A different model's recall is no baseline for this one.
    baseline = live.manifest if live is not None and live.manifest.model_id == new.model_id else None
    reasons = check_quality(quality, cfg, baseline)
    if reasons and not cfg.force:
        raise QualityGateError("quality gate refused to publish: " + "; ".join(reasons))

    if new.parent_version is None:  # a build from a whole catalog
        warn_of_returning_items(root, items.ids)
    deleted = new.deleted if new.deleted is not None else np.zeros(0, np.int64)
    staging = artifacts.index_staging_dir(root)
    try:
        save_index(index, staging / artifacts.INDEX_FILE)
        np.save(staging / artifacts.EMBEDDINGS_FILE, np.ascontiguousarray(embeddings, dtype=np.float32))
        if len(deleted):
            np.save(staging / artifacts.DELETED_FILE, np.asarray(deleted, dtype=np.int64))
        table.write(staging / artifacts.ITEMS_FILE)
        if filter_index is not None:
            filter_index.save(staging / artifacts.FILTERS_FILE)
        write_contact_sheet(staging / artifacts.NEIGHBOURS_FILE, searched, embeddings, paths, labels)
        index_id = artifacts.file_sha256(staging / artifacts.INDEX_FILE)[:16]
        version = artifacts.new_version_name(index_id)
        manifest = IndexManifest(
            index_id=index_id,
            version=version,
            model_id=new.model_id,
            model_dir=str(Path(cfg.model).resolve()),
            factory=cfg.factory,
            metric="inner_product",
            normalized=True,
            size=int(index.ntotal),
            dimension=int(index.d),
            search_params=search_params,
            built_on=device,
            build_seconds=time.perf_counter() - new.started,
            embed_seconds=new.embed_seconds,
            created=utc_now(),
            catalog=str(Path(new.catalog).resolve()),
            quality=quality,
            quality_gate=QualityGate(passed=not reasons, forced=bool(reasons), reasons=reasons),
            config=to_jsonable(cfg),
            parent_version=new.parent_version,
            engine=new.engine,
            deleted_rows=len(deleted),
            filterable=declared_json(specs),
            item_field=cfg.item_field,
        )
        manifest.rows = dataclasses.replace(new.rows, indexed=manifest.live_size)
        manifest.write(staging)
        target = artifacts.publish_version(root, staging, version, parent=new.parent_version)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    artifacts.prune_versions(root, cfg.keep)
    masked = f", +{manifest.deleted_rows} removed, masked" if manifest.deleted_rows else ""
    log.info("published index %s (%d items%s) at %s", version, manifest.live_size, masked, target)
    return target


def run_add(cfg: BuildConfig, progress: bool = True) -> Path:
    """Publish a new version = the live one + the catalog rows it lacks, embedding only those.

    Existing vectors are reused byte for byte (from the live version's embeddings.npy) and the
    live faiss index is extended in place of a rebuild, so IVF/PQ keep their trained quantisers.
    Rows whose id is already indexed are skipped and counted, not re-embedded — or, with
    `upsert`, replace the indexed ones: those leave the live version as a removal does
    (`index.lifecycle.drop_rows`) and come back at the end with their new vector and metadata.
    The live version's model (unless --model names another directory of it), factory, search
    parameters and filterable fields hold for the rows it gains.
    """
    started = time.perf_counter()
    if cfg.catalog is None:
        raise ValueError("index add needs --catalog with the new rows")
    live = IndexVersion.open(cfg.index_root)
    declared = [str(spec) for spec in specs_of(live.manifest.filterable)]
    if cfg.filterable and parse_filterable(cfg.filterable) != parse_filterable(declared):
        log.warning("index add keeps the live version's filterable fields %s, not %s", declared, cfg.filterable)
    cfg = dataclasses.replace(
        cfg,
        model=cfg.model or live_model_dir(live.manifest),
        factory=live.manifest.factory,
        search_params=live.manifest.search_params,
        nprobe=None,
        filterable=declared,
        item_field=live.manifest.item_field,
    )
    cfg.check_inputs()
    embedder = OnnxEmbedder(cfg.model, provider=cfg.provider)
    check_model_index_pair(embedder.manifest, live.manifest)
    catalog = read_catalog(cfg.catalog)
    cfg.check_catalog(catalog, trains_index=False)  # the live index is trained already
    if catalog.labelled != live.items.labelled:
        has, lacks = (
            (catalog.source, f"version {live.manifest.version}")
            if catalog.labelled
            else (f"version {live.manifest.version}", catalog.source)
        )
        raise CatalogError(f"{has} has labels and {lacks} has none: a version's items are all labelled or none are")
    indexed_rows = [live.row_of(item_id) for item_id in catalog.ids]
    replaced = np.array(sorted(r for r in indexed_rows if r is not None), dtype=np.int64)
    new_rows = [r for r, row in enumerate(indexed_rows) if row is None or cfg.upsert]
    already = 0 if cfg.upsert else len(replaced)
    if not new_rows:
        raise ValueError(
            f"all {len(catalog)} rows of {cfg.catalog} are already in version {live.manifest.version} (by id: "
            f"the catalog's id column, or for a folder the image's path relative to it, e.g. {catalog.ids[0]!r}): "
            "pass --upsert to replace them with these images"
        )
    if already:
        log.warning(
            "%d of %d rows of %s are already in version %s and are skipped, e.g. %r (--upsert replaces them)",
            already, len(catalog), cfg.catalog, live.manifest.version, live.items.ids[int(replaced[0])],
        )  # fmt: skip
    fresh = catalog.subset(new_rows)
    vectors, kept, skipped = embed_catalog(
        fresh, embedder, cfg.batch_size, cfg.decode_threads, cfg.max_pixels, progress
    )
    check_bad_rows(len(fresh), len(kept), skipped, cfg.max_bad_fraction)
    added = fresh.subset(kept)
    if cfg.upsert and len(replaced):
        # A row that failed to embed keeps its old vector rather than vanishing.
        rows_now = (live.row_of(i) for i in added.ids)
        replaced = np.array(sorted(r for r in rows_now if r is not None), dtype=np.int64)
    base = drop_rows(live, replaced) if cfg.upsert and len(replaced) else None
    index = base.index if base is not None and base.index is not None else live.read_index()
    old_vectors = base.vectors if base is not None else live.vectors
    old_items = base.items if base is not None else live.items
    deleted = base.deleted if base is not None else live.deleted
    index.add(l2_normalized(vectors))
    items = old_items.concat(
        ItemTable(
            ids=added.ids,
            labels=added.labels,
            paths=[str(p.resolve()) for p in added.paths],
            metadata=added.metadata,
        )
    )
    rows = RowCounts(
        catalog=len(catalog),
        indexed=0,  # publish_index_version counts it: the new version's live_size
        skipped=skipped,
        added=len(kept) - len(replaced) if cfg.upsert else len(kept),
        already_indexed=already,
        replaced=int(len(replaced)) if cfg.upsert else None,
    )
    return publish_index_version(
        cfg,
        NewVersion(
            model_id=embedder.model_id,
            embeddings=np.concatenate([old_vectors, vectors]),
            items=items,
            catalog=cfg.catalog,
            rows=rows,
            started=started,
            embed_seconds=time.perf_counter() - started,
            index=index,
            parent_version=live.manifest.version,
            deleted=deleted,
        ),
    )


def live_model_dir(manifest: IndexManifest) -> str:
    """The model directory `manifest`'s version was built with, for `index add` without --model."""
    if manifest.model_dir is None or not Path(manifest.model_dir).is_dir():
        where = "records none" if manifest.model_dir is None else f"is {manifest.model_dir}, which no longer exists"
        raise ValueError(f"no --model given, and version {manifest.version}'s model directory {where}: pass --model")
    return manifest.model_dir
