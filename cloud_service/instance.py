"""A model instance's worker thread: blocking inference runs here, never on the event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


class InstanceThread:
    """One model instance's thread: runs the jobs handed to it, one at a time, off the event loop.

    Lighter than `run_in_executor` (no concurrent.futures.Future per job): the job goes over a
    `SimpleQueue`, the outcome comes back to the event loop with `call_soon_threadsafe`.

    Example:
        >>> instance = InstanceThread("digits-0", asyncio.get_running_loop())
        >>> outputs = await instance.run(session.run, {"x": x})
        >>> instance.close()
    """

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        done: asyncio.Future[Any] = self._loop.create_future()
        self._jobs.put((fn, args, done))
        return await done

    def close(self) -> None:
        self._jobs.put(None)

    def _main(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, done = job
            try:
                outcome, ok = fn(*args), True
            except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
                outcome, ok = exc, False
            try:
                self._loop.call_soon_threadsafe(_resolve, done, outcome, ok)
            except RuntimeError:  # the loop closed while this batch ran
                return


def _resolve(future: asyncio.Future[Any], outcome: Any, ok: bool) -> None:
    if future.done():
        return
    if ok:
        future.set_result(outcome)
    else:
        future.set_exception(outcome)
