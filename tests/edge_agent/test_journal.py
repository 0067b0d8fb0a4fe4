"""Store-and-forward journal: dedup, byte bound, durability across kill -9, corrupt files, drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from edge_agent.journal import ROW_OVERHEAD, Journal, JournalEntry, drain
from runtimes.errors import ConfigError, JournalFull

ROOT = Path(__file__).resolve().parents[2]


def _append(journal: Journal, seq: int, payload: bytes = b"x" * 10, boot: str = "b1") -> bool:
    return journal.append("telemetry", payload, device="cam-7", boot_id=boot, seq=seq)


def test_append_pending_ack_in_order(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as journal:
        assert journal.recovered_from is None
        for seq in range(5):
            assert _append(journal, seq, bytes([seq]) * 3)
        assert journal.count() == 5
        entries = journal.pending(3)
        assert [e.seq for e in entries] == [0, 1, 2]
        assert entries[1].payload == b"\x01\x01\x01"
        assert (entries[0].kind, entries[0].device, entries[0].boot_id, entries[0].attempts) == \
            ("telemetry", "cam-7", "b1", 0)
        assert journal.ack([entries[0].id, entries[1].id, 999_999]) == 2
        assert [e.seq for e in journal.pending(10)] == [2, 3, 4]
        assert journal.ack([entries[0].id]) == 0  # acking twice deletes nothing more
        assert journal.ack([]) == 0
        journal.record_attempt([])


def test_duplicate_is_refused_and_nothing_written(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as journal:
        assert _append(journal, 1)
        size = journal.size_bytes()
        assert not _append(journal, 1, b"different")
        assert _append(journal, 1, boot="b2")  # another boot: another record
        assert journal.count() == 2
        assert journal.size_bytes() == 2 * size


def test_byte_bound_raises_journal_full_and_writes_nothing(tmp_path: Path) -> None:
    row = 100 + len("telemetry") + len("cam-7") + len("b1") + ROW_OVERHEAD
    with Journal(tmp_path / "j.db", max_bytes=3 * row) as journal:
        for seq in range(3):
            assert _append(journal, seq, b"p" * 100)
        assert journal.size_bytes() == 3 * row
        with pytest.raises(JournalFull, match=rf"{3 * row} of {3 * row} bytes") as info:
            _append(journal, 3, b"p" * 100)
        assert str(3 * row) in str(info.value)
        assert journal.count() == 3
        journal.ack([journal.pending(1)[0].id])
        assert _append(journal, 3, b"p" * 100)
    with Journal(tmp_path / "j.db", max_bytes=3 * row) as journal:
        assert [e.seq for e in journal.pending(10)] == [1, 2, 3]
        assert journal.size_bytes() == 3 * row


def test_bad_bound_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        Journal(tmp_path / "j.db", max_bytes=0)


def test_appends_from_many_threads(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as journal, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: _append(journal, s % 100), range(200)))
        assert sum(results) == 100
        assert journal.count() == 100


CHILD = textwrap.dedent("""
    import sys
    from edge_agent.journal import Journal
    journal = Journal(sys.argv[1])
    seq = 0
    while True:
        journal.append("telemetry", b"y" * 200, device="cam-7", boot_id="b1", seq=seq)
        print(seq, flush=True)
        seq += 1
""")


def test_entries_survive_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    last = -1
    deadline = time.monotonic() + 20
    assert proc.stdout is not None
    try:
        while last < 40 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            last = int(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    assert last >= 40, "the child did not append 40 entries in 20 s"
    assert proc.returncode == -signal.SIGKILL
    with Journal(path) as journal:
        assert journal.recovered_from is None
        count = journal.count()
        seqs = [e.seq for e in journal.pending(count)]
    # every append that returned is there; at most the ones in flight at the kill are extra
    assert count >= last + 1
    assert seqs == list(range(count))


def test_non_sqlite_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "j.db"
    path.write_bytes(b"this is not a database, it is a log line\n" * 100)
    with caplog.at_level(logging.WARNING, logger="edge_agent.journal"), Journal(path) as journal:
        assert journal.recovered_from is not None
        assert journal.recovered_from.name.startswith("j.db.corrupt-")
        assert journal.recovered_from.read_bytes().startswith(b"this is not a database")
        assert journal.count() == 0
        assert _append(journal, 1)
    assert "corrupt" in caplog.text
    assert str(journal.recovered_from) in caplog.text


def test_damaged_pages_fail_integrity_check_and_are_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with Journal(path) as journal:
        for seq in range(300):
            _append(journal, seq, os.urandom(300))
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    data = bytearray(path.read_bytes())
    page = 4096
    for offset in range(2 * page, len(data) - page, 3 * page):  # scribble over the b-tree pages, keep the header
        data[offset:offset + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    with Journal(path) as journal:
        assert journal.recovered_from is not None
        assert journal.count() == 0
    assert len(list(tmp_path.glob("j.db.corrupt-*"))) >= 1


def _entries(journal: Journal) -> list[int]:
    return [e.seq for e in journal.pending(1000)]


def test_drain_stops_at_first_failure_and_resumes_without_duplicates(tmp_path: Path) -> None:
    delivered: list[int] = []
    fail_once = {3}

    async def send(entry: JournalEntry) -> None:
        if entry.seq in fail_once:
            fail_once.discard(entry.seq)
            msg = "link down"
            raise ConnectionError(msg)
        delivered.append(entry.seq)

    with Journal(tmp_path / "j.db") as journal:
        for seq in range(10):
            _append(journal, seq)
        assert asyncio.run(drain(journal, send, batch=2)) == 3
        assert delivered == [0, 1, 2]
        assert _entries(journal) == list(range(3, 10))
        assert journal.pending(1)[0].attempts == 1
        assert asyncio.run(drain(journal, send, batch=4)) == 7
        assert delivered == list(range(10))
        assert journal.count() == 0
        assert asyncio.run(drain(journal, send)) == 0


def test_drain_honours_stop_event_and_refuses_a_second_concurrent_drain(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as journal:
        for seq in range(10):
            _append(journal, seq)

        async def main() -> tuple[int, int]:
            stop, sending = asyncio.Event(), asyncio.Event()
            delivered: list[int] = []

            async def send(entry: JournalEntry) -> None:
                sending.set()
                await asyncio.sleep(0.01)  # a send takes a while: the second drain comes while one is under way
                delivered.append(entry.seq)
                if len(delivered) == 4:
                    stop.set()

            first = asyncio.create_task(drain(journal, send, stop_event=stop))
            await sending.wait()  # the first drain is under way
            second = await drain(journal, send)
            return await first, second

        first, second = asyncio.run(main())
        assert (first, second) == (4, 0)
        assert _entries(journal) == list(range(4, 10))
