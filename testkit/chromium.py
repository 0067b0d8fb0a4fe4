"""Debian's Chromium for the dashboard's browser tests and bench/bench_dashboard.py, headless through Playwright."""

from __future__ import annotations

CHROMIUM = "/usr/bin/chromium"
# no sandbox (runs as root in CI), no GPU, no traffic of its own: the page under test is all it loads
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
