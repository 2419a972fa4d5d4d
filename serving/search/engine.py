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
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import faiss
import numpy as np
import pyarrow as pa
from PIL import Image

from core import artifacts
from core.artifacts import ArtifactError
from core.config import option
from core.index_manifest import IndexManifest, check_model_index_pair
from core.items import ItemTable
from core.model_manifests import ModelManifest, TextModelManifest, check_text_model_pair
from core.preprocess import DEFAULT_MAX_PIXELS, EncodedImage, Region, decode
from core.ranking import best_k
from core.text import TextTokenizer
from index.search import range_search
from index.search.faiss_search import OVERFETCH_DELETED, ExactRerank, search_live, search_within
from index.search.filters import Filter
from index.search.grouping import Groups, search_groups
from index.versions.version import IndexVersion
from serving.errors import ServiceError, Unavailable, image_errors

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


@dataclass(slots=True)
class Hit:
    """A row of an answer, its score, and what the service answers of it — filled from the rows'
    items where the rows are (`described`): on `serve --ray`, by the shard holding the row, so
    the ingress answers from its hits alone."""

    row: int
    score: float
    group: str | None = None  # a grouped answer's: the row's value of the group-by field
    id: str = ""
    label: str | None = None
    metadata: str = "{}"  # JSON text, as the items table keeps it
    item: str | None = None  # rows without labels: the item field's value (what a labelled query names)


def described(answers: Sequence[Answer], version: IndexVersion, scopes: Sequence[Scope]) -> list[Answer]:
    """`answers` over `version`'s rows with every hit's id, label and metadata filled in from its
    items (one gather for them all), a grouped answer's group values from its scope's groups, and
    — the rows unlabelled — each row's item-field value."""
    hits = [h for a in answers for h in a.hits]
    if not hits:
        return list(answers)
    rows = np.fromiter((h.row for h in hits), dtype=np.int64, count=len(hits))
    items = version.items
    taken = items.to_arrow().select(["id", "label", "metadata"]).take(pa.array(rows))
    ids, labels, metadata = (taken.column(c).to_pylist() for c in ("id", "label", "metadata"))
    item_field = version.manifest.item_field
    item_values = None
    if item_field and not items.labelled:
        item_values = version.groups(item_field).values_of(rows)
    for j, hit in enumerate(hits):
        hit.id, hit.label, hit.metadata = ids[j], labels[j], metadata[j]
        if item_values is not None:
            hit.item = item_values[j]
    start = 0
    for answer, scope in zip(answers, scopes, strict=True):
        end = start + len(answer.hits)
        if scope.groups is not None and answer.hits:
            for hit, value in zip(answer.hits, scope.groups.values_of(rows[start:end]), strict=True):
                hit.group = value
        start = end
    return list(answers)


@dataclass(frozen=True, slots=True)
class Scope:
    """Which rows may answer a query, beyond the rows it excludes: `allowed`, a bool per row of
    the pair (a filter's matches; None: every row), and `min_score`, the least cosine similarity
    of an answer (None: the top k, whatever their scores). With `groups`, k counts groups of
    that field, each answering with up to `per_group` rows (`index.search.grouping`)."""

    allowed: np.ndarray | None = None
    min_score: float | None = None
    groups: Groups | None = None
    per_group: int = 1
    # The filter `allowed` was made from: what a sharded search sends its shards, each making
    # its own mask from its own filters (`serving.shards.sharded`).
    filter: Filter | None = None
    # The field `groups` groups by (a sharded server's ingress names it and holds no `groups`:
    # its shards group their own rows).
    group_by: str | None = None

    def __post_init__(self) -> None:
        if self.groups is not None and self.group_by is None:
            object.__setattr__(self, "group_by", self.groups.name)

    @property
    def plain(self) -> bool:
        return self.filter is None and self.allowed is None and self.min_score is None and self.group_by is None


EVERY_ROW = Scope()


@dataclass(frozen=True, slots=True)
class Exclusion:
    """What a query leaves out of its answer beyond its scope: `rows` by number, items by id
    (`ids`: a request's exclude_ids, an item query's own) and whole groups by value of the
    query's group-by field (`groups`: a grouped item query's own). Ids and values rather than
    rows, so a sharded server's shards resolve them over their own rows (`rows_in`) and the
    ingress needs none."""

    rows: frozenset[int] = frozenset()
    ids: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()

    def rows_in(self, version: IndexVersion, groups: Groups | None) -> frozenset[int]:
        """Its rows among `version`'s: `rows`, each id's live rows and — grouped by `groups` —
        every row of each group it names."""
        if not self.ids and (groups is None or not self.groups):
            return self.rows
        found = set(self.rows)
        for item_id in self.ids:
            row = version.row_of(item_id)
            if row is not None:
                found.add(row)
        if groups is not None:
            for value in self.groups:
                code = groups.code_of(value)
                if code is not None:
                    found.update(groups.rows_of(code).tolist())
        return frozenset(found)


NOTHING_EXCLUDED = Exclusion()


def _short(found: int, k: int, candidates: int) -> bool:
    """A top-k answer cut short: fewer than k hits though more rows could have answered — an
    approximate index that ran out of candidates (IVF probing too few lists, say)."""
    return found < k and found < candidates


@dataclass(slots=True)
class Answer:
    """A query's hits, best first; `truncated` when rows that qualify were left out of it: more
    reach its `min_score` than it holds, or a top-k answer holds fewer than k though more rows
    could have answered (`_short`)."""

    hits: list[Hit]
    truncated: bool = False
    path: str | None = None  # a filtered query's: the planner's choice, exact or index (faiss_index.search_within)
    candidates: int | None = None  # a grouped query's: rows its deciding round searched (EXACT_PASS: all)
    # A sharded search's (`serving.shards.sharded`): the shards that answered, those that did not, and
    # why — the service fails the query UNAVAILABLE with it unless the request allowed a partial answer.
    shards_answered: tuple[str, ...] = ()
    shards_missing: tuple[str, ...] = ()
    unavailable: str | None = None


class SearchEngine:
    """Holds the live pair; decodes, embeds and searches against it. It checks nothing a request
    says: the service layer has (`serving.search.checks.RequestChecks`)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._pair: ServingPair | None = None
        # What the first load is doing, for the UNAVAILABLE answered until it is done.
        self.loading: str | None = None
        self._swap_lock = threading.Lock()
        # The rows of recent filter masks (the service reuses a filter's mask): listing the rows
        # of a 1M-row mask costs about half of a lone 1% query's exact search.
        self._mask_rows: OrderedDict[int, tuple[weakref.ref, np.ndarray]] = OrderedDict()
        self._mask_rows_lock = threading.Lock()

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
        when the callers stop waiting, for an engine that waits on others; one index does not). Plain
        queries share one faiss call (searching deeper to make up for excluded rows) — through
        a selector of the live rows while some are deleted (HNSW tombstones) —; queries of one
        filter share one planned search; a min_score is searched alone; grouped queries of one
        scope share each round of their widening search, each to its own k (`ks`, else k)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        scopes = scopes or [EVERY_ROW] * len(vectors)
        version = pair.index_version
        exclude = [e.rows_in(version, s.groups) for e, s in zip(exclusions, scopes, strict=True)]
        answers: list[Answer | None] = [None] * len(vectors)
        grouped: dict[tuple, list[int]] = {}
        for i, scope in enumerate(scopes):
            if scope.groups is not None:
                key = (id(scope.groups), id(scope.allowed), scope.min_score, scope.per_group, ks[i] if ks else k)
                grouped.setdefault(key, []).append(i)
        for members in grouped.values():
            scope = scopes[members[0]]
            found = self.search_grouped(
                pair, vectors[members], ks[members[0]] if ks else k, [exclude[i] for i in members], scope
            )
            for i, answer in zip(members, found, strict=True):
                answers[i] = answer
        plain = [i for i, s in enumerate(scopes) if s.plain]
        live, deleted = pair.index_version.live_mask, len(pair.index_version.deleted)
        if plain and live is not None and deleted > OVERFETCH_DELETED:
            found = self.search_filtered(pair, vectors[plain], k, [exclude[i] for i in plain], live)
            for i, answer in zip(plain, found, strict=True):
                answers[i] = Answer(answer.hits)  # not a filtered query: no planner path counted
        elif plain:
            # A few tombstones (a segmented version's takedowns and upserts) are dropped from an
            # answer asked that much deeper: the index's own search, not the planner's.
            skips = [exclude[i] for i in plain]
            depth = min(k + max((len(e) for e in skips), default=0), pair.index.ntotal)
            scores, rows = search_live(pair.index, pair.vectors, vectors[plain], depth, live, deleted)
            size = pair.index_version.size
            for i, s_row, r_row, skip in zip(plain, scores, rows, skips, strict=True):
                hits = [Hit(int(r), float(s)) for s, r in zip(s_row, r_row, strict=True) if r >= 0 and r not in skip]
                answers[i] = Answer(hits[:k], _short(len(hits), k, size - len(skip)))
        # Filtered queries sharing one mask (the service hands out one array per distinct filter)
        # share one search: one gather of its rows, or one faiss call with its selector.
        filtered: dict[int, list[int]] = {}
        for i, answer in enumerate(answers):
            if answer is None and scopes[i].allowed is not None and scopes[i].min_score is None:
                filtered.setdefault(id(scopes[i].allowed), []).append(i)
        for group in filtered.values():
            found = self.search_filtered(pair, vectors[group], k, [exclude[i] for i in group], scopes[group[0]].allowed)
            for i, answer in zip(group, found, strict=True):
                answers[i] = answer
        for i, answer in enumerate(answers):
            if answer is None:
                answers[i] = self.search_scoped(pair, vectors[i], k, exclude[i], scopes[i])
        return described(answers, pair.index_version, scopes)

    def search_grouped(
        self, pair: ServingPair, vectors: np.ndarray, k: int, exclude: list[frozenset[int]], scope: Scope
    ) -> list[Answer]:
        """The top k groups of each query within the scope (`index.search.grouping.search_groups`), as
        hits group by group, best group first."""
        live = pair.index_version.live_mask
        allowed = scope.allowed
        if live is not None:
            allowed = live if allowed is None else allowed & live
        found = search_groups(
            pair.index, pair.vectors, vectors, k, scope.groups, scope.per_group, allowed, exclude, scope.min_score
        )
        return [
            Answer(
                [Hit(row, score) for _, hits in g.groups for row, score in hits],
                g.truncated,
                candidates=g.candidates,
            )
            for g in found
        ]

    def search_filtered(
        self, pair: ServingPair, vectors: np.ndarray, k: int, exclude: list[frozenset[int]], allowed: np.ndarray
    ) -> list[Answer]:
        """Top-k of each query among the rows `allowed` marks (less deleted rows), excluded rows
        left out: k hits whenever k rows match. The planner (`search_within`) picks exact search
        over the rows or the index's search with a selector, by how many rows the filter keeps."""
        if pair.index_version.live_mask is not None:
            allowed = allowed & pair.index_version.live_mask
        # Excluded rows (few: an item_id query's own, a request's exclude_ids) are searched past
        # rather than masked, so queries of one filter keep one mask.
        depth = k + max((len(e) for e in exclude), default=0)
        matching = self._rows_of(allowed)
        scores, rows, path = search_within(pair.index, pair.vectors, vectors, depth, allowed, rows=matching)
        answers = []
        for s_row, r_row, skip in zip(scores, rows, exclude, strict=True):
            hits = [Hit(int(r), float(s)) for s, r in zip(s_row, r_row, strict=True) if r >= 0 and r not in skip]
            answers.append(Answer(hits[:k], _short(len(hits), k, len(matching) - len(skip)), path=path))
        return answers

    def _rows_of(self, mask: np.ndarray) -> np.ndarray:
        """`np.flatnonzero(mask)`, kept for the last 16 masks while they live (masks are not
        written to once made: the service's are read-only)."""
        with self._mask_rows_lock:
            kept = self._mask_rows.get(id(mask))
            if kept is not None and kept[0]() is mask:
                self._mask_rows.move_to_end(id(mask))
                return kept[1]
        rows = np.flatnonzero(mask)
        if not mask.flags.writeable:
            with self._mask_rows_lock:
                self._mask_rows[id(mask)] = (weakref.ref(mask), rows)
                while len(self._mask_rows) > 16:
                    self._mask_rows.popitem(last=False)
        return rows

    def search_scoped(
        self, pair: ServingPair, vector: np.ndarray, k: int, exclude: frozenset[int], scope: Scope
    ) -> Answer:
        """One query with a min_score: the index's own range search (`index.search.range_search`),
        bounded by k — or, with a filter too, exact search over the filter's rows (deleted and
        excluded rows left out) keeping those at or above the min_score."""
        live = pair.index_version.live_mask
        if scope.allowed is None:
            found = range_search.reaching(pair.index, vector[None], scope.min_score, k, live, [exclude])[0]
            hits = [Hit(int(r), float(s)) for r, s in zip(found.rows, found.scores, strict=True)]
            return Answer(hits, found.truncated)
        allowed = scope.allowed & live if live is not None else scope.allowed.copy()  # the mask is shared
        allowed[list(exclude)] = False
        rows = np.flatnonzero(allowed)
        scores = np.asarray(pair.vectors[rows] @ vector, dtype=np.float32)
        reaching = scores >= scope.min_score
        rows, scores = rows[reaching], scores[reaching]
        top = best_k(scores, k)  # rows ascending: ties to the lower row
        return Answer([Hit(int(rows[j]), float(scores[j])) for j in top], len(rows) > k)
