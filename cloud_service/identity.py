"""Device identities on the broker: which names may become a device id, and the device's broker rights.

A device id becomes an MQTT topic level (`tierkit/v1/{device}/...`), a certificate CN and a broker
username. Whoever issues certificates or broker credentials (the fleet service's enrollment) calls
`check_device_id` first, so that no device is issued a name that is a topic pattern (`cam/escalate`,
`+`, `#`), a reserved broker name (`tierkit-cloud`, the dynamic-security `admin`), or anything a
broker or shell could read twice.

The shipped Mosquitto configuration (`deploy/mosquitto/`) uses Mosquitto's dynamic-security plugin,
which refuses a SUBSCRIBE the ACL does not allow (a plain `acl_file` grants every SUBSCRIBE in
Mosquitto 2.0 and filters at delivery, which let a device join the cloud's shared subscription and
swallow other devices' escalations). Mosquitto 2.0.11's plugin does not substitute `%c` in ACL
topics, so each device gets a role of its own with literal topics: `device_role` builds it,
`dynsec_commands` gives the `$CONTROL/dynamic-security/v1` commands that install it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from typing import Any

from cloud_service.protocol import topics
from runtimes.errors import ConfigError

PASSWORD_ITERATIONS = 10_000
_DEVICE_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
RESERVED_PREFIXES = ("tierkit", "admin", "mosquitto", "root")
ROLE_PREFIX = "device-"


def check_device_id(device: str) -> str:
    """Return `device` if it may be issued as a device id; else raise ConfigError saying why.

    Allowed: 1-63 characters of lower-case letters, digits, `.`, `_`, `-`, starting with a letter or
    digit, not starting with a reserved prefix (the cloud's and broker's own account names).
    """
    if not isinstance(device, str) or not _DEVICE_ID.fullmatch(device):
        msg = (f"device id {str(device)[:80]!r} is refused: use 1-63 characters of a-z, 0-9, '.', '_', '-' "
               "starting with a letter or digit (no '/', '+', '#', '$', spaces or upper case: a device id "
               "becomes a topic level, a certificate CN and a broker username)")
        raise ConfigError(msg)
    if device.startswith(RESERVED_PREFIXES) or device in {".", ".."}:
        msg = (f"device id {device!r} is refused: names starting with {', '.join(RESERVED_PREFIXES)} are "
               "reserved for the cloud's and the broker's own accounts")
        raise ConfigError(msg)
    return device


def device_acls(device: str) -> list[dict[str, Any]]:
    """The dynamic-security ACLs of one device: publish its escalations, telemetry and reported
    state; subscribe to and receive its replies and its desired state (read-only)."""
    check_device_id(device)
    acls: list[dict[str, Any]] = []
    for topic in (topics.escalate_topic(device), topics.telemetry_topic(device), topics.reported_topic(device)):
        acls.append({"acltype": "publishClientSend", "topic": topic, "allow": True})
    for topic in (topics.reply_topic(device), topics.desired_topic(device)):
        acls.append({"acltype": "subscribeLiteral", "topic": topic, "allow": True})
        acls.append({"acltype": "publishClientReceive", "topic": topic, "allow": True})
    return acls


def device_role(device: str) -> dict[str, Any]:
    """The role (as in dynamic-security.json) that holds one device's rights."""
    return {"rolename": ROLE_PREFIX + check_device_id(device), "acls": device_acls(device)}


def device_client(device: str) -> dict[str, Any]:
    """The client entry (as in dynamic-security.json) of a device that authenticates by certificate:
    no password, so it cannot log in on the password listener; its CN is its username."""
    return {"username": check_device_id(device), "roles": [{"rolename": ROLE_PREFIX + device}]}


def dynsec_commands(device: str) -> list[dict[str, Any]]:
    """Commands for `$CONTROL/dynamic-security/v1` (as `{"commands": [...]}`) that add one device."""
    role = device_role(device)
    commands: list[dict[str, Any]] = [{"command": "createRole", "rolename": role["rolename"]}]
    for acl in role["acls"]:
        commands.append({"command": "addRoleACL", "rolename": role["rolename"], **acl})
    commands.append({"command": "createClient", "username": device, "roles": [{"rolename": role["rolename"]}]})
    return commands


def password_fields(password: str, *, iterations: int = PASSWORD_ITERATIONS) -> dict[str, Any]:
    """The `password`, `salt`, `iterations` fields of a dynamic-security client (PBKDF2-SHA512, as the
    plugin checks them), for writing `dynamic-security.json` before the broker first starts."""
    if len(password) < 12:
        msg = "a broker password must have at least 12 characters"
        raise ConfigError(msg)
    salt = os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, 64)
    return {"password": base64.b64encode(digest).decode(), "salt": base64.b64encode(salt).decode(),
            "iterations": iterations}
