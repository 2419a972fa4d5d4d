"""The configuration of `index build`, `add` and `rebuild` (BuildConfig), and its defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import faiss

from core.artifacts.layout import MANIFEST, ArtifactError
from core.artifacts.model_manifests import ModelManifest, TextModelManifest, check_text_model_pair
from core.config import DEVICES, option, to_jsonable
from core.data.catalog import ITEM_COLUMN, Catalog, CatalogError, read_probe_catalog
from core.data.preprocess import DEFAULT_MAX_PIXELS
from index.build.gate import GateThresholds, ProbeCatalog
from index.build.publish import IndexRecipe, NewVersion, PublishTarget, publish_index_version
from index.search.faiss_index import check_trainable, empty_index, select_device
from index.search.filters import LABEL, FieldSpec, check_catalog_fields, parse_filterable
from index.versions.sharding import check_shard_count

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
    max_segments: int = option(
        16, help="index add: compact a shard (merge its segments, drop deleted rows) once it holds more segments"
    )
    max_deleted_fraction: float = option(
        0.2, help="index add: compact a shard once more than this fraction of its rows is deleted (upserts)"
    )
    merges: str = option(
        "tiered",
        choices=("tiered", "whole"),
        help="index add: tiered: segments of one size class merged in the "
        "background after the add publishes; whole: a shard past --max-segments compacted before the add returns",
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
        "themes; label for a labelled set — a folder per class gives its images the field label, the folder's "
        "name): answers can be grouped by it and item Recall@K is measured "
        f"(default: {ITEM_COLUMN} when the catalog has that column); declared filterable",
    )
    text_model: str | None = option(
        None,
        help="a text model artifact (training export --text) made for this model: queries' text is answered "
        "with it, and the version records it; index add keeps the live version's",
    )
    shards: int = option(
        1,
        help="index shards: S > 1 trains the quantizer once and adds the rows of each shard in parallel (one Ray "
        "task a shard; a row's shard is a hash of its item, else its id); 1: one index, as before",
    )

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.decode_threads <= 0 or self.quality_sample <= 0:
            raise ValueError("batch_size, decode_threads and quality_sample must be positive")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError("max_bad_fraction must be within [0, 1]")
        if self.keep < 1:
            raise ValueError("keep must be at least 1")
        if self.max_segments < 1:
            raise ValueError(f"max_segments must be at least 1, got {self.max_segments}")
        if not 0 <= self.max_deleted_fraction <= 1:
            raise ValueError(f"max_deleted_fraction must be within [0, 1], got {self.max_deleted_fraction}")
        if not self.ks or min(self.ks) <= 0:
            raise ValueError(f"ks must be positive, got {self.ks}")
        if self.nprobe is not None and self.nprobe < 1:
            raise ValueError(f"nprobe must be at least 1, got {self.nprobe}")
        if not 0 < self.target_ann_recall <= 1:
            raise ValueError(f"target_ann_recall must be within (0, 1], got {self.target_ann_recall}")
        select_device(self.device, num_gpus=1)  # validates the name only
        check_shard_count(self.shards)
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

    @property
    def gate_thresholds(self) -> GateThresholds:
        """The quality gate's measurements and floors, as this configuration sets them."""
        return GateThresholds(
            ks=tuple(self.ks),
            quality_sample=self.quality_sample,
            ann_k=self.ann_k,
            min_ann_recall=self.min_ann_recall,
            min_probe_recall_at_1=self.min_probe_recall_at_1,
            max_recall_drop=self.max_recall_drop,
            force=self.force,
        )

    @property
    def index_recipe(self) -> IndexRecipe:
        """How the index is built and how hard it is searched, as this configuration says."""
        return IndexRecipe(
            factory=self.factory,
            search_params=self.given_search_params,
            train_size=self.train_size,
            device=self.device,
            target_ann_recall=self.target_ann_recall,
            shards=self.shards,
        )

    def publish(self, new: NewVersion) -> Path:
        """`new` built, tuned, gated and published with what this configuration says each step
        takes (`publish_index_version` gets those, not the configuration)."""
        return publish_index_version(
            new, self.index_recipe, self.gate_thresholds, self.probe, self.filterable_fields, self.item_field,
            self.publish_target,
        )  # fmt: skip

    @property
    def publish_target(self) -> PublishTarget:
        """Where the version goes, how many are kept, and the configuration its manifest records."""
        text = self.text_model_manifest()
        return PublishTarget(
            index_root=self.index_root,
            keep=self.keep,
            model_dir=self.model,
            config=to_jsonable(self),
            text_model_dir=None if text is None else str(Path(self.text_model).resolve()),
            text_model_id=None if text is None else text.text_model_id,
        )

    def text_model_manifest(self) -> TextModelManifest | None:
        """--text-model's manifest, checked to embed into --model's space (ArtifactError naming
        both models' ids when not); None without one."""
        if self.text_model is None:
            return None
        if not (Path(self.text_model) / MANIFEST).is_file():
            raise ArtifactError(
                f"--text-model {self.text_model} has no {MANIFEST}: export one with `training export --text`"
            )
        text = TextModelManifest.read(self.text_model)
        model = ModelManifest.read(self.model or DEFAULT_MODEL)
        check_text_model_pair(text, model.model_id, f"--model {self.model or DEFAULT_MODEL}")
        return text

    @property
    def probe(self) -> ProbeCatalog | None:
        """The --probe-catalog and how to embed it (None when none was given)."""
        if not self.probe_catalog:
            return None
        return ProbeCatalog(
            path=self.probe_catalog,
            model=self.model,
            provider=self.provider,
            batch_size=self.batch_size,
            decode_threads=self.decode_threads,
            max_pixels=self.max_pixels,
        )

    def factory_index(self) -> faiss.Index:
        """The factory's index, empty, at the model's dimension (the model manifest is read)."""
        return empty_index(ModelManifest.read(self.model).embedding_dim, self.factory)

    def check_inputs(self) -> None:
        """What reads files, before any image is embedded: the probe catalog exists and is
        labelled, and the factory string makes an index of the model's dimension."""
        if self.probe_catalog is not None:
            read_probe_catalog(self.probe_catalog)
        self.text_model_manifest()
        self.factory_index()

    def check_catalog(self, catalog: Catalog, trains_index: bool = True, root_fixes_fields: bool = False) -> None:
        """Before any of its images is embedded: the catalog has every declared filterable field,
        and its numeric ones parse (CatalogError naming the column and first bad row); and, for a
        new index (`trains_index`), it has the vectors the factory's training needs (an IVF's
        lists, a PQ's codes), or --train-size does. `root_fixes_fields`: the fields came from the
        live version (index add), so a missing one is named as the root's, not as a flag."""
        try:
            if self.item_field is not None:  # with_item_field declared it filterable: named by its own flag first
                self._check_item_field(catalog, root_fixes_fields)
            check_catalog_fields(self.filterable_fields, catalog.labels, catalog.metadata)
        except ValueError as exc:
            raise CatalogError(f"{catalog.source}: {exc}") from None
        if trains_index:
            check_shard_count(self.shards, len(catalog))
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

    def _check_item_field(self, catalog: Catalog, root_fixes_fields: bool) -> None:
        field = str(self.item_field)
        try:
            check_catalog_fields([FieldSpec(field)], catalog.labels, catalog.metadata, "--item-field")
        except ValueError:
            if not root_fixes_fields:
                raise
            # The user of `index add` never typed --item-field: the root's first build did.
            raise ValueError(
                f"the versions of {self.index_root} group their items by the item field {field!r}, set when the "
                f"root was built (--item-field {field}), and this catalog has no {field} column: give its rows "
                f"{'labels (a folder per class)' if field == LABEL else f'a {field} column'}"
            ) from None


def default_catalog(model_manifest: ModelManifest) -> str:
    if model_manifest.test_split is None:
        raise ValueError(
            "no --catalog given and the model manifest records no test split "
            "(a pretrained export has no training run): pass --catalog"
        )
    return model_manifest.test_split
