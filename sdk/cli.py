"""The single `tierkit` command. Each layer mounts its subcommands through `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from runtimes.errors import TierkitError

# Each module exposes add_parser(subparsers); its subcommands call set_defaults(func=...).
_COMMAND_MODULES = (
    "runtimes.cli",        # doctor
    "compilers.cli",       # compile
    "compilers.package_cli",  # keygen, inspect, verify, run
    "cloud_service.cli",   # serve
    "cloud_service.broker_setup",  # broker init
    "cloud_service.fleet.cli",  # fleet
    "cloud_service.export",  # export
    "edge_agent.cli",      # agent
    "edge_agent.plan_cli", # plan
    "sdk.demo",            # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkit", description="Edge-to-cloud tiered inference.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"tierkit {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def _version() -> str:
    from sdk import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TierkitError as exc:
        if args.debug:
            raise
        print(f"tierkit: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
