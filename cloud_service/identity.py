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

Two namespaces of broker usernames, which never meet:

- a device that logs in with a password (the fleet issued it) has its device id as username; device ids
  never start with `tierkit` (`check_device_id`), the prefix every service account has;
- a device that logs in with a certificate has the certificate's whole subject as username, `CN=cam-1`
  (Mosquitto's `use_subject_as_username`): no certificate, whatever its CN, yields a name without `CN=`,
  so none can become `tierkit-cloud` or `tierkit-fleet` (with `use_identity_as_username` a certificate
  with CN `tierkit-fleet` was the fleet). `certificate_username` gives that name.

Service accounts (`service_client`) have a client id pinned to their username, one account per process,
so a service login cannot take over a device's session and no device can take a service's client id.
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
CONTROL_TOPIC = "$CONTROL/dynamic-security/v1"
_DEVICE_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
RESERVED_PREFIXES = ("tierkit", "admin", "mosquitto", "root")
ROLE_PREFIX = "device-"
CERT_PREFIX = "CN="  # Mosquitto's use_subject_as_username: a subject of one CN reads `CN=<cn>`
DEFAULT_CLOUD_GROUP = "tierkit"
DEFAULT_FLEET_GROUP = "tierkit-fleet"
_SERVICE_NAME = re.compile(r"tierkit-(cloud|fleet)(-[a-z0-9][a-z0-9-]{0,40})?")
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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


def certificate_username(device: str) -> str:
    """The broker username of the device's certificate (subject `CN=<device id>`) on a listener with
    `use_subject_as_username`; it is also its client id there (`use_username_as_clientid`)."""
    return CERT_PREFIX + check_device_id(device)


def device_from_username(username: str) -> str | None:
    """The device id a broker username belongs to (password or certificate login), None for other accounts."""
    name = username[len(CERT_PREFIX):] if username.startswith(CERT_PREFIX) else username
    try:
        return check_device_id(name)
    except ConfigError:
        return None


def device_client(device: str) -> dict[str, Any]:
    """The client entry (as in dynamic-security.json) of a device that authenticates by certificate:
    username `CN=<device>`, no password, so it cannot log in on a password listener."""
    return {"username": certificate_username(device), "roles": [{"rolename": ROLE_PREFIX + device}]}


def dynsec_commands(device: str, *, password: str | None = None) -> list[dict[str, Any]]:
    """Commands for `$CONTROL/dynamic-security/v1` (as `{"commands": [...]}`) that add one device: its role,
    its certificate login (`CN=<device>`) and, given `password`, its password login (username and client id =
    the device id)."""
    role = device_role(device)
    commands: list[dict[str, Any]] = [{"command": "createRole", "rolename": role["rolename"]}]
    for acl in role["acls"]:
        commands.append({"command": "addRoleACL", "rolename": role["rolename"], **acl})
    commands.append({"command": "createClient", **device_client(device)})
    if password is not None:
        commands.append({"command": "createClient", "username": device, "password": password, "clientid": device,
                         "roles": [{"rolename": role["rolename"]}]})
    return commands


def remove_commands(device: str) -> list[dict[str, Any]]:
    """Commands that delete one device's logins (the broker disconnects them at once) and its role."""
    return [{"command": "deleteClient", "username": device},
            {"command": "deleteClient", "username": certificate_username(device)},
            {"command": "deleteRole", "rolename": ROLE_PREFIX + device}]


def check_group(group: str, what: str) -> str:
    """A shared-subscription group name: it becomes a topic level of `$share/{group}/...` and a role's literal."""
    if not isinstance(group, str) or not _GROUP.fullmatch(group):
        msg = (f"{what} {str(group)[:80]!r} is refused: use 1-64 characters of letters, digits, '.', '_', '-' "
               "(it becomes a level of a $share/GROUP/... subscription)")
        raise ConfigError(msg)
    return group


def check_service_name(name: str) -> str:
    """Return the service role (`tierkit-cloud` or `tierkit-fleet`) of a service account name such as
    `tierkit-cloud` or `tierkit-cloud-2`; ConfigError for any other name."""
    m = _SERVICE_NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        msg = (f"service account {str(name)[:80]!r} is refused: name it tierkit-cloud or tierkit-fleet, optionally "
               "with a suffix of a-z, 0-9, '-' (tierkit-cloud-2): the tierkit prefix is one no device id can take")
        raise ConfigError(msg)
    return f"tierkit-{m.group(1)}"


def service_roles(*, cloud_group: str = DEFAULT_CLOUD_GROUP,
                  fleet_group: str = DEFAULT_FLEET_GROUP) -> list[dict[str, Any]]:
    """The two service roles, each with exactly what its service does.

    `tierkit-cloud`: join `$share/{cloud_group}/tierkit/v1/+/escalate`, receive escalations, publish replies.
    `tierkit-fleet`: join `$share/{fleet_group}/...` for telemetry and reported state, publish desired state,
    and administer device accounts through `$CONTROL/dynamic-security/v1` (which the plugin cannot narrow to
    device accounts: that topic is the broker's whole administration, so the fleet's password is a broker
    administrator's).
    """
    share_cloud = f"$share/{check_group(cloud_group, 'cloud group')}/{topics.ROOT}/+/escalate"
    cloud = [_acl("subscribeLiteral", share_cloud), _acl("unsubscribeLiteral", share_cloud),
             _acl("publishClientReceive", f"{topics.ROOT}/+/escalate"),
             _acl("publishClientSend", f"{topics.ROOT}/+/reply")]
    g = check_group(fleet_group, "fleet group")
    fleet: list[dict[str, Any]] = []
    for kind in ("telemetry", "reported"):
        fleet += [_acl("subscribeLiteral", f"$share/{g}/{topics.ROOT}/+/{kind}"),
                  _acl("unsubscribeLiteral", f"$share/{g}/{topics.ROOT}/+/{kind}"),
                  _acl("publishClientReceive", f"{topics.ROOT}/+/{kind}")]
    response = CONTROL_TOPIC + "/response"
    fleet += [_acl("publishClientSend", f"{topics.ROOT}/+/desired"), _acl("publishClientSend", CONTROL_TOPIC),
              _acl("subscribeLiteral", response), _acl("publishClientReceive", response)]
    return [{"rolename": "tierkit-cloud", "acls": cloud}, {"rolename": "tierkit-fleet", "acls": fleet}]


def service_client(name: str, password: str) -> dict[str, Any]:
    """A service account (as in dynamic-security.json): the role its name says, its client id pinned to its
    name (one account per process: a second process under the same name would take the first one's session)."""
    role = check_service_name(name)
    return {"username": name, "clientid": name, "roles": [{"rolename": role}], **password_fields(password)}


def dynsec_document(passwords: dict[str, str], *, cloud_group: str = DEFAULT_CLOUD_GROUP,
                    fleet_group: str = DEFAULT_FLEET_GROUP) -> dict[str, Any]:
    """A first `dynamic-security.json`: nothing allowed by default, the service roles, one account per entry of
    `passwords` (service account name -> password). Devices are added at enrollment."""
    return {"defaultACLAccess": {"publishClientSend": False, "publishClientReceive": False, "subscribe": False,
                                 "unsubscribe": True},
            "clients": [service_client(name, pw) for name, pw in passwords.items()],
            "groups": [],
            "roles": service_roles(cloud_group=cloud_group, fleet_group=fleet_group)}


def _acl(acltype: str, topic: str) -> dict[str, Any]:
    return {"acltype": acltype, "topic": topic, "allow": True}


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
