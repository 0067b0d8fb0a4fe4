"""The fleet API over HTTPS (`--http-cert`/`--http-key`): a device enrolls when it trusts the certificate's CA
(`ca_file`, the agent's `--fleet-ca`), and not otherwise; the operator API answers over the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.fleet_sync import EnrollmentError, enroll
from testkit.cloud_helpers import write_pki
from testkit.fleet_process import FleetProcess, cli


def test_enrollment_over_https_needs_the_fleets_ca(tmp_path: Path) -> None:
    pki = write_pki(tmp_path / "pki")
    data = tmp_path / "fleet-data"
    fleet = FleetProcess(data, None, "--http-cert", str(pki.server_cert), "--http-key", str(pki.server_key),
                         ca=pki.ca).start()
    try:
        assert fleet.url.startswith("https://127.0.0.1:")
        token = cli("token", "create", data_dir=data).stdout.strip()
        with pytest.raises(EnrollmentError, match="CERTIFICATE_VERIFY_FAILED"):  # the system CAs do not know it
            enroll(fleet.url, token, tmp_path / "dev-a")
        with pytest.raises(EnrollmentError, match="CERTIFICATE_VERIFY_FAILED"):  # nor does another CA
            enroll(fleet.url, token, tmp_path / "dev-b", ca_file=pki.other_ca)
        ident = enroll(fleet.url, token, tmp_path / "dev-c", ca_file=pki.ca)  # the token was not spent above
        admin = cli("operator", "create", "ops", "--role", "admin", data_dir=data).stdout.strip()
        status, body = fleet.call("GET", f"/v1/devices/{ident.device_id}", token=admin)
        assert status == 200, body
    finally:
        fleet.stop()


def test_https_needs_both_certificate_and_key(tmp_path: Path) -> None:
    pki = write_pki(tmp_path / "pki")
    with pytest.raises(RuntimeError, match="--http-cert and --http-key"):
        FleetProcess(tmp_path / "d", None, "--http-cert", str(pki.server_cert)).start()
