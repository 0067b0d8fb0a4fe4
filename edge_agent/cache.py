"""A small LRU cache of answers, keyed by a hash of the input bytes.

A recurring input (the same camera frame, the same sensor window) is answered without running the
model or calling the cloud. The key covers every input's name, dtype, shape and bytes, so two
arrays that differ in any of them never collide in practice (BLAKE2b, 128-bit digest).

Example:
    >>> cache = ResultCache(1024)
    >>> key = cache.key({"x": x})
    >>> cache.get(key) is None
    True
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Generic, TypeVar

import numpy as np

from runtimes.errors import ConfigError

T = TypeVar("T")


def input_key(inputs: Mapping[str, np.ndarray]) -> bytes:
    """A 16-byte digest of the inputs' names, dtypes, shapes and contents."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        a = np.ascontiguousarray(inputs[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.digest()


class ResultCache(Generic[T]):
    """Thread-safe LRU of at most `size` answers, each valid for `ttl_s` seconds (None: forever).

    Args:
        size: how many answers to keep (> 0).
        ttl_s: how long an answer stays valid.
    """

    def __init__(self, size: int, ttl_s: float | None = None) -> None:
        if size <= 0:
            msg = f"cache size must be > 0, got {size}"
            raise ConfigError(msg)
        if ttl_s is not None and ttl_s <= 0:
            msg = f"cache ttl_s must be > 0 or None, got {ttl_s}"
            raise ConfigError(msg)
        self.size = size
        self.ttl_s = ttl_s
        self._items: OrderedDict[bytes, tuple[float, T]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    key = staticmethod(input_key)

    def get(self, key: bytes) -> T | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or (self.ttl_s is not None and time.monotonic() - item[0] > self.ttl_s):
                if item is not None:
                    del self._items[key]
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[1]

    def put(self, key: bytes, value: T) -> None:
        with self._lock:
            self._items[key] = (time.monotonic(), value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
