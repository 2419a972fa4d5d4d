"""The Feedback log: the rows each recent answer returned, by request id, for the Feedback calls
that name one of them."""

from __future__ import annotations

from array import array
from collections import OrderedDict

from serving.engine import ServingPair
from serving.errors import InvalidArgument


class FeedbackLog:
    """The last `window` answers by request id, for Feedback calls naming one of them.

    Each answer is kept as (serial of the load that gave it, rows it returned): the serial, not
    the pair, or the log would keep every pair it saw answering alive; rows, not ids, one small
    array an answer instead of a list of strings (the log holds thousands of answers, and churns
    with every query). Only the loop thread touches it: no lock."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: OrderedDict[str, tuple[int, array]] = OrderedDict()

    def remember(self, request_id: str, serial: int, rows: list[int]) -> None:
        self._recent[request_id] = (serial, array("l", rows))
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
        serial, rows = answer
        return serial, [live.items.ids[r] for r in rows] if live.serial == serial else []
