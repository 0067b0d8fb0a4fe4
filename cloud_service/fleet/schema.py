"""The fleet store's tables (SQLAlchemy 2 Core). Alembic migrations in `migrations/` create them.

Times are Unix seconds as floats (the same on SQLite and PostgreSQL, no time-zone traps); JSON
documents are stored as text so that both databases round-trip them byte for byte.
`releases` and `leases` are there for rollouts (database-backed state with row leases).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

devices = Table(
    "devices", metadata,
    Column("device_id", String(128), primary_key=True),
    Column("labels", Text, nullable=False, default="{}"),
    Column("hardware", Text, nullable=False, default="{}"),
    Column("agent_version", String(64), nullable=False, default=""),
    Column("cert_serial", String(64), nullable=False, default=""),
    Column("mqtt_password_hash", String(256), nullable=False, default=""),
    Column("enrolled_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
    Column("last_seen", Float, nullable=True),
    Column("model_digest", String(128), nullable=False, default=""),
    Column("variant", String(128), nullable=False, default=""),
    Column("threshold", Float, nullable=True),
)

enrollment_tokens = Table(
    "enrollment_tokens", metadata,
    Column("token_hash", String(64), primary_key=True),
    Column("labels", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("used_at", Float, nullable=True),
    Column("device_id", String(128), nullable=True),
)

operator_tokens = Table(
    "operator_tokens", metadata,
    Column("token_hash", String(64), primary_key=True),
    Column("name", String(128), nullable=False),
    Column("role", String(16), nullable=False),  # "read" or "admin"
    Column("created_at", Float, nullable=False),
)

# One layer of desired state: a selector ("*", "k=v,k2=v2" or "device=ID") at a priority.
desired_layers = Table(
    "desired_layers", metadata,
    Column("selector", String(512), primary_key=True),
    Column("priority", Integer, nullable=False),
    Column("document", Text, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# The effective document last computed (and retained on MQTT) for each device.
desired_effective = Table(
    "desired_effective", metadata,
    Column("device_id", String(128), primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("document", Text, nullable=False),
    Column("since", Float, nullable=False),
    Column("published_version", BigInteger, nullable=True),
)

reported = Table(
    "reported", metadata,
    Column("device_id", String(128), primary_key=True),
    Column("version", BigInteger, nullable=True),
    Column("document", Text, nullable=False),
    Column("received_at", Float, nullable=False),
)

telemetry = Table(
    "telemetry", metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("device_id", String(128), nullable=False),
    Column("boot_id", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("device_ts", Float, nullable=False),
    Column("server_ts", Float, nullable=False),
    Column("skewed", Boolean, nullable=False),
    Column("window_s", Float, nullable=False),
    Column("requests", Integer, nullable=False),
    Column("p50_ms", Float, nullable=False),
    Column("p95_ms", Float, nullable=False),
    Column("escalation_rate", Float, nullable=False),
    Column("agreement", Float, nullable=True),
    Column("energy_mj_per_request", Float, nullable=False),
    Column("energy_label", String(64), nullable=False),
    Column("degraded", Integer, nullable=False),
    Column("variant", String(128), nullable=False),
    Column("threshold", Float, nullable=True),
    Column("bytes", Integer, nullable=False),
    Column("document", Text, nullable=False),
    UniqueConstraint("device_id", "boot_id", "seq", name="uq_telemetry_window"),
)
Index("ix_telemetry_device_ts", telemetry.c.device_id, telemetry.c.server_ts)

# Hourly roll-up of windows older than the raw retention.
telemetry_rollup = Table(
    "telemetry_rollup", metadata,
    Column("device_id", String(128), primary_key=True),
    Column("hour", BigInteger, primary_key=True),  # Unix seconds at the start of the hour
    Column("windows", Integer, nullable=False),
    Column("requests", BigInteger, nullable=False),
    Column("p95_ms_max", Float, nullable=False),
    Column("p95_ms_mean", Float, nullable=False),
    Column("escalation_rate", Float, nullable=False),
    Column("energy_mj_per_request", Float, nullable=False),
    Column("degraded", BigInteger, nullable=False),
    # agreement averaged over the hour's windows that carry one, each weighted by its escalations
    # (requests x escalation rate); the weight summed so far, to fold later windows in
    Column("agreement", Float, nullable=True),
    Column("agreement_weight", Float, nullable=False, server_default="0"),
)

# Every window folded at ingest into sums per device and hour (migration 0004): the fleet view's bands read
# these, never the raw windows. Figures are sums; divide by `windows` or `requests` (or agreement_weight).
telemetry_hourly = Table(
    "telemetry_hourly", metadata,
    Column("device_id", String(128), primary_key=True),
    Column("hour", BigInteger, primary_key=True),  # Unix seconds at the start of the hour
    Column("windows", Integer, nullable=False),
    Column("requests", BigInteger, nullable=False),
    Column("p95_sum", Float, nullable=False),  # Σ window p95 (ms)
    Column("escalations", Float, nullable=False),  # Σ requests x escalation rate
    Column("energy_mj", Float, nullable=False),  # Σ requests x energy per request
    Column("degraded", BigInteger, nullable=False),
    Column("agreement_sum", Float, nullable=False),  # Σ agreement x its weight (escalations)
    Column("agreement_weight", Float, nullable=False),
)
Index("ix_telemetry_hourly_hour", telemetry_hourly.c.hour)

# Windows received per minute of server time, fleet-wide (migration 0005): the dashboard's cloud tiles read the
# last minutes here, and an hour's window count stamps the bands computed from it (`bands.py`).
telemetry_minutes = Table(
    "telemetry_minutes", metadata,
    Column("minute", BigInteger, primary_key=True),  # Unix seconds at the start of the minute
    Column("windows", BigInteger, nullable=False),
    Column("requests", BigInteger, nullable=False),
    Column("escalations", Float, nullable=False),  # Σ requests x escalation rate
    Column("cloud_refused", BigInteger, nullable=False),
)

# The fleet view's percentile bands, materialized (migration 0005): per grouping ("fleet", "release",
# "label:KEY"), hour and group, the devices and the p50 / p95 across them of each figure (JSON), stamped with
# the hour's window count when computed (a later window makes the row stale).
fleet_bands = Table(
    "fleet_bands", metadata,
    Column("grouping", String(160), primary_key=True),
    Column("hour", BigInteger, primary_key=True),
    Column("grp", String(200), primary_key=True),
    Column("devices", Integer, nullable=False),
    Column("figures", Text, nullable=False),
    Column("windows", BigInteger, nullable=False),
    Column("computed_at", Float, nullable=False),
)

# Each device's labels, one row a label (migration 0005): the device table's `k=v` filter is an index range.
device_labels = Table(
    "device_labels", metadata,
    Column("key", String(128), primary_key=True),
    Column("value", String(256), primary_key=True),
    Column("device_id", String(128), primary_key=True),
)
Index("ix_devices_last_seen", devices.c.last_seen)

# Bytes accepted and cut per device and UTC day (the cellular-bill cap).
telemetry_usage = Table(
    "telemetry_usage", metadata,
    Column("device_id", String(128), primary_key=True),
    Column("day", Integer, primary_key=True),  # days since the epoch
    Column("bytes", BigInteger, nullable=False),
    Column("cut_windows", Integer, nullable=False),
    Column("cut_bytes", BigInteger, nullable=False),
)

# Messages counted and dropped, by reason (malformed, oversized, unknown, revoked, impersonating, replayed, capped).
ingest_drops = Table(
    "ingest_drops", metadata,
    Column("reason", String(32), primary_key=True),
    Column("count", BigInteger, nullable=False),
)

# For rollouts: a signed release named by its digest, and row leases shared by several fleet processes.
releases = Table(
    "releases", metadata,
    Column("digest", String(128), primary_key=True),
    Column("name", String(128), nullable=False),
    Column("manifest", Text, nullable=False),  # release.json, as signed
    Column("created_at", Float, nullable=False),
    Column("version", String(64), nullable=False, server_default=""),  # migration 0002
    Column("archive", String(512), nullable=False, server_default=""),  # the tar, relative to the data dir
)

leases = Table(
    "leases", metadata,
    Column("name", String(128), primary_key=True),
    Column("holder", String(128), nullable=True),
    Column("expires_at", Float, nullable=True),
)

# Rollouts (migration 0002): a deployment of a release in waves, its devices, and every decision with its figures.
rollouts = Table(
    "rollouts", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("release", String(128), nullable=False),
    Column("previous", String(128), nullable=True),  # the release a failed rollout returns devices to
    Column("selector", String(512), nullable=False),  # "k=v,k2=v2" or "*"
    Column("options", Text, nullable=False),  # waves, soak, margins, capacity (JSON)
    Column("state", String(16), nullable=False),  # running, paused, succeeded, rolled_back
    Column("wave", Integer, nullable=False),  # the current wave's index
    Column("reason", Text, nullable=False, default=""),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

rollout_waves = Table(
    "rollout_waves", metadata,
    Column("rollout_id", Integer, primary_key=True),
    Column("idx", Integer, primary_key=True),
    Column("spec", String(16), nullable=False),  # "1" or "5%"
    Column("size", Integer, nullable=False),  # devices it takes, all earlier waves included
    Column("state", String(16), nullable=False),  # pending, soaking, passed, failed
    Column("started_at", Float, nullable=True),
    Column("ended_at", Float, nullable=True),
)

rollout_devices = Table(
    "rollout_devices", metadata,
    Column("rollout_id", Integer, primary_key=True),
    Column("device_id", String(128), primary_key=True),
    Column("wave", Integer, nullable=True),  # None until its wave starts
    Column("state", String(16), nullable=False),  # pending, catch_up, assigned, a swap state, rollback, restored
    Column("previous", String(128), nullable=True),  # what it ran before the rollout
    Column("ran", Boolean, nullable=False, default=False),  # ever ran the release (active, soaking, committed)
    Column("crashes0", Integer, nullable=False, default=0),  # its reported crash count when assigned
    Column("assigned_at", Float, nullable=True),
    Column("updated_at", Float, nullable=False),
    Column("detail", Text, nullable=False, default=""),
)
Index("ix_rollout_devices_state", rollout_devices.c.rollout_id, rollout_devices.c.state)

rollout_decisions = Table(
    "rollout_decisions", metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("rollout_id", Integer, nullable=False),
    Column("wave", Integer, nullable=True),
    Column("at", Float, nullable=False),
    Column("kind", String(16), nullable=False),  # observe, pass, fail, rollback, pause, resume, done, start
    Column("figures", Text, nullable=False),  # the gates with wave and control figures (JSON)
    Column("note", Text, nullable=False, default=""),
    Column("holder", String(128), nullable=False, default=""),  # the fleet process that decided
)
Index("ix_rollout_decisions_rollout", rollout_decisions.c.rollout_id, rollout_decisions.c.id)
