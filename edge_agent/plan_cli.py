"""Subcommands of this layer (filled in by the layer's own work)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register this layer's subcommands."""
