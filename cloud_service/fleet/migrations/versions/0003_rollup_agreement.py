"""edge/cloud agreement in the hourly roll-up

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('telemetry_rollup', schema=None) as batch_op:
        batch_op.add_column(sa.Column('agreement', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('agreement_weight', sa.Float(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('telemetry_rollup', schema=None) as batch_op:
        batch_op.drop_column('agreement_weight')
        batch_op.drop_column('agreement')
