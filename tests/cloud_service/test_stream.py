"""The stream runner on its own: order, the in-flight window, and a client that goes away."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from cloud_service.stream import StreamRunner
from testkit.waiting import wait_for


def counted(n: int, pulled: list[int]) -> Iterator[int]:
    for i in range(n):
        pulled.append(i)
        yield i


def test_answers_leave_in_request_order_though_later_ones_finish_first() -> None:
    runner = StreamRunner(workers=8, window=8)
    finished: list[int] = []
    running = [0, 0]  # now, most at once
    lock = threading.Lock()
    done = [threading.Event() for _ in range(8)]

    def answer(i: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        if i % 2 == 0:  # odd requests finish first: an even one waits for the next (in vain, run one at a time)
            done[i + 1].wait(5)
        with lock:
            running[0] -= 1
            finished.append(i)
        done[i].set()
        return i * 10

    try:
        out = list(runner.answers(iter(range(8)), answer, is_active=lambda: True))
    finally:
        runner.close()
    assert out == [i * 10 for i in range(8)]
    assert finished != sorted(finished)  # they ran concurrently and finished out of order
    assert running[1] > 1


def test_at_most_a_window_of_requests_is_in_flight() -> None:
    runner = StreamRunner(workers=16, window=4)
    gate = threading.Event()
    pulled: list[int] = []
    try:
        stream = runner.answers(counted(100, pulled), lambda i: gate.wait(5) and i, is_active=lambda: True)
        first = threading.Thread(target=lambda: next(stream))
        first.start()
        wait_for("the reader to fill its window", lambda: len(pulled) >= 4, timeout=5, interval=0.01)
        time.sleep(0.3)  # room for a pull past the window (it must not come)
        assert len(pulled) <= 4 + 2, pulled  # the window, the one being handed over, the one read
        gate.set()
        first.join(5)
        assert list(stream) == list(range(1, 100))
    finally:
        gate.set()
        runner.close()


def test_reader_stops_when_the_client_goes_away() -> None:
    runner = StreamRunner(workers=2, window=2)
    active = [True]
    pulled: list[int] = []
    gate = threading.Event()
    try:
        stream = runner.answers(counted(1000, pulled), lambda i: gate.wait(5) and i, is_active=lambda: active[0])
        waiter = threading.Thread(target=lambda: next(stream, None), daemon=True)
        waiter.start()
        wait_for("the reader's first pull", lambda: pulled, timeout=5, interval=0.01)
        active[0] = False  # the client cancelled; nobody reads the answers any more
        gate.set()
        wait_for("the stream's reader thread to end", lambda: not any(
            t.name == "tierkit-stream-reader" and t.is_alive() for t in threading.enumerate()), timeout=5)
        settled = len(pulled)
        time.sleep(0.3)  # room for a pull after the end (it must not come)
        assert len(pulled) == settled < 10  # the reader stopped instead of pulling the whole stream
    finally:
        gate.set()
        runner.close()
