"""The responses `previous_response_id` can refer to: a bounded, in-memory LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object, as GET /v1/responses/{id} returns it
    history: tuple[dict, ...]  # the conversation so far as chat messages, this response's answer last


class ResponseStore:
    """The most recently used responses; past `capacity` the least recently used is forgotten.

    Histories share their message dicts with the responses they continue, so a long
    conversation costs one pointer per message per stored turn, not a copy of its text.
    """

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # read from the request threads, written from the event loop

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
