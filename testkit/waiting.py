"""Waiting for a condition in tests, bounded in time: a condition that never comes fails, naming itself.

`wait_for` polls from a thread; `until` is the same for a coroutine on the event loop (the loop keeps
running between polls). Use them instead of a sleep that guesses how long something takes, or a poll
loop that falls through when the condition never comes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
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


async def until(what: str, check: Callable[[], Any | Awaitable[Any]], timeout: float = 20.0, *,
                interval: float = 0.02) -> Any:
    """`check()`'s first truthy result (awaited if it returns an awaitable), polled every `interval` s on the
    running loop; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(interval)
    msg = f"timed out after {timeout:g} s waiting for {what}"
    raise AssertionError(msg)
