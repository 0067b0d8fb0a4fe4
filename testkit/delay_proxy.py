"""A loopback TCP proxy that adds delay per direction and can take the cloud down.

Every chunk read from one side is written to the other `delay` milliseconds later, in order (a
per-direction queue with due times), so a request/response pair gains `up + down` ms of round
trip whatever the protocol. With `jitter_ms`, each chunk waits a further uniform 0..jitter ms
per direction (seeded; still delivered in order). With `bandwidth_mbps`, each direction is a link of
that rate: a chunk is sent after the ones before it, taking its size x 8 / rate (so a frame-sized
request at 1 Mbit/s takes tens of milliseconds, and its wire encoding matters). `stall(s)` holds
every chunk read in the next `s` seconds until they end: a burst of losses as TCP shows it (the data
comes late, after retransmission). Modes:

- "up": forward;
- "refuse": close every connection and reset new ones at once (a host that is down: fast failure);
- "blackhole": accept and read, never forward (a partition: the client times out).

It runs on its own event loop in a thread, so the agent's loop never stalls it.

Example:
    >>> proxy = DelayProxy(("127.0.0.1", 8001)).start()
    >>> proxy.set(up_ms=30, down_ms=30)     # +60 ms round trip
    >>> proxy.set(mode="refuse")            # cloud down
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass

MODES = ("up", "refuse", "blackhole")
BURST_GAP_S = 0.003  # chunks read closer together than this belong to one message (one jitter draw)


@dataclass
class _State:
    up_ms: float = 0.0
    down_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float | None = None
    stall_until: float = 0.0
    mode: str = "up"


class DelayProxy:
    """Forward 127.0.0.1:`port` to `upstream`, adding delay per direction (see the module docstring)."""

    def __init__(self, upstream: tuple[str, int], *, host: str = "127.0.0.1", port: int = 0) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            msg = f"the delay proxy listens on loopback only, not {host!r}"
            raise ValueError(msg)
        self.upstream, self.host, self.port = upstream, host, port
        self.state = _State()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self._random = random.Random(0)

    def start(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def stall(self, seconds: float) -> None:
        """Hold every chunk read from now for `seconds` (a loss burst)."""
        until = time.monotonic() + seconds

        def apply() -> None:
            self.state.stall_until = max(self.state.stall_until, until)

        asyncio.run_coroutine_threadsafe(_call(apply), self._loop).result(timeout=5)

    def set(self, *, up_ms: float | None = None, down_ms: float | None = None, mode: str | None = None,
            jitter_ms: float | None = None, bandwidth_mbps: float | None = None, unlimited: bool = False) -> None:
        """Change the delay of each direction (ms), its jitter and/or the mode; applies to chunks read from now on."""
        if mode is not None and mode not in MODES:
            msg = f"mode {mode!r} is not one of {MODES}"
            raise ValueError(msg)

        def apply() -> None:
            if up_ms is not None:
                self.state.up_ms = float(up_ms)
            if down_ms is not None:
                self.state.down_ms = float(down_ms)
            if jitter_ms is not None:
                self.state.jitter_ms = float(jitter_ms)
            if bandwidth_mbps is not None or unlimited:
                self.state.bandwidth_mbps = None if unlimited else bandwidth_mbps
            if mode is not None:
                self.state.mode = mode
                if mode != "up":
                    for w in list(self._writers):
                        _reset(w)

        asyncio.run_coroutine_threadsafe(_call(apply), self._loop).result(timeout=5)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                _reset(w)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:  # the resets end the pumps; whatever still hangs is cancelled
                _, pending = await asyncio.wait(tasks, timeout=1.0)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        if self.state.mode == "refuse":
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        _nodelay(up_writer)
        self.connections += 1
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pump(reader, up_writer, "up_ms"), self._pump(up_reader, writer, "down_ms"))
        except asyncio.CancelledError:
            pass  # shutting down: the connection is reset below
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                _reset(w)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        last, jitter, free_at = -1.0, 0.0, 0.0
        try:
            while True:
                data = await reader.read(65536)
                if not data or self.state.mode == "refuse":
                    break
                if self.state.mode == "blackhole":
                    continue
                now = time.monotonic()
                if now - last >= BURST_GAP_S:  # a new message: a new jitter draw
                    jitter = self._random.uniform(0.0, self.state.jitter_ms)
                last = now
                delay = getattr(self.state, direction) + jitter
                start = max(now, self.state.stall_until)
                if self.state.bandwidth_mbps:  # the link sends one chunk after another at its rate
                    start = max(start, free_at)
                    free_at = start + len(data) * 8 / (self.state.bandwidth_mbps * 1e6)
                    start = free_at
                await queue.put((start + delay / 1e3, data))
            queue.put_nowait((0.0, b""))
            await sender
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender


async def _call(fn: object) -> None:
    fn()  # type: ignore[operator]


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0): the peer sees a refused/reset connection at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.close()
