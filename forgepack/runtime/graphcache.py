"""Graph mode's cache: least recently used out first, bounded by count and bytes (pure, no CUDA).

Part of the pack runtime: torch and the standard library only.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

DEFAULT_MAX_GRAPHS = 8
_MAX_REMEMBERED = 256  # signatures whose warm-up count or failure is remembered (LRU)


class GraphCache:
    """An LRU map from signature to captured graph, bounded by count and by bytes.

    `put` inserts and evicts least recently used entries until both bounds hold again; the entry just
    inserted is never evicted by its own insertion (check `fits` first). `get` marks an entry used.
    """

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS, max_bytes: int | None = None):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, got {max_bytes}")
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        """Least recently used first."""
        return list(self._entries)

    def fits(self, nbytes: int) -> bool:
        return self.max_bytes is None or nbytes <= self.max_bytes

    def get(self, key: Hashable) -> Any | None:
        item = self._entries.get(key)
        if item is None:
            return None
        self._entries.move_to_end(key)
        return item[0]

    def put(self, key: Hashable, entry: Any, nbytes: int) -> list[tuple[Hashable, Any]]:
        """Insert (or replace) and return the evicted (key, entry) pairs, oldest first."""
        self.pop(key)
        self._entries[key] = (entry, nbytes)
        self.total_bytes += nbytes
        evicted = []
        while len(self._entries) > 1 and (len(self._entries) > self.max_graphs or self._over_bytes()):
            old_key, (old, old_bytes) = self._entries.popitem(last=False)
            self.total_bytes -= old_bytes
            evicted.append((old_key, old))
        return evicted

    def pop(self, key: Hashable) -> Any | None:
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self.total_bytes -= item[1]
        return item[0]

    def clear(self) -> None:
        self._entries.clear()
        self.total_bytes = 0

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and self.total_bytes > self.max_bytes


class Remembered:
    """A small LRU map (warm-up counts, failure reasons) so a stream of new signatures stays bounded."""

    def __init__(self, size: int = _MAX_REMEMBERED):
        self.size = size
        self.items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, default: Any = None) -> Any:
        return self.items.get(key, default)

    def set(self, key: Hashable, value: Any) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def pop(self, key: Hashable) -> Any:
        return self.items.pop(key, None)

    def clear(self) -> None:
        self.items.clear()


