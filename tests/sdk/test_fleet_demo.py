"""`tierkit demo --fleet` in its short form: two agents, a good release rolled out and a bad one rolled back, the
dashboard's address and a token printed; Ctrl-C (SIGINT to the demo alone) stops it, and no process it started
is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testkit.deploy_broker import dynsec_plugin, need_mosquitto
from testkit.fleet_process import ROOT
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _processes_under(workdir: Path) -> list[str]:
    """Command lines of running processes that name `workdir` (every process the demo starts does)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(workdir) in cmdline and proc.name != str(os.getpid()):
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.timeout(540)
def test_the_fleet_quickstart_rolls_out_and_back_and_leaves_nothing_behind(tmp_path: Path) -> None:
    need_mosquitto()
    dynsec_plugin()
    work = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "sdk.cli", "demo", "--fleet", "--agents", "2", "--workdir",
                             str(work)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: killed whole if it hangs
    lines: list[str] = []
    running = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "press Ctrl-C" in line:
                running.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert running.wait(420), "".join(lines)[-3000:]
        dashboard = re.search(r"dashboard: (http://127\.0\.0\.1:\d+)/#token=(\S+)", "".join(lines))
        assert dashboard, "".join(lines)
        assert _get(dashboard.group(1) + "/v1/devices")[0] == 401  # the printed token is what opens it
        status, body = _get(dashboard.group(1) + "/v1/devices", dashboard.group(2))
        assert status == 200
        assert len(json.loads(body)) == 2
        # the good release's canary was judged against a baseline of each device's own, not passed unjudged
        status, body = _get(dashboard.group(1) + "/v1/rollouts/1", dashboard.group(2))
        assert status == 200
        canary = {g["gate"]: g for g in json.loads(body)["waves"][0]["gates"]}
        assert canary["escalation_rate"]["decision"] == "pass", canary["escalation_rate"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # the demo writes every thread's stack: where its stop hangs
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)  # and nothing it started outlives the test
            rc = proc.wait(10)
        reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()
    text = "".join(lines)
    assert rc == 0, text[-8000:]  # with the stacks where a stop hung
    assert re.search(r"succeeded: \{'committed': 2\}", text), text
    assert "rolled back: wave 0 failed: device_verifies" in text, text
    assert "stopped: every process the demo started has exited" in text
    wait_for("every process the demo started to be gone", lambda: not _processes_under(work), timeout=10,
             interval=0.2)
