"""The Feedback log: the ids each recent answer returned, by request id, for the Feedback calls
that name one of them."""

from __future__ import annotations

import json
from collections import OrderedDict

from serving.errors import InvalidArgument
from serving.search.engine import ServingPair


class FeedbackLog:
    """The last `window` answers by request id, for Feedback calls naming one of them.

    Each answer is kept as (serial of the load that gave it, ids it returned): the serial, not
    the pair, or the log would keep every pair it saw answering alive; the ids as one JSON text,
    one object an answer instead of a list of strings (the log holds thousands of answers, and
    churns with every query), and ids rather than rows: a sharded server's ingress holds no
    rows to name them by. Only the loop thread touches it: no lock."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def remember(self, request_id: str, serial: int, ids: list[str]) -> None:
        self._recent[request_id] = (serial, json.dumps(ids, ensure_ascii=False))
        while len(self._recent) > self.window:
            self._recent.popitem(last=False)

    def returned_ids(self, request_id: str, live: ServingPair) -> tuple[int, list[str]]:
        """(serial of the load that answered `request_id`, the ids it returned); no ids when
        that load is not `live` (its rows may name other items now)."""
        if not request_id:
            raise InvalidArgument("request_id is required: the id of the answer this feedback is on", "request_id")
        answer = self._recent.get(request_id)
        if answer is None:
            raise InvalidArgument(f"unknown or expired request_id {request_id!r}", "request_id")
        serial, ids = answer
        return serial, json.loads(ids) if live.serial == serial else []
