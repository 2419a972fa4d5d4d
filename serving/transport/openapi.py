"""The HTTP API's OpenAPI 3 document, generated from the code: the paths from `serving.transport.routes.ROUTES`,
the schemas from the protobuf descriptors of the messages the routes take and return (in their
proto3 JSON mapping), assembled and checked by apispec."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from apispec import APISpec
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from core.data.preprocess import MIN_REGION_SIDE
from core.data.text import MAX_TEXT_CHARS
from protos.simsearch.v1 import search_pb2 as pb
from serving.search.checks import DEFAULT_K, MAX_ADD_ITEMS, MIN_SCORE_RANGE
from serving.search.engine import Limits
from serving.transport.auth import Scope
from serving.transport.routes import IMAGE_TYPES, QUERY_BOUNDS, ROUTES, TIMEOUT_HEADER

TITLE = "simsearch HTTP/JSON API"
API_VERSION = "v1"

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the least float32 above 0
_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    # json_format refuses a float past float32's range
    FieldDescriptor.TYPE_FLOAT: {"type": "number", "format": "float", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32", "minimum": -(2**31), "maximum": 2**31 - 1},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32", "minimum": -(2**31), "maximum": 2**31 - 1},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int64", "minimum": 0, "maximum": 2**32 - 1},
    # proto3 JSON writes 64-bit integers as strings
    FieldDescriptor.TYPE_INT64: {"type": "string", "format": "int64"},
    FieldDescriptor.TYPE_UINT64: {"type": "string", "format": "uint64"},
}
_STATUSES = {
    "400": "INVALID_ARGUMENT or FAILED_PRECONDITION: the message names the field",
    "401": "UNAUTHENTICATED: no `Authorization: Bearer` token",
    "403": "PERMISSION_DENIED: a wrong token, or admin calls on a server without one",
    "404": "NOT_FOUND: no such route, item or version",
    "413": "the body, or the image's pixels, exceed the server's limits",
    "415": "a Content-Type the route does not take",
    "429": "RESOURCE_EXHAUSTED: the server's queue is full",
    "503": "UNAVAILABLE: no model and index loaded yet",
    "504": "DEADLINE_EXCEEDED: past the `X-Request-Timeout`",
}


def _field_schema(field: FieldDescriptor) -> dict[str, Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        entry = field.message_type
        if entry.GetOptions().map_entry:
            return {"type": "object", "additionalProperties": _field_schema(entry.fields_by_name["value"])}
        schema: dict[str, Any] = {"$ref": f"#/components/schemas/{entry.name}"}
    elif field.type == FieldDescriptor.TYPE_ENUM:
        schema = _enum_schema(field.enum_type)
    else:
        schema = dict(_SCALARS[field.type])
    if field.is_repeated:
        return {"type": "array", "items": schema}
    return schema


def _enum_schema(enum: EnumDescriptor) -> dict[str, Any]:
    return {"type": "string", "enum": [value.name for value in enum.values]}


@dataclass(frozen=True)
class Served:
    """What the rules of a request depend on beyond the protos: the server's limits and, once a
    pair is live, its model's dimension and the fields its index version declares."""

    limits: Limits = Limits()
    dim: int | None = None
    filterable: tuple[tuple[str, str], ...] = ()  # (name, string|int|float)
    item_field: str | None = None


def _rules(served: Served) -> dict[str, dict[str, dict[str, Any]]]:
    """What the service layer checks of a message's fields (`serving.search.checks`, the filters), as
    JSON Schema keywords merged into the fields' schemas: the same constants, not restated."""
    limits = served.limits
    low, high = MIN_SCORE_RANGE
    positive = {"minimum": 0, "exclusiveMinimum": True}
    values: dict[str, Any] = {"minItems": 1}
    if served.dim:  # a unit vector of the live model's dimension: not all zero
        # not all zero as float32 reads them: a value within half float32's least above 0 is 0
        zero = {"minimum": -FLOAT32_TINY / 2, "maximum": FLOAT32_TINY / 2}
        values = {"minItems": served.dim, "maxItems": served.dim, "not": {"items": zero}}
    search_request: dict[str, dict[str, Any]] = {
        "k": {
            "minimum": 0,
            "maximum": limits.max_k,
            "description": f"0 or left out: {DEFAULT_K}; with minScore, up to maxK",
        },
        "perGroup": {"minimum": 1, "maximum": limits.max_per_group, "description": "1 when left out"},
        "minScore": {"minimum": low, "maximum": high},
        "parts": {"minItems": 1, "maxItems": limits.max_query_parts},
        "image": {"minLength": 1},
        "text": TEXT_RULES,
    }
    if served.filterable:
        search_request["groupBy"] = {"enum": ["", *(name for name, _ in served.filterable)]}
    return {
        "SearchRequest": search_request,
        "QueryPart": {"weight": positive, "image": {"minLength": 1}, "text": TEXT_RULES},
        "Embedding": {"values": values},
        "Region": {"x": {"minimum": 0}, "y": {"minimum": 0}, "width": {"minimum": MIN_REGION_SIDE},
                   "height": {"minimum": MIN_REGION_SIDE}},
        "SearchBatchRequest": {"requests": {"maxItems": limits.max_batch_queries}},
        "EmbedRequest": {"image": {"minLength": 1}},
        "FeedbackRequest": {"requestId": {"minLength": 1}},
        "RemoveItemsRequest": {"ids": {"minItems": 1, "minLength": 1}},
        "AddItemsRequest": {"items": {"minItems": 1, "maxItems": MAX_ADD_ITEMS}},
        "NewItem": {"id": {"minLength": 1}, "image": {"minLength": 1}},
        "ValueSet": {"values": {"minItems": 1}},
    }  # fmt: skip


# A query's text: what `core.data.text.check_text` checks; its tokens against the text model's context
# (GetInfo's textContextLength) are the one rule a schema cannot count.
TEXT_RULES: dict[str, Any] = {
    "minLength": 1,
    "maxLength": MAX_TEXT_CHARS,
    "pattern": r"\S",
    "description": "a phrase for the version's text model (GetInfo's textModelId); at most textContextLength tokens",
}


def _one_of(descriptor: Descriptor, name: str, alone_with: dict[str, tuple[str, ...]]) -> list[dict[str, Any]]:
    """Exactly one member of the oneof `name` (or of `alone_with`'s keys): required
    alternatives, each barring the fields only another member may come with."""
    members = [f.json_name for f in descriptor.oneofs_by_name[name].fields] + [
        m for m in alone_with if m not in [f.json_name for f in descriptor.oneofs_by_name[name].fields]
    ]
    companions = {c for cs in alone_with.values() for c in cs}
    alternatives = []
    for member in members:
        barred = sorted((set(members) | companions) - {member} - set(alone_with.get(member, ())))
        alternative: dict[str, Any] = {"required": [member]}
        if barred:
            alternative["not"] = {"anyOf": [{"required": [b]} for b in barred]}
        alternatives.append(alternative)
    return alternatives


def _structure(descriptor: Descriptor, served: Served) -> dict[str, Any]:
    """The rules across a message's fields: which must be there, and which exclude others."""
    name = descriptor.name
    if name == "SearchRequest":  # one query: image (with a region or not), embedding, item id or parts
        structure = {"oneOf": _one_of(descriptor, "query", {"image": ("region",), "parts": ()})}
        # rows per group only where there are groups: not with groupBy "", nor unset without an item field
        ungrouped: list[dict[str, Any]] = [{"required": ["groupBy"], "properties": {"groupBy": {"enum": [""]}}}]
        if served.filterable and not served.item_field:
            ungrouped.append({"not": {"required": ["groupBy"]}})
        structure["not"] = {"required": ["perGroup"], "anyOf": ungrouped}
        return structure
    if name == "QueryPart":
        return {"oneOf": _one_of(descriptor, "query", {"image": ("region",)})}
    if name == "Condition":
        names = [n for n, _ in served.filterable]
        field: dict[str, Any] = {"type": "string", "minLength": 1}
        if names:
            field = {"type": "string", "enum": names}
        numeric = [n for n, kind in served.filterable if kind != "string"]
        structure: dict[str, Any] = {"required": ["field"], "oneOf": _one_of(descriptor, "match", {})}
        structure["properties"] = {"field": field}
        if served.filterable:  # a range on a numeric field only; values only on string and int fields
            strings = [n for n, kind in served.filterable if kind != "float"]
            structure["allOf"] = [
                {"anyOf": [{"not": {"required": ["range"]}}, {"properties": {"field": {"enum": numeric or [""]}}}]},
                {"anyOf": [{"required": ["range"]}, {"properties": {"field": {"enum": strings or [""]}}}]},
            ]
        return structure
    if name == "Range":
        return {"minProperties": 1}
    if name == "Filter":  # at least one condition
        return {"anyOf": [{"required": [f.json_name], "properties": {f.json_name: {"minItems": 1}}}
                          for f in descriptor.fields]}  # fmt: skip
    if name in ("Embedding", "ValueSet"):
        return {"required": ["values"]}
    if name == "ReloadRequest" and "restoreTakenDown" in [f.json_name for f in descriptor.fields]:
        # restoring what was taken down since a version names the version
        restoring = {"required": ["restoreTakenDown"], "properties": {"restoreTakenDown": {"enum": [True]}}}
        named = {"required": ["indexVersion"], "properties": {"indexVersion": {"minLength": 1}}}
        return {"anyOf": [{"not": restoring}, named]}
    if name == "EmbedRequest":
        return {"required": ["image"]}
    if name == "FeedbackRequest":
        return {"required": ["requestId"]}
    if name == "RemoveItemsRequest":
        return {"required": ["ids"]}
    if name == "AddItemsRequest":
        return {"required": ["items"]}
    if name == "NewItem":  # an id, and its image or its embedding
        return {"required": ["id"], "oneOf": _one_of(descriptor, "content", {})}
    return {}


def _named(structure: Any) -> set[str]:
    """The fields a message's rules across fields name (required, or narrowed)."""
    if isinstance(structure, list):
        return set().union(*(_named(s) for s in structure)) if structure else set()
    if not isinstance(structure, dict):
        return set()
    names = set(structure.get("required", ())) | set(structure.get("properties", {}))
    return names.union(*(_named(v) for k, v in structure.items() if k not in ("required", "properties")))


def message_schema(descriptor: Descriptor, served: Served = Served()) -> dict[str, Any]:
    """A message's proto3 JSON mapping as a JSON Schema: camelCase names, a oneof's members
    described as such, unknown fields refused (json_format refuses them), and what the service
    layer checks of it (bounds, required fields, the one query) stated."""
    rules = _rules(served).get(descriptor.name, {})
    properties = {}
    for field in descriptor.fields:
        schema = _field_schema(field)
        if field.containing_oneof is not None and not field.containing_oneof.name.startswith("_"):
            schema = {**schema, "description": f"one of `{field.containing_oneof.name}`"}
        rule = rules.get(field.json_name, {})
        if rule and schema.get("type") == "array" and field.type != FieldDescriptor.TYPE_MESSAGE:
            item_rule = {k: v for k, v in rule.items() if k not in ("minItems", "maxItems", "not", "description")}
            schema = {**schema, **{k: v for k, v in rule.items() if k not in item_rule}}
            schema["items"] = {**schema["items"], **item_rule}
        elif rule:
            if "$ref" in schema:  # OpenAPI 3.0 ignores the siblings of a $ref
                schema = {"allOf": [schema]}
            schema = {**schema, **rule}
        properties[field.json_name] = schema
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    structure = _structure(descriptor, served)
    # json_format reads null as the field left out: so may a client send it, where no rule across
    # fields tells a field left out from one given (those refuse null, as null is not their value)
    tied = _named(structure) | (set(properties) if "minProperties" in structure else set())
    for name in set(properties) - tied:
        field = properties[name]
        properties[name] = {"allOf": [field], "nullable": True} if "$ref" in field else {**field, "nullable": True}
    if "properties" in structure:  # narrower schemas for fields already described
        extra = structure.pop("properties")
        for name, narrower in extra.items():
            properties[name] = {**properties[name], **narrower}
    return {**schema, **structure}


def _messages() -> list[Descriptor]:
    """Every message of the API's file, nested map entries left to their fields."""
    return [d for d in pb.DESCRIPTOR.message_types_by_name.values()]


def _error_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "the gRPC status code's name"},
                    "message": {"type": "string"},
                },
                "required": ["code", "message"],
            }
        },
        "required": ["error"],
    }


def _query_parameter(name: str, kind: str, text: str, served: Served) -> dict[str, Any]:
    """A query parameter with what the route and the service layer check of it."""
    parameter: dict[str, Any] = {"name": name, "in": "query", "required": False, "description": text}
    if name == "filter":  # a Filter in its proto3 JSON, as the parameter's value
        parameter["content"] = _json_ref("Filter")
        return parameter
    schema: dict[str, Any] = {"type": kind}
    bounds = {
        "k": (0, served.limits.max_k),
        "perGroup": (1, served.limits.max_per_group),
        "minScore": MIN_SCORE_RANGE,
        **QUERY_BOUNDS,
    }
    if name in bounds:
        schema["minimum"], schema["maximum"] = bounds[name]
    if name == "groupBy" and served.filterable:
        schema["enum"] = ["", *(field for field, _ in served.filterable)]
    if name == "region":
        number = r"\d+(\.\d+)?"
        schema["pattern"] = f"^{number},{number},{number},{number}$"
    parameter["schema"] = schema
    return parameter


@functools.cache
def openapi_document(served: Served = Served()) -> dict[str, Any]:
    """The document for a server with these limits and live pair (the defaults: any server's)."""
    spec = APISpec(
        title=TITLE,
        version=API_VERSION,
        openapi_version="3.0.3",
        info={
            "description": "The HTTP/JSON face of `simsearch.v1.SimilaritySearch` and `IndexAdmin`: the same "
            "calls, answered by the same service layer, with bodies in the messages' proto3 JSON mapping. "
            f"A deadline is the `{TIMEOUT_HEADER}` header, in seconds."
        },
    )
    for descriptor in _messages():
        spec.components.schema(descriptor.name, message_schema(descriptor, served))
    spec.components.schema("Error", _error_schema())
    spec.components.security_scheme("bearer", {"type": "http", "scheme": "bearer"})
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        operation: dict[str, Any] = {
            "operationId": route.call,
            "summary": route.summary,
            "tags": [route.tag],
            "responses": {
                "200": _ok(route),
                **{code: {"description": text, "content": _json_ref("Error")} for code, text in _STATUSES.items()},
            },
        }
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in ("item_id", "version")
            if f"{{{name}}}" in route.path
        ]
        parameters += [_query_parameter(name, kind, text, served) for name, kind, text in route.params]
        parameters.append(
            {
                "name": TIMEOUT_HEADER,
                "in": "header",
                "required": False,
                "schema": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
                "description": "the call's deadline, in seconds (above 0)",
            }
        )
        operation["parameters"] = parameters
        if route.request is not None:
            operation["requestBody"] = {"required": True, "content": _json_ref(route.request.DESCRIPTOR.name)}
        elif route.body == "image":
            binary = {"schema": {"type": "string", "format": "binary"}}
            operation["requestBody"] = {
                "required": True,
                "content": {
                    **{f"{kind}*" if kind.endswith("/") else kind: binary for kind in IMAGE_TYPES},
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "properties": {"image": {"type": "string", "format": "binary"}},
                            "required": ["image"],
                            "additionalProperties": False,
                        }
                    },
                },
            }
        if route.scope is Scope.ADMIN:
            operation["security"] = [{"bearer": []}]
            operation["description"] = "Needs the admin token (`Authorization: Bearer …`)."
        elif route.scope is Scope.SEARCH:
            operation["security"] = [{"bearer": []}, {}]
            operation["description"] = "Needs the search token when the server was started with one."
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    for path, operations in paths.items():
        spec.path(path=path, operations=operations)
    return spec.to_dict()


def _json_ref(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _ok(route) -> dict[str, Any]:
    if route.response is not None:
        return {"description": route.response.DESCRIPTOR.name, "content": _json_ref(route.response.DESCRIPTOR.name)}
    if route.produces == "application/json":
        return {"description": "JSON", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "description": route.produces,
        "content": {route.produces: {"schema": {"type": "string", "format": "binary"}}},
    }
