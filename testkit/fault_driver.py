"""A device process for the agent kill -9 fault test: issues kept escalations, printing each answer.

Usage: python fault_driver.py '{"model": ..., "cloud": ..., "journal": ..., "device": ..., "start": 0,
"count": 100, "finish": false}'. Prints `boot BOOT`, then `ok BOOT SEQ` per answer; with `finish`, waits
until the journal is empty, prints `drained` and exits 0 (1 if it did not drain within 90 s).
"""

from __future__ import annotations

import json
import sys
import time

import sdk
from edge_agent.agent import AgentOptions
from edge_agent.breaker import BreakerConfig
from edge_agent.policy import Policy
from testkit import zoo


def main() -> int:
    spec = json.loads(sys.argv[1])
    digits = zoo.digits(seed=0)
    options = AgentOptions(device_id=spec["device"], journal_path=spec["journal"], drain_interval_s=0.2,
                           breaker=BreakerConfig(failure_threshold=3, reset_timeout_s=0.5))
    with sdk.load(spec["model"], cloud=spec["cloud"], budget=sdk.Budget(latency_ms=200),
                  policy=Policy("max_prob", threshold=2.0, keep=True), options=options) as model:
        boot = model.agent.options.boot_id
        print("boot", boot, flush=True)
        for i in range(spec["start"], spec["start"] + spec["count"]):
            pred = model.predict(digits.x_test[i % len(digits.x_test)], keep=True)
            print("ok", boot, pred.seq, flush=True)
        if not spec["finish"]:
            return 0
        journal = model.agent.journal
        assert journal is not None
        deadline = time.monotonic() + 90
        while journal.count() and time.monotonic() < deadline:
            time.sleep(0.05)
        if journal.count():
            return 1
        print("drained", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
