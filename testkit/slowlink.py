"""A slow link on loopback: a TCP proxy that shapes each direction to a rate and adds a one-way delay.

Each direction is a token bucket of one packet: a chunk leaves when the link has sent the chunks
before it (`len * 8 / rate` seconds each) and arrives `delay_s` later, as on a serial link with
propagation delay. The rate can change while connections are open (a step from 50 to 5 Mbit/s).
`cut()` takes the link down (open connections reset, new ones reset at once: a host that is gone),
`restore()` brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class SlowLink:
    """`async with SlowLink(host, port, rate_bps=10e6, rtt_s=0.03) as link:` then connect to `link.port`."""

    def __init__(self, host: str, port: int, *, rate_bps: float, rtt_s: float) -> None:
        self.target = (host, port)
        self.rate_bps = rate_bps
        self.delay_s = rtt_s / 2
        self.port = 0
        self._free = {"up": 0.0, "down": 0.0}  # when each direction's link is next idle
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.bytes = {"up": 0, "down": 0}
        self.is_cut = False
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> SlowLink:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await task

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cut(self) -> None:
        """Take the link down: reset every open connection, and every new one as it arrives."""
        self.is_cut = True
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    def restore(self) -> None:
        self.is_cut = False

    def idle(self) -> bool:
        """Whether every byte read so far has been delivered in both directions (a transfer the caller gave up on
        no longer holds the link)."""
        return max(self._free.values()) + self.delay_s <= asyncio.get_running_loop().time()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        self._spawn(self._pipe(reader, up_writer, "up"))
        self._spawn(self._pipe(up_reader, writer, "down"))

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()
            dst.close()

        sender = loop.create_task(deliver())
        try:
            while data := await src.read(16384):
                start = max(loop.time(), self._free[direction])
                self._free[direction] = start + len(data) * 8 / self.rate_bps
                self.bytes[direction] += len(data)
                queue.put_nowait((self._free[direction] + self.delay_s, data))
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(ConnectionError):
                await sender


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0): the peer sees a reset connection at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
