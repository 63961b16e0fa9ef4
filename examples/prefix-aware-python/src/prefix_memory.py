"""Which decode endpoint holds which prompt prefix: a bounded LRU map from prefix hashes to
endpoint ids. Pure Python with no WIT types, so it is unit-tested natively
(`python3 -m unittest discover examples/prefix-aware-python/tests`)."""

from collections import OrderedDict
from typing import Iterable, List, Optional, Sequence


def page_hashes(tokens: Sequence[int], page_size: int, max_pages: int) -> List[int]:
    """Chained hashes of the first full pages of `tokens`, shortest prefix first.

    Hash `i` covers pages `0..=i`, so two prompts share hash `i` exactly when (barring
    collisions) they share their first `i + 1` pages: the unit a paged prefix cache reuses.
    A partial last page is ignored, as an engine's prefix cache ignores it. Python hashes of
    ints and tuples of ints are not randomized per process, so hashes stay stable."""
    hashes: List[int] = []
    running = 0
    full_pages = min(len(tokens) // page_size, max_pages)
    for page in range(full_pages):
        start = page * page_size
        running = hash((running, tuple(tokens[start : start + page_size])))
        hashes.append(running)
    return hashes


class PrefixMemory:
    """An LRU map: prefix hash -> the decode endpoint that last served that prefix."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._owner: "OrderedDict[int, int]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def lookup(self, hashes: Sequence[int]) -> Optional[int]:
        """The endpoint that served the longest remembered prefix among `hashes`."""
        for h in reversed(hashes):
            endpoint = self._owner.get(h)
            if endpoint is not None:
                self._owner.move_to_end(h)
                return endpoint
        return None

    def remember(self, hashes: Iterable[int], endpoint: int) -> None:
        """Record that `endpoint` now holds every prefix in `hashes`."""
        for h in hashes:
            self._owner[h] = endpoint
            self._owner.move_to_end(h)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)

    def forget(self, hashes: Iterable[int], endpoint: int) -> None:
        """Drop the prefixes in `hashes` that point at `endpoint` (it failed to serve them)."""
        for h in hashes:
            if self._owner.get(h) == endpoint:
                del self._owner[h]


class Pending:
    """Prefix hashes of requests still running, by request id, so `on-complete` can learn
    from how they ended. Bounded: a request whose outcome never arrives is dropped oldest
    first."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._hashes: "OrderedDict[int, List[int]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def put(self, request_id: int, hashes: List[int]) -> None:
        self._hashes[request_id] = hashes
        self._hashes.move_to_end(request_id)
        while len(self._hashes) > self._capacity:
            self._hashes.popitem(last=False)

    def take(self, request_id: int) -> List[int]:
        return self._hashes.pop(request_id, [])
