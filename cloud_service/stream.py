"""Pipelined answering of request streams (ModelStreamInfer): each request starts as it arrives, so
the batcher can merge the requests of one stream, and the answers leave in request order, as Triton
does for models that are not decoupled.

A stream's requests are read by a thread of their own and answered by a pool shared by all streams;
at most `window` requests of one stream are in flight (reading waits beyond that), so a client
cannot queue unbounded work through one stream.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TypeVar

log = logging.getLogger(__name__)

Q = TypeVar("Q")
A = TypeVar("A")

_POLL_S = 0.1  # how often a reader blocked on a full window checks that the client is still there


class StreamRunner:
    """Runs the requests of many streams on one pool of `workers` threads.

    Example:
        >>> runner = StreamRunner(workers=4, window=8)
        >>> list(runner.answers(iter([1, 2, 3]), lambda q: q * 10, is_active=lambda: True))
        [10, 20, 30]
        >>> runner.close()
    """

    def __init__(self, *, workers: int, window: int) -> None:
        self.window = window
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierkit-stream")

    def answers(self, requests: Iterator[Q], answer: Callable[[Q], A], *,
                is_active: Callable[[], bool]) -> Iterator[A]:
        """`answer(request)` for each request, started as it arrives, yielded in request order.

        `answer` must not raise: it turns errors into answers. The stream ends when `requests` ends
        (or breaks: the client went away) and every started request has been answered.
        """
        window: queue.Queue[futures.Future[A] | None] = queue.Queue(maxsize=self.window)
        closed = threading.Event()  # the consumer stopped: the reader must not block on the window

        def read() -> None:
            try:
                for request in requests:
                    future = self._pool.submit(answer, request)
                    while not _put(window, future):
                        if closed.is_set() or not is_active():
                            return
            except Exception as exc:  # the stream broke (client cancelled) or the pool closed
                log.debug("request stream ended: %s", exc)
            finally:
                while not _put(window, None):
                    if closed.is_set() or not is_active():
                        break

        threading.Thread(target=read, name="tierkit-stream-reader", daemon=True).start()
        try:
            while (future := window.get()) is not None:
                yield future.result()
        finally:
            closed.set()

    def close(self) -> None:
        """Refuse new requests; requests not started yet are dropped (their streams are closing)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _put(window: queue.Queue[futures.Future[A] | None], item: futures.Future[A] | None) -> bool:
    try:
        window.put(item, timeout=_POLL_S)
    except queue.Full:
        return False
    return True
