"""`tierkit broker init`: the first dynamic-security file and the service accounts' passwords of a new broker.

    tierkit broker init --out DIR [--cloud NAME ...] [--fleet NAME ...] [--cloud-group G] [--fleet-group G]

writes `DIR/dynamic-security.json` (nothing allowed by default, the `tierkit-cloud` and `tierkit-fleet` roles,
one account per service process with its client id pinned to its name) and `DIR/NAME.password` for each
account (mode 0600), and names the dynamic-security plugin it finds on this host. The password hashes are
PBKDF2-SHA512 with a random salt, as the plugin checks them, so the accounts log in from the first start: no
`mosquitto_ctrl` (which cannot log in before any account has a password, and exits 0 when it cannot).

Example:
    >>> passwords = init_broker(Path("/mosquitto/data"), cloud=("tierkit-cloud-1", "tierkit-cloud-2"))
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from cloud_service import identity
from runtimes.errors import ConfigError

# Where Mosquitto's dynamic-security plugin lives: Debian/Ubuntu packages (per architecture), then the
# eclipse-mosquitto container image.
PLUGIN_PATHS = ("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so",
                "/usr/lib/aarch64-linux-gnu/mosquitto_dynamic_security.so",
                "/usr/lib/mosquitto_dynamic_security.so")
STATE_FILE = "dynamic-security.json"


def find_plugin() -> str | None:
    """The dynamic-security plugin's path on this host, or None."""
    return next((p for p in PLUGIN_PATHS if Path(p).exists()), None)


def init_broker(out: Path, *, cloud: Sequence[str] = ("tierkit-cloud",), fleet: Sequence[str] = ("tierkit-fleet",),
                cloud_group: str = identity.DEFAULT_CLOUD_GROUP, fleet_group: str = identity.DEFAULT_FLEET_GROUP,
                force: bool = False) -> dict[str, str]:
    """Write `out/dynamic-security.json` and `out/NAME.password` per account; returns name -> password.

    Raises:
        ConfigError: a name that is not a service account of its kind, two accounts with one name, or an
            existing state file without `force` (it holds the enrolled devices).
    """
    names = [*cloud, *fleet]
    for name, kind in [*((n, "tierkit-cloud") for n in cloud), *((n, "tierkit-fleet") for n in fleet)]:
        if identity.check_service_name(name) != kind:
            msg = f"account {name!r} is not a {kind} account: name it {kind} or {kind}-SUFFIX"
            raise ConfigError(msg)
    if len(set(names)) != len(names) or not names:
        msg = f"give each service process an account of its own (got {', '.join(names) or 'none'})"
        raise ConfigError(msg)
    state = out / STATE_FILE
    if state.exists() and not force:
        msg = (f"{state} exists and holds the broker's accounts (enrolled devices too): pass --force to replace "
               "it, or choose another --out")
        raise ConfigError(msg)
    out.mkdir(parents=True, exist_ok=True)
    passwords = {name: secrets.token_urlsafe(24) for name in names}
    doc = identity.dynsec_document(passwords, cloud_group=cloud_group, fleet_group=fleet_group)
    _write_private(state, json.dumps(doc, indent=2) + "\n")
    for name, password in passwords.items():
        _write_private(out / f"{name}.password", password + "\n")
    return passwords


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit broker`."""
    p = subparsers.add_parser("broker", help="set up a Mosquitto broker for tierkit (dynamic security)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="broker_command", metavar="COMMAND", required=True)
    i = sub.add_parser("init", help="write the first dynamic-security.json and the service accounts' passwords")
    i.add_argument("--out", type=Path, required=True, help="the broker's data directory (plugin_opt_config_file's)")
    i.add_argument("--cloud", action="append", metavar="NAME",
                   help="a cloud replica's account (repeatable; default tierkit-cloud)")
    i.add_argument("--fleet", action="append", metavar="NAME",
                   help="a fleet process's account (repeatable; default tierkit-fleet)")
    i.add_argument("--cloud-group", default=identity.DEFAULT_CLOUD_GROUP,
                   help="the replicas' shared-subscription group (tierkit serve --mqtt-group)")
    i.add_argument("--fleet-group", default=identity.DEFAULT_FLEET_GROUP,
                   help="the fleet processes' shared-subscription group (tierkit fleet serve --group)")
    i.add_argument("--force", action="store_true", help="replace an existing dynamic-security.json")
    i.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    passwords = init_broker(args.out, cloud=tuple(args.cloud or ("tierkit-cloud",)),
                            fleet=tuple(args.fleet or ("tierkit-fleet",)), cloud_group=args.cloud_group,
                            fleet_group=args.fleet_group, force=args.force)
    print(f"wrote {args.out / STATE_FILE} (the plugin rewrites it: keep it on the broker's data volume)")
    for name in passwords:
        print(f"account {name}: password in {args.out / (name + '.password')} (client id {name})")
    plugin = find_plugin()
    print(f"dynamic-security plugin on this host: {plugin}" if plugin else
          "no dynamic-security plugin on this host; Debian: /usr/lib/<arch>-linux-gnu/mosquitto_dynamic_security.so, "
          "eclipse-mosquitto image: /usr/lib/mosquitto_dynamic_security.so")
    return 0
