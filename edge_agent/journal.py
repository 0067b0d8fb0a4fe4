"""Store-and-forward journal: what could not reach the cloud waits on disk, bounded, until it can.

One SQLite table in WAL mode with `synchronous=FULL`, so an entry whose `append` returned survives
`kill -9` and power loss. `UNIQUE(device, boot_id, seq)` makes appends idempotent while an entry is
held. `drain` forwards entries in order and deletes each one only after its send succeeded: delivery
is at least once (a crash between a send and its ack resends that one entry; receivers dedup by
device, boot id and seq), and nothing is lost.

Storage failures (disk full, I/O errors, a locked or broken database) raise `JournalError`, never a bare
`sqlite3.Error`. `count()` and `size_bytes()` read counters kept in memory: they never wait for an
append's fsync.

The byte bound counts payloads plus a fixed per-row overhead (`ROW_OVERHEAD`); the file itself can
be somewhat larger (WAL, free pages).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

from runtimes.errors import ConfigError, JournalError, JournalFull

logger = logging.getLogger(__name__)

ROW_OVERHEAD = 64
_COLUMNS = ["id", "kind", "device", "boot_id", "seq", "payload", "created", "attempts"]
_SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    payload BLOB NOT NULL,
    created REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    UNIQUE (device, boot_id, seq)
)
"""
_ROW_BYTES = f"length(payload) + length(kind) + length(device) + length(boot_id) + {ROW_OVERHEAD}"


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One journaled record, as `pending` returns it."""

    id: int
    kind: str
    device: str
    boot_id: str
    seq: int
    payload: bytes
    created: float
    attempts: int


class Journal:
    """A bounded, durable FIFO of records awaiting delivery. Thread-safe (one connection behind a lock).

    Args:
        path: the SQLite file; created if missing. A corrupt one is moved aside to
            `<name>.corrupt-<timestamp>` and replaced by an empty journal (`recovered_from` says where).
        max_bytes: the bound of `size_bytes()`; an append past it raises `JournalFull`.

    Example:
        >>> with Journal("/var/lib/tierkit/journal.db", max_bytes=16 << 20) as journal:
        ...     journal.append("telemetry", b"...", device="cam-7", boot_id=boot, seq=41)
        ...     sent = await drain(journal, send, stop_event=stop)
    """

    def __init__(self, path: str | Path, *, max_bytes: int = 64 << 20,
                 clock: Callable[[], float] = time.time) -> None:
        if not (isinstance(max_bytes, int) and max_bytes > 0):
            msg = f"Journal max_bytes must be a positive integer, got {max_bytes!r}"
            raise ConfigError(msg)
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self.draining = threading.Lock()  # held by `drain`, so that two drains never send an entry twice
        self.recovered_from: Path | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = self._open()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a corrupt page can hold invalid text
            self.recovered_from = self._move_aside(exc)
            self._db = self._open()
        try:
            self._size, self._count = (int(v) for v in self._db.execute(
                f"SELECT COALESCE(SUM({_ROW_BYTES}), 0), COUNT(*) FROM journal").fetchone())
        except sqlite3.Error as exc:
            self._db.close()
            raise _storage_error(self.path, "open", exc) from exc

    def _open(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves; check_same_thread=False: the lock serializes
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            result = db.execute("PRAGMA integrity_check").fetchall()
            if result != [("ok",)]:
                msg = f"integrity_check: {'; '.join(str(r[0]) for r in result[:3])}"
                raise sqlite3.DatabaseError(msg)
            db.execute(_SCHEMA)
            columns = [row[1] for row in db.execute("PRAGMA table_info(journal)")]
            if columns != _COLUMNS:
                msg = f"table journal has columns {columns}, expected {_COLUMNS}"
                raise sqlite3.DatabaseError(msg)
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self, exc: Exception) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self._clock()))
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        self.path.rename(target)
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                side.rename(target.with_name(target.name + suffix))
        logger.warning("journal %s was corrupt (%s); moved it to %s and started an empty journal",
                       self.path, exc, target)
        return target

    def append(self, kind: str, payload: bytes, *, device: str, boot_id: str, seq: int,
               created: float | None = None) -> bool:
        """Store one record durably. False when (device, boot_id, seq) is already held (nothing written).

        Raises:
            JournalFull: the record would take the journal past `max_bytes`; nothing was written.
        """
        size = len(payload) + len(kind.encode()) + len(device.encode()) + len(boot_id.encode()) + ROW_OVERHEAD
        with self._lock, _storage(self.path, "append to"):
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if db.execute("SELECT 1 FROM journal WHERE device=? AND boot_id=? AND seq=?",
                              (device, boot_id, seq)).fetchone():
                    db.execute("ROLLBACK")
                    return False
                if self._size + size > self.max_bytes:
                    db.execute("ROLLBACK")
                    msg = (f"journal {self.path} is full: {self._size} of {self.max_bytes} bytes used, a "
                           f"{size}-byte record does not fit; drain it to the cloud or raise max_bytes")
                    raise JournalFull(msg)
                db.execute("INSERT INTO journal (kind, device, boot_id, seq, payload, created) VALUES (?,?,?,?,?,?)",
                           (kind, device, boot_id, seq, payload, self._clock() if created is None else created))
                db.execute("COMMIT")
            except sqlite3.Error:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            self._size += size
            self._count += 1
            return True

    def pending(self, limit: int = 100) -> list[JournalEntry]:
        """The oldest `limit` entries, in append order."""
        with self._lock, _storage(self.path, "read"):
            rows = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM journal ORDER BY id LIMIT ?",
                                    (limit,)).fetchall()
        return [JournalEntry(*row) for row in rows]

    def ack(self, ids: Iterable[int]) -> int:
        """Delete delivered entries; returns how many were held (unknown ids are ignored)."""
        ids = list(ids)
        if not ids:
            return 0
        marks = ",".join("?" * len(ids))
        with self._lock, _storage(self.path, "delete from"):
            rows = self._db.execute(f"DELETE FROM journal WHERE id IN ({marks}) RETURNING {_ROW_BYTES}",
                                    ids).fetchall()
            self._forget(rows)
        return len(rows)

    def clear(self, *, device: str, boot_id: str, seq: int) -> bool:
        """Delete the entry (device, boot_id, seq), once it was answered; False when none was held."""
        with self._lock, _storage(self.path, "delete from"):
            rows = self._db.execute("DELETE FROM journal WHERE device=? AND boot_id=? AND seq=? "
                                    f"RETURNING {_ROW_BYTES}", (device, boot_id, seq)).fetchall()
            self._forget(rows)
        return bool(rows)

    def _forget(self, rows: list[Any]) -> None:
        self._size -= sum(int(r[0]) for r in rows)
        self._count -= len(rows)

    def record_attempt(self, ids: Iterable[int]) -> None:
        """Count a failed delivery attempt of these entries."""
        ids = list(ids)
        if not ids:
            return
        with self._lock, _storage(self.path, "update"):
            self._db.execute(f"UPDATE journal SET attempts = attempts + 1 WHERE id IN ({','.join('?' * len(ids))})",
                             ids)

    def count(self) -> int:
        """Entries held: a counter in memory (no lock, no I/O), so a caller never waits on an append's fsync."""
        return self._count

    def size_bytes(self) -> int:
        """Bytes held, as the bound counts them (a counter in memory, like `count`)."""
        return self._size

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Pace(Protocol):
    """What paces a drain: one token per send."""

    async def take(self) -> None: ...


async def _paced(send: Callable[[JournalEntry], Awaitable[None]], entry: JournalEntry, pace: Pace | None) -> None:
    if pace is not None:
        await pace.take()
    await send(entry)


def _storage_error(path: Path, what: str, exc: sqlite3.Error) -> JournalError:
    return JournalError(f"cannot {what} the journal {path}: {exc} (check the disk: free space, permissions, "
                        "I/O errors; a journal that stays broken can be moved aside)")


@contextlib.contextmanager
def _storage(path: Path, what: str) -> Iterator[None]:
    """Turn SQLite's errors into `JournalError`, naming the file and the operation."""
    try:
        yield
    except sqlite3.Error as exc:
        raise _storage_error(path, what, exc) from exc


async def drain(journal: Journal, send: Callable[[JournalEntry], Awaitable[None]], *, batch: int = 32,
                window: int = 1, stop_event: asyncio.Event | None = None, pace: Pace | None = None) -> int:
    """Send held entries oldest first through `send`, deleting each after its send returned.

    With `pace` (`edge_agent.pushback.DrainPace`), each send first waits for one of its tokens.

    The first entry goes alone (it probes the link); after it, up to `window` sends run at once and
    the delivered ones are deleted together (one fsync per window, not per entry). Stops after a
    failing send (the link is down: the entry stays, its `attempts` grows, and a later drain retries
    it), when the journal is empty, or when `stop_event` is set. A drain already running on this
    journal makes this one return 0 at once.

    Returns:
        How many entries were delivered.
    """
    if not journal.draining.acquire(blocking=False):
        return 0
    sent = 0
    try:
        while stop_event is None or not stop_event.is_set():
            # SQLite calls block on fsync: keep them off the event loop
            entries = await asyncio.to_thread(journal.pending, max(batch, window))
            if not entries:
                break
            i = 0
            while i < len(entries):
                if stop_event is not None and stop_event.is_set():
                    return sent
                chunk = entries[i:i + (1 if sent == 0 else window)]
                i += len(chunk)
                results = await asyncio.gather(*(_paced(send, e, pace) for e in chunk), return_exceptions=True)
                delivered = [e.id for e, r in zip(chunk, results, strict=True) if not isinstance(r, BaseException)]
                if delivered:
                    await asyncio.to_thread(journal.ack, delivered)
                    sent += len(delivered)
                failed = [(e, r) for e, r in zip(chunk, results, strict=True) if isinstance(r, BaseException)]
                if failed:  # any failure means: not delivered, keep it
                    await asyncio.to_thread(journal.record_attempt, [e.id for e, _ in failed])
                    entry, exc = failed[0]
                    logger.info("journal drain paused after %d sent: entry %d (%s seq %d) failed: %s",
                                sent, entry.id, entry.kind, entry.seq, exc)
                    return sent
    finally:
        journal.draining.release()
    return sent
