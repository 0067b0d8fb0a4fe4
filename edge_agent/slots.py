"""Two model slots (A/B) and the crash-safe swap journal, kept under the fleet state directory.

```
state_dir/
  slots/A/  slots/B/    one release each (release.json, release.sig, variants/), verified whenever opened
  slots/incoming/       a download being unpacked and verified; discarded on restart
  swap.json             the journal: what each slot holds, which one is committed, which one runs,
                        the swap in progress (or the last one), the golden result, the crash count
  swap.log              one JSON line per step begun and ended (the history, for people)
  floor.json            the version floor of releases (`compilers.version_floor`)
  running               present while an agent runs: found at start, the last stop was unclean
```

A swap moves through `downloading -> verifying -> staged -> golden -> active -> soaking -> committed`
(or ends `refused`, or `rolled_back`). Every step is written to swap.json before it starts and after it
ends, atomically (temp file, fsync, rename, fsync of the directory), so a `kill -9` leaves the state
before a step or after it, never half of one. The committed slot is never written by a swap: a release
is staged into the other one. `recover()` turns whatever a kill left into a state that runs:

- killed before `active`: the committed slot runs (or the configured model); the staging is discarded
  and done again when the fleet's retained desired state arrives (refused after `MAX_INTERRUPTED` tries,
  so a release whose golden check kills the agent cannot keep it in a crash loop);
- killed at `active` or `soaking`: the committed slot runs and the swap ends `rolled_back`, "agent
  restarted during soak"; that release is not tried again until the fleet's desired version moves on;
- killed after `committed`: the new release runs.

Example:
    >>> store = SlotStore(Path("fleet-state"))
    >>> store.recover(); store.mark_running()
    >>> store.committed_release()   # the digest the agent boots, or None for its configured model
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cloud_service.protocol.fleet_docs import (
    LIVE,
    PRE_ACTIVE,
    GoldenReport,
    SlotsReport,
    SoakProgress,
    SwapReport,
    SwapState,
)
from compilers.release import Release
from compilers.version_floor import VersionFloor
from runtimes.errors import ConfigError

SLOTS = ("A", "B")
RESTARTED = "agent restarted during soak"
MAX_INTERRUPTED = 3  # a swap interrupted this often before `active` is refused (a crash loop otherwise)
_HISTORY = 16


@dataclass
class Journal:
    """swap.json. `swap` is the swap in progress or the last one; `failed` maps a release that was refused or
    rolled back here to the desired version it failed under (it is not tried again for that version)."""

    slots: dict[str, str | None] = field(default_factory=lambda: dict.fromkeys(SLOTS))
    committed: str | None = None
    active: str | None = None
    swap: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    golden: dict[str, Any] | None = None
    crashes: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)
    interrupted: dict[str, int] = field(default_factory=dict)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old bytes or the new ones, both durable."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SlotStore:
    """The A/B slots and the swap journal of one device.

    Args:
        state_dir: the fleet state directory (beside the device's identity).
    """

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir)
        (self.root / "slots").mkdir(parents=True, exist_ok=True)
        self.path = self.root / "swap.json"
        self.floor = VersionFloor(self.root / "floor.json")
        self.state = self._load()
        self._opened: dict[str, Release] = {}  # slot -> its release, verified when it was opened

    def _load(self) -> Journal:
        if not self.path.exists():
            return Journal()
        try:
            doc = json.loads(self.path.read_bytes())
            state = Journal(**doc)
            if set(state.slots) != set(SLOTS) or state.active not in (*SLOTS, None):
                raise ValueError("slots must be A and B")  # noqa: EM101
        except (OSError, ValueError, TypeError) as exc:
            msg = f"swap journal {str(self.path)!r} is unreadable ({exc}); remove it to boot the configured model"
            raise ConfigError(msg) from None
        return state

    def save(self) -> None:
        write_atomic(self.path, (json.dumps(asdict(self.state), indent=1, sort_keys=True) + "\n").encode())

    def log(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": round(time.time(), 3), "event": event, **fields}, sort_keys=True) + "\n"
        with (self.root / "swap.log").open("a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    # -- slots ---------------------------------------------------------------------------------

    def slot_dir(self, slot: str) -> Path:
        return self.root / "slots" / slot

    @property
    def incoming(self) -> Path:
        return self.root / "slots" / "incoming"

    def staging_slot(self) -> str:
        """The slot a new release goes into: never the committed one."""
        return "B" if self.state.committed == "A" else "A"

    def holding(self, digest: str) -> str | None:
        return next((s for s in SLOTS if self.state.slots[s] == digest), None)

    def digest(self, slot: str | None) -> str | None:
        return None if slot is None else self.state.slots[slot]

    @property
    def running(self) -> str | None:
        """The digest of the release that runs (None: the configured model)."""
        return self.digest(self.state.active)

    def committed_release(self) -> str | None:
        return self.digest(self.state.committed)

    def running_release(self) -> Release | None:
        """The verified release that runs (None: the configured model)."""
        slot = self.state.active
        release = None if slot is None else self._opened.get(slot)
        return release if release is not None and release.digest == self.state.slots[slot or ""] else None

    def opened(self, slot: str, release: Release) -> None:
        """Keep the verified `release` that `slot` holds (the swap and the boot open it)."""
        self._opened[slot] = release

    def place(self, slot: str, digest: str | None) -> None:
        """Record what `slot` holds (None while it is being replaced)."""
        self.state.slots[slot] = digest
        self._opened.pop(slot, None)
        self.save()

    def activate(self, slot: str | None, golden: dict[str, Any] | None) -> None:
        """The release in `slot` (None: the configured model) serves from now on, with its golden result."""
        self.state.active, self.state.golden = slot, golden
        self.save()

    def set_golden(self, golden: dict[str, Any] | None) -> None:
        self.state.golden = golden
        self.save()

    def soak_progress(self, served: Callable[[], int]) -> tuple[SoakProgress, dict[str, Any]] | None:
        """While soaking: how far it came (`served()` requests; recorded in the journal, unsaved) and the soak
        it needs; None otherwise (without asking `served`)."""
        swap = self.state.swap
        if swap is None or swap.get("state") != SwapState.SOAKING:
            return None
        done = SoakProgress(served(), round(time.time() - float(swap["since"]), 1))
        swap["soak"] = done.to_json()
        return done, swap.get("soak_target") or {}

    def clear_incoming(self) -> None:
        shutil.rmtree(self.incoming, ignore_errors=True)

    # -- steps ---------------------------------------------------------------------------------

    def begin(self, state: SwapState, target: str | None, **extra: Any) -> dict[str, Any]:
        """Record that the swap to `target` is in `state` now (durable before the step runs)."""
        state = SwapState(state)
        swap = {"state": state.value, "target": target, "since": round(time.time(), 3), **extra}
        self.state.swap = swap
        if state.final:
            self.state.last = swap
        self.save()
        self.log("begin", state=state.value, target=target)
        return swap

    def end(self, state: SwapState) -> None:
        """Record that the step `state` finished (its effect is in the journal)."""
        if self.state.swap is not None:
            self.state.swap["done"] = True
        self.save()
        self.log("end", state=SwapState(state).value, target=(self.state.swap or {}).get("target"))

    def fail(self, target: str | None, state: SwapState, error: str, desired_version: int) -> dict[str, Any]:
        if target is not None:
            self.state.failed[target] = desired_version
            if len(self.state.failed) > _HISTORY:
                self.state.failed.pop(next(iter(self.state.failed)))
        return self.begin(state, target, error=error)

    def commit(self, slot: str | None) -> None:
        self.state.committed = self.state.active = slot
        digest = self.digest(slot)
        if digest is not None:
            self.state.history = [*(d for d in self.state.history if d != digest), digest][-_HISTORY:]
            self.state.failed.pop(digest, None)
            self.state.interrupted.pop(digest, None)

    def committed_here(self, digest: str) -> bool:
        return digest in self.state.history

    # -- start and stop ------------------------------------------------------------------------

    def recover(self) -> str:
        """Turn what a kill left into a state that runs (see the module docstring); returns what was done."""
        st = self.state
        swap, note = st.swap, ""
        self.clear_incoming()
        if swap is not None and swap.get("state") in PRE_ACTIVE:  # the journal's own fields (swap.json)
            target = str(swap.get("target"))
            st.interrupted[target] = tries = st.interrupted.get(target, 0) + 1
            st.swap = st.last
            note = f"swap to {target} interrupted at {swap['state']}; it is done again"
            if tries >= MAX_INTERRUPTED:  # the step itself may be what kills the agent: stop trying
                st.failed[target] = int(swap.get("desired_version", 0))
                st.last = st.swap = {"state": SwapState.REFUSED.value, "target": target, "since": round(time.time(), 3),
                                     "error": f"the agent stopped {tries} times during this swap "
                                              f"(last at {swap['state']}); not tried again"}
                note = f"swap to {target} refused: interrupted {tries} times"
        elif swap is not None and swap.get("state") in LIVE:
            live: str | None = swap.get("target")
            desired = swap.get("desired_version", 0)
            if live is not None:
                st.failed[live] = int(desired)
            st.last = st.swap = {"state": SwapState.ROLLED_BACK.value, "target": live, "since": round(time.time(), 3),
                                 "error": RESTARTED, "soak": swap.get("soak")}
            note = f"swap to {live} rolled back: {RESTARTED}"
        if st.active != st.committed:
            st.active = st.committed
            st.golden = None
        if note:
            self.log("recover", note=note)
        self.save()
        return note

    def mark_running(self) -> bool:
        """Count an unclean previous stop (the marker is still there) and set the marker; True if unclean."""
        marker = self.root / "running"
        unclean = marker.exists()
        if unclean:
            self.state.crashes += 1
            self.save()
        write_atomic(marker, f"{os.getpid()}\n".encode())
        return unclean

    def clear_running(self) -> None:
        (self.root / "running").unlink(missing_ok=True)

    def report(self) -> tuple[SwapReport | None, SlotsReport, GoldenReport | None]:
        """The reported document's swap, slots and golden check."""
        st, swap, golden = self.state, self.state.swap, self.state.golden
        report = None
        if swap is not None:
            soak = swap.get("soak")
            report = SwapReport(SwapState(swap["state"]), swap.get("target"), float(swap.get("since") or 0.0),
                                swap.get("error"), SoakProgress(int(soak.get("requests") or 0),
                                                                float(soak.get("seconds") or 0.0)) if soak else None)
        checked = None if golden is None else GoldenReport(
            bool(golden.get("ok")), golden.get("max_rel_error"), golden.get("variant"), golden.get("tolerance"),
            golden.get("reason"))
        return report, SlotsReport(st.slots["A"], st.slots["B"], st.active), checked
