"""Fleet fixtures: the same store suite runs on SQLite and on a real PostgreSQL started here."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("alembic")

from cloud_service.fleet.store import FleetStore
from testkit.broker import Broker, _free_port
from testkit.fleet_process import ROOT, FleetProcess
from testkit.postgres import Postgres

_counter = iter(range(1_000_000))


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    pg = Postgres(Path(tempfile.mkdtemp(prefix="tierkit-pg-"))).start()
    try:
        yield pg
    finally:
        pg.stop()


def _pg_store(pg: Postgres) -> FleetStore:
    import sqlalchemy as sa

    name = f"fleet_{next(_counter)}"
    admin = sa.create_engine(pg.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return FleetStore.open(pg.url.rsplit("/", 1)[0] + f"/{name}")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, migrated database URL: SQLite in tmp_path, or a new database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fleet.db'}"
    pg: Postgres = request.getfixturevalue("postgres")
    store = _pg_store(pg)
    url = store.engine.url.render_as_string(hide_password=False)
    store.close()
    return str(url)


@pytest.fixture
def store(db_url: str) -> Iterator[FleetStore]:
    s = FleetStore.open(db_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[FleetStore]:
    """A store on SQLite alone, for tests whose decisions do not depend on the database."""
    s = FleetStore.open(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        yield s
    finally:
        s.close()


FLEET_PASSWORD = "fleet-secret-for-tests"




@pytest.fixture
def stack(tmp_path: Path, db_url: str) -> Iterator[tuple[FleetProcess, Broker, Path, str]]:
    """A fleet process and a Mosquitto that authenticates from the password file the fleet writes."""
    data, passwd, pid = tmp_path / "fleet-data", tmp_path / "passwd", tmp_path / "mosquitto.pid"
    port = _free_port()
    fleet = FleetProcess(data, db_url, "--mqtt", f"mqtt://127.0.0.1:{port}", "--mqtt-username", "tierkit-fleet",
                         "--broker-passwd", str(passwd), "--broker-reload", f"kill -HUP $(cat {pid})",
                         "--drift-after", "2s", env={"TIERKIT_FLEET_MQTT_PASSWORD": FLEET_PASSWORD}).start()
    broker = Broker(tmp_path / "broker", port=port, extra_conf=(
        f"allow_anonymous false\npassword_file {passwd}\nacl_file {ROOT / 'deploy/fleet/acl'}\n"
        f"pid_file {pid}\nuse_username_as_clientid true\n"))
    try:
        broker.start()
        yield fleet, broker, data, db_url
    finally:
        broker.stop()
        fleet.stop()


