"""The fleet store: one SQLAlchemy engine over SQLite (WAL, in a data directory) or PostgreSQL (by URL).

`FleetStore.open(url)` runs the Alembic migrations to head before anything else touches the
database, so every fleet process on one PostgreSQL sees the same schema. A database that is locked
or unreachable raises `StoreUnavailable` (the HTTP API answers 503, ingestion keeps the batch and
retries), never a half-written row: every write is one transaction.

Example:
    >>> store = FleetStore.open("sqlite:///fleet-data/fleet.db")
    >>> with store.begin() as conn:
    ...     conn.execute(...)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cloud_service.fleet.errors import StoreUnavailable

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path("fleet-data")
_MIGRATIONS = Path(__file__).with_name("migrations")
_SQLITE_TRANSIENT = ("locked", "busy", "unable to open", "disk I/O")


def default_url(data_dir: Path = DEFAULT_DATA_DIR) -> str:
    """The SQLite database inside `data_dir` (created when missing)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(data_dir / 'fleet.db').resolve()}"


class FleetStore:
    """An engine plus the migration and transaction helpers every fleet module uses.

    Args:
        engine: a SQLAlchemy engine (see `open`).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.dialect: str = engine.dialect.name

    @classmethod
    def open(cls, url: str, *, migrate: bool = True, busy_timeout_s: float = 5.0) -> FleetStore:
        """Connect to `url` (sqlite:///PATH or postgresql+psycopg://...) and migrate to head.

        `busy_timeout_s`: how long SQLite waits for another writer's lock before `StoreUnavailable`.
        """
        try:
            import sqlalchemy as sa
            from sqlalchemy import event
        except ImportError:
            msg = "the fleet service needs SQLAlchemy and Alembic: pip install 'tierkit[fleet]'"
            raise StoreUnavailable(msg) from None
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        try:
            if url.startswith("sqlite"):
                engine = sa.create_engine(url, connect_args={"timeout": busy_timeout_s, "check_same_thread": False},
                                          pool_size=8, max_overflow=8)

                @event.listens_for(engine, "connect")
                def _pragmas(dbapi_conn: Any, _record: Any) -> None:
                    cur = dbapi_conn.cursor()
                    cur.execute("PRAGMA journal_mode=WAL")
                    cur.execute("PRAGMA synchronous=NORMAL")
                    cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
                    cur.close()
            else:
                engine = sa.create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)
        except (sa.exc.ArgumentError, ImportError) as exc:
            msg = f"fleet database URL {url!r} is not usable ({exc}); use sqlite:///PATH or postgresql://..."
            raise StoreUnavailable(msg) from None
        store = cls(engine)
        if migrate:
            store.migrate()
        return store

    def migrate(self) -> None:
        """Upgrade the schema to the newest Alembic revision (idempotent; safe from several processes)."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(_MIGRATIONS))
        with self.begin() as conn:
            if self.dialect == "postgresql":
                # two fleet processes starting together on one database: one migrates, the other waits
                import sqlalchemy as sa

                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7412001)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    @contextlib.contextmanager
    def begin(self) -> Iterator[Any]:
        """One transaction; a locked or unreachable database raises `StoreUnavailable`."""
        import sqlalchemy as sa

        try:
            with self.engine.begin() as conn:
                yield conn
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            text = str(exc.orig).strip() or str(exc)
            # SQLite reports its own SQL errors as OperationalError too: only locks and I/O are "unavailable"
            if self.dialect == "sqlite" and not any(w in text for w in _SQLITE_TRANSIENT):
                raise
            msg = f"the fleet database is unavailable ({text}); try again shortly"
            raise StoreUnavailable(msg) from exc

    def close(self) -> None:
        self.engine.dispose()
