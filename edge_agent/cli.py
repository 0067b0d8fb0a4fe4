"""`tierkit agent --config agent.yaml`: run the edge agent as a local Open Inference Protocol server.

(`tierkit plan` lives in `edge_agent/plan_cli.py`, mounted beside this module by `sdk/cli.py`.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

from edge_agent.config import load_config, parse_listen
from runtimes.errors import ConfigError

# read here, at the command's edge, and handed down as `SwapOptions.pause_at`: a crash test stops the swap at
# a state (`downloading` ... `committed`) and kills the agent there
PAUSE_ENV = "TIERKIT_TEST_SWAP_PAUSE_AT"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit agent`."""
    p = subparsers.add_parser(
        "agent", help="run the edge agent: local Open Inference Protocol server with tiered inference",
        description="Serve a model package or variant set on localhost over the Open Inference Protocol "
                    "(gRPC), answering at the edge and escalating unsure inputs to the cloud.")
    p.add_argument("--config", required=True, metavar="agent.yaml", help="the agent configuration file")
    p.add_argument("--listen", metavar="HOST:PORT", help="override the config's listen address (port 0: any free)")
    p.add_argument("--device-id", help="override the config's device id")
    p.add_argument("--enroll", metavar="URL", help="enroll in the fleet at URL (once; the identity is kept)")
    p.add_argument("--token", help="the one-time enrollment token for --enroll")
    p.add_argument("--fleet-state", metavar="DIR", help="where the fleet identity is kept (default ./fleet-state)")
    p.add_argument("--fleet-ca", metavar="PEM", help="CA of an https:// fleet's certificate (default: the system's)")
    p.set_defaults(func=run)


def _pause_at() -> Any:
    from cloud_service.protocol.fleet_docs import SwapState

    value = os.environ.get(PAUSE_ENV)
    if not value:
        return None
    try:
        return SwapState(value)
    except ValueError:
        msg = f"{PAUSE_ENV}={value!r} is not a swap state; use one of {', '.join(SwapState)}"
        raise ConfigError(msg) from None


def run(args: argparse.Namespace) -> int:
    from edge_agent.daemon import run_daemon

    pause_at = _pause_at()
    config = load_config(args.config)
    if args.listen:
        config = dataclasses.replace(config, listen=parse_listen(args.listen, "--listen"))
    if args.device_id:
        config = dataclasses.replace(config, options=dataclasses.replace(config.options, device_id=args.device_id))

    if args.enroll:
        from edge_agent.config import FleetEnrollment

        state = Path(args.fleet_state) if args.fleet_state else (
            config.fleet.state_dir if config.fleet else Path("fleet-state"))
        keys = config.fleet.release_keys if config.fleet else ()
        ca = Path(args.fleet_ca) if args.fleet_ca else (config.fleet.ca_file if config.fleet else None)
        config = dataclasses.replace(config, fleet=FleetEnrollment(args.enroll, args.token or "", state, keys, ca))
    if config.fleet is not None:
        from edge_agent.fleet_sync import enrolled_config

        config = enrolled_config(config)

    def ready(daemon: Any) -> None:
        host = config.listen[0]
        cloud = config.cloud or "none (edge only)"
        print(f"tierkit agent: serving {daemon.agent.model_name!r} on {host}:{daemon.port}, "
              f"device {daemon.device}, cloud {cloud}", flush=True)
        journal = daemon.agent.journal
        if journal is not None and journal.recovered_from is not None:
            print(f"tierkit agent: the journal was corrupt; moved it to {journal.recovered_from}",
                  file=sys.stderr, flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await run_daemon(config, stop=stop, ready=ready, pause_swap_at=pause_at)

    asyncio.run(main())
    return 0
