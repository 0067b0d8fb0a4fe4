"""Alembic environment: the connection comes from `FleetStore.migrate()` (config.attributes["connection"])."""

from __future__ import annotations

from alembic import context

from cloud_service.fleet.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
