"""the fleet view at scale: windows per minute, materialized bands, an index of device labels

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'telemetry_minutes',
        sa.Column('minute', sa.BigInteger(), nullable=False),
        sa.Column('windows', sa.BigInteger(), nullable=False),
        sa.Column('requests', sa.BigInteger(), nullable=False),
        sa.Column('escalations', sa.Float(), nullable=False),
        sa.Column('cloud_refused', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('minute'),
    )
    op.create_table(
        'fleet_bands',
        sa.Column('grouping', sa.String(length=160), nullable=False),
        sa.Column('hour', sa.BigInteger(), nullable=False),
        sa.Column('grp', sa.String(length=200), nullable=False),
        sa.Column('devices', sa.Integer(), nullable=False),
        sa.Column('figures', sa.Text(), nullable=False),
        sa.Column('windows', sa.BigInteger(), nullable=False),
        sa.Column('computed_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('grouping', 'hour', 'grp'),
    )
    op.create_table(
        'device_labels',
        sa.Column('key', sa.String(length=128), nullable=False),
        sa.Column('value', sa.String(length=256), nullable=False),
        sa.Column('device_id', sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint('key', 'value', 'device_id'),
    )
    op.create_index('ix_devices_last_seen', 'devices', ['last_seen'], unique=False)
    conn = op.get_bind()
    rows = [{"key": k[:128], "value": str(v)[:256], "device_id": r.device_id}
            for r in conn.execute(sa.text("SELECT device_id, labels FROM devices"))
            for k, v in json.loads(r.labels or "{}").items()]
    if rows:
        labels = sa.table('device_labels', sa.column('key'), sa.column('value'), sa.column('device_id'))
        conn.execute(labels.insert(), rows)
    # windows already stored count toward their minute (the last day's: older ones are rolled up)
    minute = ("CAST(floor(server_ts) AS BIGINT) / 60 * 60" if conn.dialect.name == "postgresql"
              else "CAST(server_ts AS INTEGER) / 60 * 60")  # SQLite's CAST truncates; times are positive
    conn.execute(sa.text(
        "INSERT INTO telemetry_minutes (minute, windows, requests, escalations, cloud_refused) "
        f"SELECT {minute}, count(*), sum(requests), sum(requests * escalation_rate), 0 FROM telemetry GROUP BY 1"))


def downgrade() -> None:
    op.drop_index('ix_devices_last_seen', table_name='devices')
    op.drop_table('device_labels')
    op.drop_table('fleet_bands')
    op.drop_table('telemetry_minutes')
