"""The result cache: keys cover names, dtypes, shapes and bytes; LRU and TTL eviction."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.cache import ResultCache, input_key
from runtimes.errors import ConfigError


def test_key_depends_on_everything() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    base = input_key({"x": x})
    assert input_key({"x": x.copy()}) == base
    assert input_key({"x": np.asfortranarray(x)}) == base  # same values, other layout
    assert input_key({"y": x}) != base
    assert input_key({"x": x.astype(np.float64)}) != base
    assert input_key({"x": x.reshape(3, 2)}) != base
    y = x.copy()
    y[1, 2] += 1
    assert input_key({"x": y}) != base


def test_lru_eviction_and_counts() -> None:
    cache: ResultCache[int] = ResultCache(2)
    cache.put(b"a", 1)
    cache.put(b"b", 2)
    assert cache.get(b"a") == 1
    cache.put(b"c", 3)  # evicts b, the least recently used
    assert cache.get(b"b") is None
    assert cache.get(b"a") == 1
    assert cache.get(b"c") == 3
    assert (cache.hits, cache.misses, len(cache)) == (3, 1, 2)


def test_ttl_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("edge_agent.cache.time.monotonic", lambda: now[0])
    cache: ResultCache[str] = ResultCache(4, ttl_s=1.0)
    cache.put(b"k", "v")
    now[0] += 0.5
    assert cache.get(b"k") == "v"
    now[0] += 1.0
    assert cache.get(b"k") is None
    assert len(cache) == 0


def test_bad_sizes() -> None:
    with pytest.raises(ConfigError):
        ResultCache(0)
    with pytest.raises(ConfigError):
        ResultCache(1, ttl_s=0)
