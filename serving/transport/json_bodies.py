"""Proto3 JSON bodies of the HTTP API: a message read from a request's JSON and written back, with
the errors a user can act on — a query kind set twice, a number past int32, too many items —
said before anything is decoded."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from protos.simsearch.v1 import search_pb2 as pb
from serving.errors import InvalidArgument, ServiceError
from serving.search.checks import check_item_count

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# A SearchRequest field's proto name → the service layer's check of its value (raising ServiceError)
FieldChecks = dict[str, Callable[[int], object]]


def to_json(message: Message) -> dict[str, Any]:
    """A message's proto3 JSON mapping, every field present (a client need not know defaults)."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


def parse_json(
    text: bytes,
    message: Message,
    bounded: FieldChecks | None = None,
    before: Callable[[dict], None] | None = None,
) -> Message:
    """A JSON body as `message`; `bounded`: SearchRequest fields whose numbers past int32 are
    refused by their own check (`past_int32`) rather than by json_format, which names no range;
    `before`: a check of the JSON object that runs before json_format decodes it (every bytes
    field's base64, every number one by one), for what can be refused without that work."""
    if not text.strip():
        raise InvalidArgument(f"empty body: send a {message.DESCRIPTOR.name} as JSON")
    name = message.DESCRIPTOR.name
    try:
        value = json.loads(text)
    except UnicodeDecodeError:
        raise InvalidArgument("body is not UTF-8 JSON") from None
    except ValueError as exc:
        raise InvalidArgument(f"body is not a {name} in proto3 JSON: {exc}") from None
    # json_format takes a list or a string for a message too (it iterates them): only an object is one
    if not isinstance(value, dict):
        raise InvalidArgument(f"body is not a {name}: a JSON object is expected, got {type(value).__name__}")
    if bounded:
        past_int32(value, message.DESCRIPTOR, bounded)
    if before is not None:
        before(value)
    try:
        return json_format.ParseDict(value, message)
    except json_format.ParseError as exc:
        both = one_of_twice(value, message.DESCRIPTOR)
        raise InvalidArgument(both or f"body is not a {name} in proto3 JSON: {exc}") from None


# How to ask what a body with two query fields means to ask, by the message that has them.
COMBINE_HINT = {
    "SearchRequest": '; to combine them (an image with words, say), send each as one of parts: {"parts": '
    '[{"image": …}, {"text": …}]}',
    "QueryPart": "; send each as a part of its own",
}


def one_of_twice(value: dict, descriptor: Descriptor, place: str = "") -> str | None:
    """The message for a JSON object (or one nested in it: a batch's `requests[3]`) that sets more
    than one field of a oneof, naming the fields it set; None when none does. json_format's own
    names the oneof and the message type, not the fields: `should not have multiple "query"
    oneof fields`."""
    for oneof in descriptor.oneofs:
        given = [f.json_name for f in oneof.fields if f.json_name in value or f.name in value]
        if len(given) > 1:
            named = " and ".join(given) if len(given) == 2 else f"{', '.join(given[:-1])} and {given[-1]}"
            choices = [f.json_name for f in oneof.fields]
            return (
                f"{place}{named} are {'both' if len(given) == 2 else 'all'} set: a {descriptor.name} takes one "
                f"{oneof.name} ({', '.join(choices[:-1])} or {choices[-1]}){COMBINE_HINT.get(descriptor.name, '')}"
            )
    for field in descriptor.fields:
        given = value.get(field.json_name, value.get(field.name))
        if field.message_type is None or given is None:
            continue
        nested = given if field.is_repeated and isinstance(given, list) else [given]
        for i, part in enumerate(nested):
            if isinstance(part, dict):
                where = f"{place}{field.json_name}[{i}]: " if field.is_repeated else f"{place}{field.json_name}: "
                if found := one_of_twice(part, field.message_type, where):
                    return found
    return None


def whole_number(value: object) -> int | None:
    """A JSON value proto3 JSON reads as an integer (a number, or a string of one), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (int, str)):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def past_int32(value: dict, descriptor: Descriptor, bounded: FieldChecks, place: str = "") -> None:
    """Each SearchRequest field of `bounded` in a JSON object (nested ones too: a batch's
    `requests[3]`) given a number past int32, refused by the field's own check — the range every
    transport states for it."""
    for field in descriptor.fields:
        given = value.get(field.json_name, value.get(field.name))
        if given is None:
            continue
        if field.message_type is not None:
            parts = given if field.is_repeated else [given]
            if not isinstance(parts, list):  # a map, an object of entries: none is a SearchRequest
                continue
            for i, part in enumerate(parts):
                if isinstance(part, dict):
                    where = f"{place}{field.json_name}[{i}]: " if field.is_repeated else place
                    past_int32(part, field.message_type, bounded, where)
        elif field.containing_type is pb.SearchRequest.DESCRIPTOR and field.name in bounded:
            number = whole_number(given)
            if number is not None and not INT32_MIN <= number <= INT32_MAX:
                try:
                    bounded[field.name](number)
                except ServiceError as exc:
                    raise type(exc)(f"{place}{exc.message}", exc.field) from None


def count_items(body: dict) -> None:
    """An AddItems body's items counted in its JSON: json_format would first decode every image's
    base64 and every embedding's numbers, seconds for a call refused by its count alone."""
    items = body.get("items")
    if isinstance(items, list):  # anything else is json_format's to refuse, naming the field
        check_item_count(len(items))
