"""rollouts: deployments in waves, their devices and decisions

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rollouts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('release', sa.String(length=128), nullable=False),
    sa.Column('previous', sa.String(length=128), nullable=True),
    sa.Column('selector', sa.String(length=512), nullable=False),
    sa.Column('options', sa.Text(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('wave', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('rollout_waves',
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('spec', sa.String(length=16), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('ended_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('rollout_id', 'idx')
    )
    op.create_table('rollout_devices',
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('device_id', sa.String(length=128), nullable=False),
    sa.Column('wave', sa.Integer(), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('previous', sa.String(length=128), nullable=True),
    sa.Column('ran', sa.Boolean(), nullable=False),
    sa.Column('crashes0', sa.Integer(), nullable=False),
    sa.Column('assigned_at', sa.Float(), nullable=True),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('rollout_id', 'device_id')
    )
    with op.batch_alter_table('rollout_devices', schema=None) as batch_op:
        batch_op.create_index('ix_rollout_devices_state', ['rollout_id', 'state'], unique=False)
    op.create_table('rollout_decisions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('wave', sa.Integer(), nullable=True),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('figures', sa.Text(), nullable=False),
    sa.Column('note', sa.Text(), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('rollout_decisions', schema=None) as batch_op:
        batch_op.create_index('ix_rollout_decisions_rollout', ['rollout_id', 'id'], unique=False)
    with op.batch_alter_table('releases', schema=None) as batch_op:
        batch_op.add_column(sa.Column('version', sa.String(length=64), nullable=False, server_default=''))
        batch_op.add_column(sa.Column('archive', sa.String(length=512), nullable=False, server_default=''))


def downgrade() -> None:
    with op.batch_alter_table('releases', schema=None) as batch_op:
        batch_op.drop_column('archive')
        batch_op.drop_column('version')
    with op.batch_alter_table('rollout_decisions', schema=None) as batch_op:
        batch_op.drop_index('ix_rollout_decisions_rollout')
    op.drop_table('rollout_decisions')
    with op.batch_alter_table('rollout_devices', schema=None) as batch_op:
        batch_op.drop_index('ix_rollout_devices_state')
    op.drop_table('rollout_devices')
    op.drop_table('rollout_waves')
    op.drop_table('rollouts')
