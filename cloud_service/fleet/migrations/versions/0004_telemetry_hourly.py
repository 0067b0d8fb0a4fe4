"""every window folded at ingest into hourly sums per device (the fleet view's bands)

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'telemetry_hourly',
        sa.Column('device_id', sa.String(length=128), nullable=False),
        sa.Column('hour', sa.BigInteger(), nullable=False),
        sa.Column('windows', sa.Integer(), nullable=False),
        sa.Column('requests', sa.BigInteger(), nullable=False),
        sa.Column('p95_sum', sa.Float(), nullable=False),
        sa.Column('escalations', sa.Float(), nullable=False),
        sa.Column('energy_mj', sa.Float(), nullable=False),
        sa.Column('degraded', sa.BigInteger(), nullable=False),
        sa.Column('agreement_sum', sa.Float(), nullable=False),
        sa.Column('agreement_weight', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('device_id', 'hour'),
    )
    op.create_index('ix_telemetry_hourly_hour', 'telemetry_hourly', ['hour'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_telemetry_hourly_hour', table_name='telemetry_hourly')
    op.drop_table('telemetry_hourly')
