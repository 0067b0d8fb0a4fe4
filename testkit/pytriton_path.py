"""Where PyTriton's server script lies. It runs under a Python of its own (nvidia-pytriton pins numpy < 2, so
it lives in a virtual environment beside tierkit's; see pytriton_server.py): started by path, never imported."""

from __future__ import annotations

from pathlib import Path

SERVER_SCRIPT = Path(__file__).with_name("pytriton_server.py")
