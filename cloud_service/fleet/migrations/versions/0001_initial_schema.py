"""initial schema

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    _desired_and_device_tables()
    _service_tables()
    _telemetry_tables()


def _desired_and_device_tables() -> None:
    op.create_table('desired_effective',
    sa.Column('device_id', sa.String(length=128), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('document', sa.Text(), nullable=False),
    sa.Column('since', sa.Float(), nullable=False),
    sa.Column('published_version', sa.BigInteger(), nullable=True),
    sa.PrimaryKeyConstraint('device_id')
    )
    op.create_table('desired_layers',
    sa.Column('selector', sa.String(length=512), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('document', sa.Text(), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('selector')
    )
    op.create_table('devices',
    sa.Column('device_id', sa.String(length=128), nullable=False),
    sa.Column('labels', sa.Text(), nullable=False),
    sa.Column('hardware', sa.Text(), nullable=False),
    sa.Column('agent_version', sa.String(length=64), nullable=False),
    sa.Column('cert_serial', sa.String(length=64), nullable=False),
    sa.Column('mqtt_password_hash', sa.String(length=256), nullable=False),
    sa.Column('enrolled_at', sa.Float(), nullable=False),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.Column('last_seen', sa.Float(), nullable=True),
    sa.Column('model_digest', sa.String(length=128), nullable=False),
    sa.Column('variant', sa.String(length=128), nullable=False),
    sa.Column('threshold', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('device_id')
    )
    op.create_table('enrollment_tokens',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('labels', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.Column('used_at', sa.Float(), nullable=True),
    sa.Column('device_id', sa.String(length=128), nullable=True),
    sa.PrimaryKeyConstraint('token_hash')
    )


def _service_tables() -> None:
    op.create_table('ingest_drops',
    sa.Column('reason', sa.String(length=32), nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('reason')
    )
    op.create_table('leases',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=True),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('operator_tokens',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('token_hash')
    )
    op.create_table('releases',
    sa.Column('digest', sa.String(length=128), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('manifest', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('digest')
    )
    op.create_table('reported',
    sa.Column('device_id', sa.String(length=128), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=True),
    sa.Column('document', sa.Text(), nullable=False),
    sa.Column('received_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('device_id')
    )


def _telemetry_tables() -> None:
    op.create_table('telemetry',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('device_id', sa.String(length=128), nullable=False),
    sa.Column('boot_id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('device_ts', sa.Float(), nullable=False),
    sa.Column('server_ts', sa.Float(), nullable=False),
    sa.Column('skewed', sa.Boolean(), nullable=False),
    sa.Column('window_s', sa.Float(), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('p50_ms', sa.Float(), nullable=False),
    sa.Column('p95_ms', sa.Float(), nullable=False),
    sa.Column('escalation_rate', sa.Float(), nullable=False),
    sa.Column('agreement', sa.Float(), nullable=True),
    sa.Column('energy_mj_per_request', sa.Float(), nullable=False),
    sa.Column('energy_label', sa.String(length=64), nullable=False),
    sa.Column('degraded', sa.Integer(), nullable=False),
    sa.Column('variant', sa.String(length=128), nullable=False),
    sa.Column('threshold', sa.Float(), nullable=True),
    sa.Column('bytes', sa.Integer(), nullable=False),
    sa.Column('document', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('device_id', 'boot_id', 'seq', name='uq_telemetry_window')
    )
    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.create_index('ix_telemetry_device_ts', ['device_id', 'server_ts'], unique=False)

    op.create_table('telemetry_rollup',
    sa.Column('device_id', sa.String(length=128), nullable=False),
    sa.Column('hour', sa.BigInteger(), nullable=False),
    sa.Column('windows', sa.Integer(), nullable=False),
    sa.Column('requests', sa.BigInteger(), nullable=False),
    sa.Column('p95_ms_max', sa.Float(), nullable=False),
    sa.Column('p95_ms_mean', sa.Float(), nullable=False),
    sa.Column('escalation_rate', sa.Float(), nullable=False),
    sa.Column('energy_mj_per_request', sa.Float(), nullable=False),
    sa.Column('degraded', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('device_id', 'hour')
    )
    op.create_table('telemetry_usage',
    sa.Column('device_id', sa.String(length=128), nullable=False),
    sa.Column('day', sa.Integer(), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('cut_windows', sa.Integer(), nullable=False),
    sa.Column('cut_bytes', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('device_id', 'day')
    )


def downgrade() -> None:
    op.drop_table('telemetry_usage')
    op.drop_table('telemetry_rollup')
    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.drop_index('ix_telemetry_device_ts')

    op.drop_table('telemetry')
    op.drop_table('reported')
    op.drop_table('releases')
    op.drop_table('operator_tokens')
    op.drop_table('leases')
    op.drop_table('ingest_drops')
    op.drop_table('enrollment_tokens')
    op.drop_table('devices')
    op.drop_table('desired_layers')
    op.drop_table('desired_effective')
