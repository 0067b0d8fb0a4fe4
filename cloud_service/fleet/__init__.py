"""The fleet service: device registry and enrollment CA, desired/reported state, telemetry store, HTTP API.

Modules (imported where needed, so that `tierkit` starts without the `fleet` extra):
`store` (SQLAlchemy engine, Alembic migrations), `schema` (tables), `ca` (signs device CSRs),
`registry` (tokens, enrollment, revocation), `desired` (layers, effective documents, drift),
`telemetry` (windows: dedup, byte caps, roll-up), `ingest` (MQTT), `api` (FastAPI), `fleet` (the
facade the API and CLI use), `service` (`tierkit fleet serve`), `cli` (`tierkit fleet ...`).
"""
