from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Condition(_message.Message):
    __slots__ = ("field", "value", "any_of", "range")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ANY_OF_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    field: str
    value: str
    any_of: ValueSet
    range: Range
    def __init__(self, field: _Optional[str] = ..., value: _Optional[str] = ..., any_of: _Optional[_Union[ValueSet, _Mapping]] = ..., range: _Optional[_Union[Range, _Mapping]] = ...) -> None: ...

class ValueSet(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("gte", "gt", "lte", "lt")
    GTE_FIELD_NUMBER: _ClassVar[int]
    GT_FIELD_NUMBER: _ClassVar[int]
    LTE_FIELD_NUMBER: _ClassVar[int]
    LT_FIELD_NUMBER: _ClassVar[int]
    gte: float
    gt: float
    lte: float
    lt: float
    def __init__(self, gte: _Optional[float] = ..., gt: _Optional[float] = ..., lte: _Optional[float] = ..., lt: _Optional[float] = ...) -> None: ...

class Filter(_message.Message):
    __slots__ = ("must", "should", "must_not")
    MUST_FIELD_NUMBER: _ClassVar[int]
    SHOULD_FIELD_NUMBER: _ClassVar[int]
    MUST_NOT_FIELD_NUMBER: _ClassVar[int]
    must: _containers.RepeatedCompositeFieldContainer[Condition]
    should: _containers.RepeatedCompositeFieldContainer[Condition]
    must_not: _containers.RepeatedCompositeFieldContainer[Condition]
    def __init__(self, must: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ..., should: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ..., must_not: _Optional[_Iterable[_Union[Condition, _Mapping]]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("x", "y", "width", "height")
    X_FIELD_NUMBER: _ClassVar[int]
    Y_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    x: float
    y: float
    width: float
    height: float
    def __init__(self, x: _Optional[float] = ..., y: _Optional[float] = ..., width: _Optional[float] = ..., height: _Optional[float] = ...) -> None: ...

class QueryPart(_message.Message):
    __slots__ = ("image", "embedding", "item_id", "text", "weight", "negative", "region")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    embedding: Embedding
    item_id: str
    text: str
    weight: float
    negative: bool
    region: Region
    def __init__(self, image: _Optional[bytes] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ..., item_id: _Optional[str] = ..., text: _Optional[str] = ..., weight: _Optional[float] = ..., negative: _Optional[bool] = ..., region: _Optional[_Union[Region, _Mapping]] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("image", "embedding", "item_id", "text", "parts", "region", "group_by", "per_group", "k", "request_id", "label", "exclude_ids", "filter", "min_score", "allow_partial")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    embedding: Embedding
    item_id: str
    text: str
    parts: _containers.RepeatedCompositeFieldContainer[QueryPart]
    region: Region
    group_by: str
    per_group: int
    k: int
    request_id: str
    label: str
    exclude_ids: _containers.RepeatedScalarFieldContainer[str]
    filter: Filter
    min_score: float
    allow_partial: bool
    def __init__(self, image: _Optional[bytes] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ..., item_id: _Optional[str] = ..., text: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[QueryPart, _Mapping]]] = ..., region: _Optional[_Union[Region, _Mapping]] = ..., group_by: _Optional[str] = ..., per_group: _Optional[int] = ..., k: _Optional[int] = ..., request_id: _Optional[str] = ..., label: _Optional[str] = ..., exclude_ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[Filter, _Mapping]] = ..., min_score: _Optional[float] = ..., allow_partial: _Optional[bool] = ...) -> None: ...

class Neighbor(_message.Message):
    __slots__ = ("id", "score", "label", "metadata", "group")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    id: str
    score: float
    label: str
    metadata: _containers.ScalarMap[str, str]
    group: str
    def __init__(self, id: _Optional[str] = ..., score: _Optional[float] = ..., label: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., group: _Optional[str] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("decode_ms", "queue_ms", "embed_ms", "search_ms", "total_ms")
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    EMBED_MS_FIELD_NUMBER: _ClassVar[int]
    SEARCH_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    decode_ms: float
    queue_ms: float
    embed_ms: float
    search_ms: float
    total_ms: float
    def __init__(self, decode_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., embed_ms: _Optional[float] = ..., search_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("neighbors", "request_id", "index_version", "index_id", "model_id", "timings", "truncated", "group_by", "shards_answered", "shards_missing")
    NEIGHBORS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    SHARDS_MISSING_FIELD_NUMBER: _ClassVar[int]
    neighbors: _containers.RepeatedCompositeFieldContainer[Neighbor]
    request_id: str
    index_version: str
    index_id: str
    model_id: str
    timings: StageTimings
    truncated: bool
    group_by: str
    shards_answered: _containers.RepeatedScalarFieldContainer[str]
    shards_missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, neighbors: _Optional[_Iterable[_Union[Neighbor, _Mapping]]] = ..., request_id: _Optional[str] = ..., index_version: _Optional[str] = ..., index_id: _Optional[str] = ..., model_id: _Optional[str] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., truncated: _Optional[bool] = ..., group_by: _Optional[str] = ..., shards_answered: _Optional[_Iterable[str]] = ..., shards_missing: _Optional[_Iterable[str]] = ...) -> None: ...

class SearchBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[SearchRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[SearchRequest, _Mapping]]] = ...) -> None: ...

class SearchBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[SearchResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[SearchResponse, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("image", "request_id")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    request_id: str
    def __init__(self, image: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embedding", "model_id", "request_id", "timings")
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    model_id: str
    request_id: str
    timings: StageTimings
    def __init__(self, embedding: _Optional[_Iterable[float]] = ..., model_id: _Optional[str] = ..., request_id: _Optional[str] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ...) -> None: ...

class FeedbackRequest(_message.Message):
    __slots__ = ("request_id", "relevant_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RELEVANT_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    relevant_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., relevant_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FeedbackResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_k", "max_message_bytes", "max_image_pixels", "max_batch_queries", "max_query_parts", "max_per_group")
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_QUERIES_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERY_PARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    max_k: int
    max_message_bytes: int
    max_image_pixels: int
    max_batch_queries: int
    max_query_parts: int
    max_per_group: int
    def __init__(self, max_k: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_batch_queries: _Optional[int] = ..., max_query_parts: _Optional[int] = ..., max_per_group: _Optional[int] = ...) -> None: ...

class RecallFigure(_message.Message):
    __slots__ = ("source", "k", "value", "samples")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    source: str
    k: int
    value: float
    samples: int
    def __init__(self, source: _Optional[str] = ..., k: _Optional[int] = ..., value: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_id", "index_version", "index_id", "index_size", "embedding_dim", "factory", "limits", "recall_at_k", "ann_recall_at_k", "providers", "deleted_rows", "filterable", "item_field", "text_model_id", "text_context_length")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    FACTORY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    RECALL_AT_K_FIELD_NUMBER: _ClassVar[int]
    ANN_RECALL_AT_K_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    DELETED_ROWS_FIELD_NUMBER: _ClassVar[int]
    FILTERABLE_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_FIELD_NUMBER: _ClassVar[int]
    TEXT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    index_version: str
    index_id: str
    index_size: int
    embedding_dim: int
    factory: str
    limits: Limits
    recall_at_k: _containers.RepeatedCompositeFieldContainer[RecallFigure]
    ann_recall_at_k: _containers.RepeatedCompositeFieldContainer[RecallFigure]
    providers: _containers.RepeatedScalarFieldContainer[str]
    deleted_rows: int
    filterable: _containers.RepeatedCompositeFieldContainer[FilterableField]
    item_field: str
    text_model_id: str
    text_context_length: int
    def __init__(self, model_id: _Optional[str] = ..., index_version: _Optional[str] = ..., index_id: _Optional[str] = ..., index_size: _Optional[int] = ..., embedding_dim: _Optional[int] = ..., factory: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., recall_at_k: _Optional[_Iterable[_Union[RecallFigure, _Mapping]]] = ..., ann_recall_at_k: _Optional[_Iterable[_Union[RecallFigure, _Mapping]]] = ..., providers: _Optional[_Iterable[str]] = ..., deleted_rows: _Optional[int] = ..., filterable: _Optional[_Iterable[_Union[FilterableField, _Mapping]]] = ..., item_field: _Optional[str] = ..., text_model_id: _Optional[str] = ..., text_context_length: _Optional[int] = ...) -> None: ...

class FilterableField(_message.Message):
    __slots__ = ("name", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("index_version", "model_dir", "restore_taken_down")
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    RESTORE_TAKEN_DOWN_FIELD_NUMBER: _ClassVar[int]
    index_version: str
    model_dir: str
    restore_taken_down: bool
    def __init__(self, index_version: _Optional[str] = ..., model_dir: _Optional[str] = ..., restore_taken_down: _Optional[bool] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("index_version", "model_id", "previous_index_version", "reapplied_ids", "restored_ids")
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    REAPPLIED_IDS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_IDS_FIELD_NUMBER: _ClassVar[int]
    index_version: str
    model_id: str
    previous_index_version: str
    reapplied_ids: _containers.RepeatedScalarFieldContainer[str]
    restored_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index_version: _Optional[str] = ..., model_id: _Optional[str] = ..., previous_index_version: _Optional[str] = ..., reapplied_ids: _Optional[_Iterable[str]] = ..., restored_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveItemsRequest(_message.Message):
    __slots__ = ("ids", "reason")
    IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class RemoveItemsResponse(_message.Message):
    __slots__ = ("index_version", "previous_index_version", "removed", "not_found", "index_size")
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    INDEX_SIZE_FIELD_NUMBER: _ClassVar[int]
    index_version: str
    previous_index_version: str
    removed: int
    not_found: _containers.RepeatedScalarFieldContainer[str]
    index_size: int
    def __init__(self, index_version: _Optional[str] = ..., previous_index_version: _Optional[str] = ..., removed: _Optional[int] = ..., not_found: _Optional[_Iterable[str]] = ..., index_size: _Optional[int] = ...) -> None: ...

class NewItem(_message.Message):
    __slots__ = ("id", "image", "embedding", "label", "metadata", "path")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: str
    image: bytes
    embedding: Embedding
    label: str
    metadata: _containers.ScalarMap[str, str]
    path: str
    def __init__(self, id: _Optional[str] = ..., image: _Optional[bytes] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ..., label: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., path: _Optional[str] = ...) -> None: ...

class AddItemsRequest(_message.Message):
    __slots__ = ("items", "upsert")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    UPSERT_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[NewItem]
    upsert: bool
    def __init__(self, items: _Optional[_Iterable[_Union[NewItem, _Mapping]]] = ..., upsert: _Optional[bool] = ...) -> None: ...

class AddItemsResponse(_message.Message):
    __slots__ = ("index_version", "previous_index_version", "added", "replaced", "index_size")
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    INDEX_SIZE_FIELD_NUMBER: _ClassVar[int]
    index_version: str
    previous_index_version: str
    added: int
    replaced: int
    index_size: int
    def __init__(self, index_version: _Optional[str] = ..., previous_index_version: _Optional[str] = ..., added: _Optional[int] = ..., replaced: _Optional[int] = ..., index_size: _Optional[int] = ...) -> None: ...
