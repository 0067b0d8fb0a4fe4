"""Keeping freed memory: large payload copies stop page-faulting once the thresholds are set."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from cloud_service.protocol.memory import keep_freed_memory

# Runs in a fresh interpreter: the setting is process-wide, and this process's allocator history
# (pytest, numpy, other tests) must not decide the outcome.
_PROBE = """
import json, resource, sys
import numpy as np
from cloud_service.protocol import encode_request
from cloud_service.protocol.memory import keep_freed_memory

x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)

def faults() -> float:
    encode_request("m", {"x": x}).SerializeToString()  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(30):
        encode_request("m", {"x": x}).SerializeToString()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 30

default = faults()
applied = keep_freed_memory(64 << 20)
print(json.dumps({"default": default, "kept": faults(), "applied": applied, "again": keep_freed_memory(1 << 20)}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_kept_memory_stops_page_faults_of_600kb_requests() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=60)
    result = json.loads(out.stdout)
    assert result["applied"] is True
    assert result["again"] is True  # a smaller bound later leaves the larger one in place
    # a 600 KB buffer is ~147 pages: with glibc's defaults each fresh copy faults them in again
    assert result["default"] > 100
    assert result["kept"] < result["default"] / 10


def test_zero_leaves_the_allocator_alone() -> None:
    assert keep_freed_memory(0) is False
