"""The HTTP API's OpenAPI 3 document, generated from the code: the paths from `serving.http.ROUTES`,
the schemas from the protobuf descriptors of the messages the routes take and return (in their
proto3 JSON mapping), assembled and checked by apispec."""

from __future__ import annotations

import functools
from typing import Any

from apispec import APISpec
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from protos.simsearch.v1 import search_pb2 as pb
from serving.auth import Scope
from serving.http import IMAGE_TYPES, ROUTES, TIMEOUT_HEADER

TITLE = "simsearch HTTP/JSON API"
API_VERSION = "v1"

_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number", "format": "float"},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int32", "minimum": 0},
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


def message_schema(descriptor: Descriptor) -> dict[str, Any]:
    """A message's proto3 JSON mapping as a JSON Schema: camelCase names, a oneof's members
    described as such, unknown fields refused (json_format refuses them)."""
    properties = {}
    for field in descriptor.fields:
        schema = _field_schema(field)
        if field.containing_oneof is not None and not field.containing_oneof.name.startswith("_"):
            schema = {**schema, "description": f"one of `{field.containing_oneof.name}`"}
        properties[field.json_name] = schema
    return {"type": "object", "properties": properties, "additionalProperties": False}


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


@functools.cache
def openapi_document() -> dict[str, Any]:
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
        spec.components.schema(descriptor.name, message_schema(descriptor))
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
        parameters += [
            {"name": name, "in": "query", "required": False, "schema": {"type": kind}, "description": text}
            for name, kind, text in route.params
        ]
        parameters.append({"name": TIMEOUT_HEADER, "in": "header", "required": False, "schema": {"type": "number"}})
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
