"""Graph mode's LRU cache (forgepack/runtime/graphcache.py): pure, no CUDA."""

from __future__ import annotations

import pytest

from forgepack.runtime import graphcache

# --- the graph cache ---------------------------------------------------------------------------------


def test_graph_cache_evicts_least_recently_used_by_count():
    cache = graphcache.GraphCache(max_graphs=2)
    assert cache.put("a", 1, 10) == [] and cache.put("b", 2, 10) == []
    assert cache.get("a") == 1  # a is now the most recent
    assert cache.put("c", 3, 10) == [("b", 2)]
    assert cache.keys() == ["a", "c"] and "b" not in cache and len(cache) == 2
    assert cache.get("b") is None


def test_graph_cache_evicts_by_bytes_and_reports_what_fits():
    cache = graphcache.GraphCache(max_graphs=10, max_bytes=100)
    cache.put("a", 1, 40)
    cache.put("b", 2, 40)
    assert cache.total_bytes == 80
    assert cache.put("c", 3, 50) == [("a", 1)]  # 130 > 100: the oldest goes
    assert cache.keys() == ["b", "c"] and cache.total_bytes == 90
    assert cache.fits(100) and not cache.fits(101)
    assert cache.put("b", 4, 10) == [] and cache.total_bytes == 60  # replacing a key re-counts it
    assert cache.pop("c") == 3 and cache.total_bytes == 10
    cache.clear()
    assert len(cache) == 0 and cache.total_bytes == 0
    with pytest.raises(ValueError):
        graphcache.GraphCache(max_graphs=0)


def test_remembered_signatures_stay_bounded():
    seen = graphcache.Remembered(size=3)
    for i in range(10):
        seen.set(i, i)
    assert list(seen.items) == [7, 8, 9]


def test_evicting_an_entry_evicts_what_needs_it_and_a_pinned_one_stays():
    """One ledger for caches and the graphs captured with them: a graph needs its cache, so evicting the
    cache evicts the graph too (counted by kind); a pinned entry (the cache of a request in flight) is never
    evicted and counts against what fits."""
    ledger = graphcache.GraphCache(max_graphs=10, max_bytes=100)
    cache_a, cache_b = object(), object()
    ledger.put("cache a", cache_a, 30, "cache")
    assert ledger.keys_holding([cache_a, cache_b]) == {"cache a"}
    ledger.put("graph a", "g", 20, "graph", ledger.keys_holding([cache_a]))
    ledger.put("other", "o", 10, "graph")
    ledger.pin("cache b")
    ledger.put("cache b", cache_b, 50, "cache")  # 110 > 100: cache a (oldest) goes, with its graph
    assert ledger.keys() == ["other", "cache b"] and ledger.total_bytes == 60
    assert dict(ledger.evictions) == {"cache": 1, "graph": 1}
    assert ledger.fits(50) and not ledger.fits(51) and ledger.fits(100, key="cache b")
    evicted = ledger.put("big", "x", 45, "graph", ["cache b"])  # the pinned cache stays, "other" goes
    assert evicted == [("other", "o")] and ledger.keys() == ["cache b", "big"]
    ledger.unpin("cache b")
    assert ledger.count("graph") == 1 and ledger.bytes_of("cache") == 50
    ledger.clear("cache")  # what needs a cleared cache goes with it, not counted as evicted
    assert len(ledger) == 0 and ledger.total_bytes == 0 and ledger.evictions["cache"] == 1
    with pytest.raises(ValueError):
        ledger.put("k", 1, 1, "a kind")


def test_max_graphs_counts_graphs_not_caches():
    ledger = graphcache.GraphCache(max_graphs=1)
    ledger.put("cache", object(), 10, "cache")
    ledger.put("g1", 1, 1)
    assert ledger.put("g2", 2, 1) == [("g1", 1)] and "cache" in ledger
