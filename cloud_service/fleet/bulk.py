"""Set-at-a-time statements for telemetry ingestion: one per table per batch, on SQLite and PostgreSQL.

On PostgreSQL a batch's rows travel as one JSON array parameter, read back as table rows by
`json_populate_recordset` (INSERT ... SELECT ... ON CONFLICT): one round trip per table whatever the
batch size, with a statement text that never changes. Measured on loopback (bench/bench_fleet.py):
psycopg's pipelined `executemany` costs about 80 µs a row; array parameters spend most of their
time in psycopg escaping text arrays in Python; one JSON text (encoded in C, parsed in C by the
server) is the cheapest. SQLite runs in-process: there the driver's own `executemany` of one
statement with positional rows (no SQLAlchemy parameter processing per row) is the fast path.

Example:
    >>> bulk = Bulk(store)
    >>> inserted = bulk.insert_new(conn, t.telemetry, rows, key=("device_id", "boot_id", "seq"))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet.store import FleetStore

Key = tuple[Any, ...]


class Bulk:
    """Dialect-aware batch statements over one `FleetStore`."""

    def __init__(self, store: FleetStore) -> None:
        self.store = store
        self.pg = store.dialect == "postgresql"
        self._cache: dict[tuple[Any, ...], Any] = {}

    def any_of(self, col: Any, values: Sequence[Any]) -> Any:
        """`col IN values`; on PostgreSQL `col = ANY(array)`: one parameter instead of one per value."""
        if self.pg:
            from sqlalchemy.dialects.postgresql import ARRAY

            return col == sa.any_(sa.bindparam(None, list(values), type_=ARRAY(col.type)))
        return col.in_(values)

    def upsert(self, table: sa.Table) -> Any:
        """The dialect's INSERT that accepts `on_conflict_do_nothing` / `on_conflict_do_update`."""
        from sqlalchemy.dialects import postgresql, sqlite

        return postgresql.insert(table) if self.pg else sqlite.insert(table)

    def _records(self, table: sa.Table) -> str:
        """The rows of one JSON array parameter as records of `table`'s row type."""
        return f"json_populate_recordset(NULL::{table.name}, CAST(:rows AS json))"

    def _text(self, key: tuple[Any, ...], build: Any) -> Any:
        stmt = self._cache.get(key)
        if stmt is None:
            stmt = self._cache[key] = sa.text(build())
        return stmt

    @staticmethod
    def _json(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
        return {"rows": json.dumps(rows, separators=(",", ":"))}

    def insert_new(self, conn: Any, table: sa.Table, rows: Sequence[dict[str, Any]], key: Sequence[str]) -> set[Key]:
        """Insert `rows`, skipping those whose `key` (a unique constraint) is already stored; returns the keys
        inserted. PostgreSQL: one INSERT ... SELECT FROM unnest ... ON CONFLICT DO NOTHING RETURNING."""
        if not rows:
            return set()
        cols = list(rows[0])
        if self.pg:
            stmt = self._text(("insert_new", table.name, *cols), lambda: (
                f"INSERT INTO {table.name} ({', '.join(cols)}) SELECT {', '.join(cols)} FROM {self._records(table)} "
                f"ON CONFLICT ({', '.join(key)}) DO NOTHING RETURNING {', '.join(key)}"))
            return {tuple(r) for r in conn.execute(stmt, self._json(rows))}
        existing = self.existing(conn, table, [tuple(r[k] for k in key) for r in rows], key)
        fresh = [r for r in rows if tuple(r[k] for k in key) not in existing]
        if fresh:
            sql = self._cache.setdefault(("sqlite_insert", table.name, *cols), (
                f"INSERT INTO {table.name} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                f"ON CONFLICT ({', '.join(key)}) DO NOTHING"))
            conn.exec_driver_sql(sql, [tuple(r[c] for c in cols) for r in fresh])
        return {tuple(r[k] for k in key) for r in fresh}

    def existing(self, conn: Any, table: sa.Table, keys: Sequence[Key], key: Sequence[str]) -> set[Key]:
        """Which of `keys` (values of the columns `key`) are stored."""
        if not keys:
            return set()
        cols = [table.c[k] for k in key]
        got: set[Key] = set()
        keys = sorted(set(keys))
        for i in range(0, len(keys), 2000):  # bounded: SQLite allows 32,766 parameters a statement
            got.update(tuple(r) for r in conn.execute(sa.select(*cols).where(sa.tuple_(*cols).in_(keys[i:i + 2000]))))
        return got

    def delete(self, conn: Any, table: sa.Table, keys: Sequence[Key], key: Sequence[str]) -> None:
        """Delete the rows with these keys."""
        if not keys:
            return
        cond = sa.and_(*(table.c[k] == sa.bindparam(f"k_{k}") for k in key))
        conn.execute(table.delete().where(cond), [{f"k_{k}": v for k, v in zip(key, kv, strict=True)} for kv in keys])

    def add_counts(self, conn: Any, table: sa.Table, rows: Sequence[dict[str, Any]], key: Sequence[str]) -> None:
        """Upsert `rows`, adding every non-key column to what is stored. Rows are sorted by key so that two
        processes lock the same rows in the same order."""
        if not rows:
            return
        cols = list(rows[0])
        rows = sorted(rows, key=lambda r: tuple(r[k] for k in key))
        adds = [c for c in cols if c not in key]
        if self.pg:
            stmt = self._text(("add_counts", table.name, *cols), lambda: (
                f"INSERT INTO {table.name} ({', '.join(cols)}) SELECT {', '.join(cols)} FROM {self._records(table)} "
                f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET "
                + ", ".join(f"{c} = {table.name}.{c} + excluded.{c}" for c in adds)))
            conn.execute(stmt, self._json(rows))
            return
        sql = self._cache.setdefault(("sqlite_add_counts", table.name, *cols), (
            f"INSERT INTO {table.name} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
            f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET "
            + ", ".join(f"{c} = {table.name}.{c} + excluded.{c}" for c in adds)))
        conn.exec_driver_sql(sql, [tuple(r[c] for c in cols) for r in rows])

    def raise_to(self, conn: Any, table: sa.Table, key: str, col: str, values: dict[Any, float]) -> None:
        """`col = max(col, value)` for each key; a NULL `col` takes the value."""
        if not values:
            return
        items = sorted(values.items())
        if self.pg:
            stmt = self._text(("raise_to", table.name, key, col), lambda: (
                f"UPDATE {table.name} SET {col} = GREATEST(COALESCE({table.name}.{col}, u.{col}), u.{col}) "
                f"FROM {self._records(table)} AS u WHERE {table.name}.{key} = u.{key}"))
            conn.execute(stmt, self._json([{key: k, col: v} for k, v in items]))
            return
        conn.exec_driver_sql(f"UPDATE {table.name} SET {col} = max(coalesce({col}, ?1), ?1) WHERE {key} = ?2",
                             [(v, k) for k, v in items])
