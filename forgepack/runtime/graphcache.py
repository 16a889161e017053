"""Graph mode's memory pool ledger: least recently used out first, bounded by count and bytes (pure, no CUDA).

Part of the pack runtime: torch and the standard library only.

One ledger bounds everything a served model holds for graph mode (`serving.Server` shares its
`GraphedForward`'s): captured graphs (kind "graph"), decode-loop graphs with their buffers ("loop") and
the KV caches forgepack allocates ("cache"). An entry may *need* others (a graph captured with a cache
holds the cache's addresses): evicting an entry evicts every entry that needs it, so no graph outlives
the memory it reads. An entry in use (the cache of a request in flight) is pinned: never evicted, and
counted against what still fits.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_GRAPHS = 8
_MAX_REMEMBERED = 256  # signatures whose warm-up count or failure is remembered (LRU)
KINDS = ("graph", "loop", "cache")
_GRAPH_KINDS = frozenset({"graph", "loop"})  # what max_graphs counts (a cache is not a graph)


def _locked(method: Callable) -> Callable:
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass
class _Item:
    entry: Any
    nbytes: int
    kind: str
    needs: frozenset


class GraphCache:
    """An LRU map from key to entry (a graph, a decode loop, a cache), bounded by the number of graphs
    and by the bytes of everything held.

    `put` inserts and evicts least recently used entries (and what needs them) until both bounds hold
    again; the entry just inserted, what it needs and pinned entries are never evicted by its insertion
    (check `fits` first). `get` marks an entry used. Thread-safe: a server's threads share it.
    """

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS, max_bytes: int | None = None):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, got {max_bytes}")
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[Hashable, _Item] = collections.OrderedDict()
        self._pinned: collections.Counter = collections.Counter()
        self.total_bytes = 0
        self.evictions: collections.Counter = collections.Counter()  # by kind
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @_locked
    def keys(self, kind: str | None = None) -> list[Hashable]:
        """Least recently used first (of one kind, or all)."""
        return [k for k, item in self._entries.items() if kind is None or item.kind == kind]

    @_locked
    def entries(self, kind: str) -> list[Any]:
        return [item.entry for item in self._entries.values() if item.kind == kind]

    @_locked
    def count(self, kind: str) -> int:
        return sum(item.kind == kind for item in self._entries.values())

    @_locked
    def bytes_of(self, kind: str) -> int:
        return sum(item.nbytes for item in self._entries.values() if item.kind == kind)

    @_locked
    def nbytes(self, key: Hashable) -> int | None:
        item = self._entries.get(key)
        return None if item is None else item.nbytes

    @_locked
    def keys_holding(self, objects: Iterable[Any]) -> frozenset:
        """Keys of the entries that are one of `objects` (a graph's by-reference arguments: its cache)."""
        ids = {id(o) for o in objects}
        return frozenset(k for k, item in self._entries.items() if id(item.entry) in ids) if ids else frozenset()

    @_locked
    def fits(self, nbytes: int, key: Hashable = None) -> bool:
        """Whether an entry of `nbytes` (replacing `key`'s) fits beside the pinned entries."""
        return self.max_bytes is None or nbytes + self.pinned_bytes(key) <= self.max_bytes

    @_locked
    def pinned_bytes(self, key: Hashable = None) -> int:
        """Bytes of the pinned entries (but `key`'s)."""
        return sum(self._entries[k].nbytes for k in self._pinned if k in self._entries and k != key)

    @_locked
    def pin(self, key: Hashable) -> None:
        self._pinned[key] += 1

    @_locked
    def unpin(self, key: Hashable) -> None:
        self._pinned[key] -= 1
        if self._pinned[key] <= 0:
            del self._pinned[key]

    @_locked
    def get(self, key: Hashable) -> Any | None:
        item = self._entries.get(key)
        if item is None:
            return None
        self._entries.move_to_end(key)
        return item.entry

    @_locked
    def put(self, key: Hashable, entry: Any, nbytes: int, kind: str = "graph",
            needs: Iterable[Hashable] = ()) -> list[tuple[Hashable, Any]]:
        """Insert (or replace: what needs it stays) and return the evicted (key, entry) pairs, oldest first."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.pop(key)
        needs = frozenset(n for n in needs if n in self._entries)
        self._entries[key] = _Item(entry, nbytes, kind, needs)
        self.total_bytes += nbytes
        keep = needs | {key}
        evicted: list[tuple[Hashable, Any]] = []
        while self._over_count() or self._over_bytes():
            graphs_only = self._over_count()  # too many graphs: a cache is not one
            victim = next((k for k, item in self._entries.items() if k not in keep and k not in self._pinned
                           and (not graphs_only or item.kind in _GRAPH_KINDS)), None)
            if victim is None:
                break
            evicted += self.evict(victim)
        return evicted

    @_locked
    def evict(self, key: Hashable) -> list[tuple[Hashable, Any]]:
        """Drop `key` and every entry that needs it (counted as evictions); the dropped (key, entry) pairs."""
        item = self._entries.get(key)
        if item is None:
            return []
        dependents = [k for k, other in self._entries.items() if key in other.needs]
        dropped = [(key, self.pop(key))]
        self.evictions[item.kind] += 1
        for dependent in dependents:
            dropped += self.evict(dependent)
        return dropped

    @_locked
    def pop(self, key: Hashable) -> Any | None:
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self.total_bytes -= item.nbytes
        return item.entry

    @_locked
    def clear(self, kind: str | None = None) -> None:
        """Drop every entry (of one kind, and what needs them), not counted as evictions."""
        if kind is None:
            self._entries.clear()
            self.total_bytes = 0
            return
        doomed = set(self.keys(kind))
        while more := {k for k, item in self._entries.items() if k not in doomed and item.needs & doomed}:
            doomed |= more
        for k in doomed:
            self.pop(k)

    def _over_count(self) -> bool:
        return sum(item.kind in _GRAPH_KINDS for item in self._entries.values()) > self.max_graphs

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


