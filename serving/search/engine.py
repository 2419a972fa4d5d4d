"""The search logic behind the service layer: a live model+index pair, and queries — already
checked by `serving.search.checks` — decoded, embedded and searched against it.

The live pair is one immutable object swapped by reference, so a request that took it at the
start finishes on it even if a reload swaps in another meanwhile, and every answer names the
versions that produced it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import faiss
import numpy as np
from PIL import Image

from core.artifacts import layout as artifacts
from core.artifacts.index_manifest import IndexManifest, check_model_index_pair
from core.artifacts.layout import ArtifactError
from core.artifacts.model_manifests import ModelManifest, TextModelManifest, check_text_model_pair
from core.config import option
from core.data.items import ItemTable
from core.data.preprocess import DEFAULT_MAX_PIXELS, EncodedImage, Region, decode
from core.data.text import TextTokenizer
from index.search.faiss_search import ExactRerank
from index.versions.version import IndexVersion
from serving.errors import ServiceError, Unavailable, image_errors
from serving.search.answers import EVERY_ROW, Answer, Exclusion, Scope, described
from serving.search.plans import Planner

if TYPE_CHECKING:  # ONNX Runtime loads where a model does, not in a shard replica (serving.ray_serve.replicas)
    from serving.search.query_embedder import Progress, QueryEmbedder


class TextEncoder(Protocol):
    """What embeds a query's text: `index.embedder.OnnxTextEmbedder` in the server's process, the
    embedder deployment's on `serve --ray`."""

    text_model_id: str
    tokenizer: TextTokenizer

    def embed_ids(self, ids: np.ndarray) -> np.ndarray: ...


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one request may ask: answers it refuses with INVALID_ARGUMENT past these."""

    max_k: int = option(1000, help="most neighbours a query may ask for")
    max_message_bytes: int = option(16 * 1024 * 1024, help="largest gRPC message, either way")
    max_image_pixels: int = option(DEFAULT_MAX_PIXELS, help="largest query image, in pixels")
    max_batch_queries: int = option(256, help="queries per SearchBatch")
    max_query_parts: int = option(8, help="parts of one query (images, embeddings, item ids)")
    max_per_group: int = option(16, help="most rows a grouped answer may give each group")

    def __post_init__(self) -> None:
        for name in (
            "max_k", "max_message_bytes", "max_image_pixels", "max_batch_queries", "max_query_parts", "max_per_group"
        ):  # fmt: skip
            if not 0 < getattr(self, name) < 2**31:  # GetInfo carries them as int32
                raise ValueError(f"{name} must be within 1..{2**31 - 1}, got {getattr(self, name)}")


class UndecodedImages(Exception):
    """Images of a batch that did not decode where they were embedded: each one's service error
    by its place in the batch; `vectors` holds every row, the failed ones zero."""

    def __init__(self, vectors: np.ndarray, errors: dict[int, ServiceError]) -> None:
        super().__init__(f"{len(errors)} of {len(vectors)} images did not decode")
        self.vectors = vectors
        self.errors = errors


_load_serials = itertools.count(1)


@dataclass(frozen=True)
class ServingPair:
    """A loaded model and the index version built with it. `serial` tells one load from every
    other, the same version loaded twice included: what outlives a request (the Feedback
    window, a sampled query waiting for its exact re-run) keeps the serial, never the pair, so
    a pair swapped out is freed once the requests that took it have finished."""

    embedder: QueryEmbedder
    index: faiss.Index | ExactRerank  # as searched: re-ranked against the exact vectors when the manifest asks
    index_version: IndexVersion
    text: TextEncoder | None = None  # the version's text model, when it records one: what embeds a query's text
    serial: int = field(default_factory=lambda: next(_load_serials))

    @property
    def items(self) -> ItemTable:
        return self.index_version.items

    @property
    def vectors(self) -> np.ndarray:
        """The exact vectors indexed (embeddings.npy, memory-mapped): what an index may only approximate."""
        return self.index_version.vectors

    @property
    def manifest(self) -> IndexManifest:
        return self.index_version.manifest

    @property
    def version(self) -> str:
        return self.index_version.name

    @property
    def directory(self) -> Path:
        return self.index_version.directory

    @property
    def model_id(self) -> str:
        return self.embedder.model_id

    @property
    def index_id(self) -> str:
        return self.manifest.index_id

    @property
    def dim(self) -> int:
        return self.embedder.dim


def load_pair(
    index_root: str | Path,
    version: str | None = None,
    model_dir: str | Path | None = None,
    provider: str = "auto",
    intra_op_threads: int | None = None,
    ort_spinning: bool = False,
    runs_at_once: int = 1,
    run_rows: int | None = 0,
    batch_rows: int = 1,
    previous: ServingPair | None = None,
    measure_budget_s: float | None = None,
    progress: Progress | None = None,
) -> ServingPair:
    """Load an index version and its model, refusing a pair built with different models.
    `runs_at_once`: how many ORT runs the server makes at once (batch streams, or unbatched
    queries); above 1 the model also gets a session for runs beside others (see `QueryEmbedder`).
    `run_rows`: at most this many images per ORT run (0: a batch in one run); None: the fastest
    for batches of up to `batch_rows` images, measured — or, when the `previous` pair has the
    same model (a new index for it), that pair's sessions, rows per run included; the
    measurement takes at most `measure_budget_s` (default: MEASURE_BUDGET_S), telling `progress` how far it got."""
    opened = IndexVersion.open(index_root, version)
    model_dir = Path(model_dir or opened.manifest.model_dir or "")
    if not (model_dir / artifacts.MANIFEST).is_file():
        raise ArtifactError(f"model directory {model_dir} has no {artifacts.MANIFEST}")
    model_manifest = ModelManifest.read(model_dir)
    check_model_index_pair(model_manifest, opened.manifest)
    # The index and items before the model's sessions, the costliest part: a damaged version
    # fails before any session is made.
    opened.load(dim=model_manifest.embedding_dim)
    text = load_text_model(opened.manifest, model_manifest, provider, intra_op_threads, ort_spinning, previous)
    if (
        previous is not None
        and previous.model_id == model_manifest.model_id
        and previous.embedder.model_dir.resolve() == model_dir.resolve()
    ):
        # The same model from the same directory: a new index for it, as a takedown or an add
        # publishes, keeps the live sessions rather than building and tuning them again.
        return ServingPair(previous.embedder, opened.searchable(), opened, text)
    from serving.search.query_embedder import MEASURE_BUDGET_S, QueryEmbedder

    embedder = QueryEmbedder(model_dir, provider, intra_op_threads, ort_spinning, runs_at_once=runs_at_once)
    if run_rows is not None:
        embedder.set_run_rows(run_rows or None, run_rows or None)
    else:
        side_by_side_rows = -(-batch_rows // runs_at_once)
        embedder.tune_run_rows(
            batch_rows,
            side_by_side_rows,
            total_budget_s=MEASURE_BUDGET_S if measure_budget_s is None else measure_budget_s,
            progress=progress,
        )
    return ServingPair(embedder, opened.searchable(), opened, text)


def text_model_dir(manifest: IndexManifest, model_manifest: ModelManifest) -> Path | None:
    """The directory of the text model `manifest` records, checked: it holds that text model, made
    for `model_manifest`'s space (ArtifactError naming the ids, or the directory when it is gone).
    None when the version records no text model."""
    if manifest.text_model_dir is None:
        return None
    text_dir = Path(manifest.text_model_dir)
    if not (text_dir / artifacts.MANIFEST).is_file():
        raise ArtifactError(
            f"index {manifest.version} records text model {manifest.text_model_id} in {text_dir}, which has no "
            f"{artifacts.MANIFEST}: restore it, or build the version again without --text-model"
        )
    found = TextModelManifest.read(text_dir)
    if found.text_model_id != manifest.text_model_id:
        raise ArtifactError(
            f"index {manifest.version} records text model {manifest.text_model_id}, but {text_dir} holds text model "
            f"{found.text_model_id}"
        )
    check_text_model_pair(found, model_manifest.model_id, f"index {manifest.version}")
    return text_dir


def load_text_model(
    manifest: IndexManifest,
    model_manifest: ModelManifest,
    provider: str = "auto",
    intra_op_threads: int | None = None,
    ort_spinning: bool = False,
    previous: ServingPair | None = None,
) -> TextEncoder | None:
    """The text model `manifest` records (`text_model_dir`, checked) with its ONNX Runtime
    session; the `previous` pair's when it is the same one. None when there is none."""
    text_dir = text_model_dir(manifest, model_manifest)
    if text_dir is None:
        return None
    from index.embedder import OnnxTextEmbedder

    if (
        previous is not None
        and isinstance(previous.text, OnnxTextEmbedder)
        and previous.text.text_model_id == manifest.text_model_id
        and previous.text.text_dir.resolve() == text_dir.resolve()
    ):
        return previous.text
    return OnnxTextEmbedder(text_dir, provider, intra_op_threads, spinning=ort_spinning)


class SearchEngine:
    """Holds the live pair; decodes, embeds and searches against it. It checks nothing a request
    says: the service layer has (`serving.search.checks.RequestChecks`)."""

    # Whether a search may run on the event loop (a lone query by embedding, `serving.search.executors`):
    # one in this process's own faiss index, never a fan-out that waits on other processes.
    searches_inline = True

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._pair: ServingPair | None = None
        # What the first load is doing, for the UNAVAILABLE answered until it is done.
        self.loading: str | None = None
        self._swap_lock = threading.Lock()
        self._planner = Planner()  # each query's plan, and the rows of recent filter masks

    @property
    def pair(self) -> ServingPair:
        pair = self._pair
        if pair is None:
            loading = self.loading
            raise Unavailable(f"not ready: {loading}" if loading else "no model and index are loaded yet")
        return pair

    @property
    def loaded(self) -> bool:
        return self._pair is not None

    def swap(self, new: ServingPair) -> ServingPair | None:
        with self._swap_lock:
            old, self._pair = self._pair, new
        return old

    # -- stages -----------------------------------------------------------------------------

    def model_input(self, pair: ServingPair, image: Image.Image, region: Region | None = None) -> np.ndarray:
        """Decode the pixels of an opened image (`region` of it, when given) and apply the model's
        input contract."""
        with image_errors():
            return decode(image, pair.embedder.contract, region)

    def embed(
        self, pair: ServingPair, inputs: list[np.ndarray] | list[EncodedImage], side_by_side: bool = False
    ) -> np.ndarray:
        """The embeddings of model inputs, or of encoded images for an embedder that decodes them
        (`takes_encoded_images`; UndecodedImages for those that do not decode)."""
        if inputs and isinstance(inputs[0], EncodedImage):
            return pair.embedder.embed_encoded(inputs, side_by_side=side_by_side)
        return pair.embedder.embed(np.stack(inputs), side_by_side=side_by_side)

    def embed_texts(self, pair: ServingPair, ids: list[np.ndarray]) -> np.ndarray:
        """Texts' token ids (checked: `serving.search.checks`) embedded by the pair's text model, in one run."""
        return pair.text.embed_ids(np.stack(ids))

    def search(
        self,
        pair: ServingPair,
        vectors: np.ndarray,
        k: int,
        exclusions: Sequence[Exclusion],
        scopes: list[Scope] | None = None,
        ks: list[int] | None = None,
        deadline: float | None = None,
    ) -> list[Answer]:
        """Top-k per query within its scope, leaving out excluded and deleted rows (`deadline`:
        when the callers stop waiting, for an engine that waits on others; one index does not),
        described. Each query's shape picks its plan (`serving.search.plans`): plain queries
        share one faiss call (searching deeper to make up for excluded rows) — through a
        selector of the live rows while some are deleted (HNSW tombstones) —; queries of one
        filter share one planned search; a min_score is searched alone; grouped queries of one
        scope share each round of their widening search, each to its own k (`ks`, else k)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        scopes = scopes or [EVERY_ROW] * len(vectors)
        version = pair.index_version
        exclude = [e.rows_in(version, s.groups) for e, s in zip(exclusions, scopes, strict=True)]
        answers: list[Answer | None] = [None] * len(vectors)
        for plan, plan_k, members in self._planner.searches(scopes, k, ks):
            found = plan.search(pair, vectors[members], plan_k, [exclude[i] for i in members], scopes[members[0]])
            for i, answer in zip(members, found, strict=True):
                answers[i] = answer
        return described(answers, version, scopes)
