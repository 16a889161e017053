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
