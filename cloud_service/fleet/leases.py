"""Row leases in the `leases` table: several fleet processes on one database, one of them acts.

`acquire()` is one conditional UPDATE (the row is free, expired, or already ours), the same
statement on SQLite and PostgreSQL: PostgreSQL's row lock makes two racing processes serialize on
the row and the second sees the first's holder; SQLite serializes writers anyway. The holder then
`fence(conn)`s every write transaction: the same conditional UPDATE inside that transaction, so a
process whose lease expired (a long pause, a lost database connection) and was taken over cannot
write after all: its transaction raises `LeaseLost` and rolls back.

Example:
    >>> lease = Lease(store, "rollouts", holder="host-1234", ttl_s=10)
    >>> if lease.acquire():
    ...     with store.begin() as conn:
    ...         lease.fence(conn)
    ...         conn.execute(...)
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.errors import FleetError
from cloud_service.fleet.store import FleetStore


class LeaseLost(FleetError):
    """Another process holds the lease now; this one must not act."""

    http_status = 409


class Lease:
    """A named lease held by `holder` for `ttl_s` after each acquire or fence."""

    def __init__(self, store: FleetStore, name: str, *, holder: str, ttl_s: float = 10.0) -> None:
        self.store, self.name, self.holder, self.ttl_s = store, name, holder, ttl_s

    def _take(self, conn: Any, now: float) -> bool:
        c = t.leases.c
        n = conn.execute(t.leases.update().where(
            c.name == self.name,
            sa.or_(c.holder.is_(None), c.holder == self.holder, c.expires_at.is_(None), c.expires_at < now),
        ).values(holder=self.holder, expires_at=now + self.ttl_s)).rowcount
        return bool(n == 1)

    def acquire(self, *, now: float | None = None) -> bool:
        """Take or renew the lease; False while another holder's lease runs."""
        now = time.time() if now is None else now
        import sqlalchemy.exc

        with self.store.begin() as conn:
            if self._take(conn, now):
                return True
            exists = conn.execute(sa.select(t.leases.c.name).where(t.leases.c.name == self.name)).first()
        if exists is not None:
            return False
        try:  # the first process ever: create the row (a racing creator makes this fail; then try again)
            with self.store.begin() as conn:
                conn.execute(t.leases.insert().values(name=self.name, holder=None, expires_at=None))
        except sqlalchemy.exc.IntegrityError:
            pass
        with self.store.begin() as conn:
            return self._take(conn, now)

    def fence(self, conn: Any, *, now: float | None = None) -> None:
        """Inside a write transaction: renew, or raise `LeaseLost` (the transaction then rolls back)."""
        if not self._take(conn, time.time() if now is None else now):
            msg = f"lease {self.name!r} is held by another fleet process; {self.holder} does not act"
            raise LeaseLost(msg)

    def release(self) -> None:
        with self.store.begin() as conn:
            conn.execute(t.leases.update().where(t.leases.c.name == self.name, t.leases.c.holder == self.holder)
                         .values(holder=None, expires_at=None))

    def holder_now(self) -> tuple[str | None, float | None]:
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.leases).where(t.leases.c.name == self.name)).first()
        return (None, None) if row is None else (row.holder, row.expires_at)
