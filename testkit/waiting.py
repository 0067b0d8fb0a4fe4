"""Polling for a condition in tests, bounded in time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0, *, interval: float = 0.1) -> Any:
    """`check()`'s first truthy result, polled every `interval` s; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(interval)
    msg = f"timed out after {timeout:g} s waiting for {what}"
    raise AssertionError(msg)
