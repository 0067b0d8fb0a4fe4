"""Taking a release on the device: download, verify, stage, golden check, activate, soak, commit.

The fleet names the release a device must run in its desired state (`"release": "sha256:..."`, with
`"soak": {"requests": N}` or `{"seconds": T}`). `Swapper` does the swap in the background, every
step journaled in `edge_agent.slots` and reported (the daemon publishes a reported document at each
state change):

```
downloading  GET {fleet}/v1/releases/{digest}/archive, HTTP Basic auth with the device's MQTT user
             and password, size-capped, into slots/incoming (worker thread)
verifying    unpack safely, then `open_release`: the configured release keys, the digest asked for,
             every file's hash, the version floor (leaving = the release running now)
staged       moved into the slot that is not committed
golden       the recommended rung's golden inputs re-run here, then the new agent built (sessions
             opened, golden-checked and warmed) while the old one serves
active       the daemon's agent switched to the new one; requests in flight finish on the old one
soaking      until N requests or T seconds ran on the new release
committed    the version floor moves to it; the slot becomes the committed one
```

A swap that fails a check ends `refused` with the reason, and the old model keeps serving. A release
in the other slot that this device committed before is taken back by a pointer flip: verified again
(hashes, signature) but not downloaded, and committed at once. `"release": null` goes back to the
configured local model.

Test hook: with `TIERKIT_TEST_SWAP_PAUSE_AT=<state>` in the environment, the swap stops once it has
journaled and reported that state, so a test can `kill -9` the agent there (the crash matrix).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from compilers.golden import check_golden
from compilers.release import Release, open_release, unpack_release
from edge_agent.fleet_sync import https_context
from edge_agent.slots import SlotStore
from runtimes.errors import ConfigError, TierkitError
from runtimes.session import SessionOptions

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from edge_agent.agent import EdgeAgent

logger = logging.getLogger(__name__)

PAUSE_ENV = "TIERKIT_TEST_SWAP_PAUSE_AT"  # test hook (see the module docstring)
DEFAULT_SOAK = {"requests": 200}
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_RETRY_S = (2.0, 5.0, 15.0, 60.0)


class DownloadError(TierkitError):
    """The release could not be fetched; `permanent` when the fleet said no (401, 403, 404)."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class SwapOptions:
    """How a device fetches and checks releases.

    Args:
        keys: the Ed25519 public keys releases must be signed with (none: every release is refused).
        fleet_url: the fleet's HTTP address (None: not enrolled, nothing can be downloaded).
        auth: (user, password) for HTTP Basic auth: the enrollment's MQTT credentials.
        max_bytes: the largest archive downloaded.
        timeout_s: the socket timeout of a download.
        session: session options of the golden check.
        ca_file: the CA of an `https://` fleet's certificate (None: the system's CAs).
    """

    keys: tuple[Ed25519PublicKey, ...] = ()
    fleet_url: str | None = None
    auth: tuple[str, str] | None = None
    max_bytes: int = 2 * 1024**3
    timeout_s: float = 30.0
    session: SessionOptions | None = None
    ca_file: str | None = None


class SwapHost(Protocol):
    """What the swap needs of the daemon."""

    @property
    def agent(self) -> EdgeAgent: ...

    def build_agent(self, release: Release | None, *, successor_of: EdgeAgent | None = None) -> EdgeAgent: ...

    async def switch(self, agent: EdgeAgent, release: Release | None) -> None: ...

    def report(self) -> None: ...


def parse_desired(desired: Mapping[str, Any]) -> tuple[str | None, dict[str, float], bool] | None:
    """(release or None for the configured model, soak, rollback) of a desired document; None without "release"."""
    if "release" not in desired:
        return None
    target = desired["release"]
    if target is not None and not (isinstance(target, str) and _DIGEST.match(target)):
        msg = f'"release" must be a release digest "sha256:<64 hex>" or null, got {str(target)[:80]!r}'
        raise ConfigError(msg)
    soak = desired.get("soak") or DEFAULT_SOAK
    if (not isinstance(soak, Mapping) or not soak or set(soak) - {"requests", "seconds"}
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in soak.values())):
        msg = f'"soak" must be {{"requests": N}} or {{"seconds": T}} with N, T >= 0, got {soak!r}'
        raise ConfigError(msg)
    return target, {k: float(v) for k, v in soak.items()}, bool(desired.get("rollback", False))


def download(url: str, dest: Path, auth: tuple[str, str] | None, *, max_bytes: int, timeout_s: float,
             ca_file: str | None = None) -> int:
    """Stream `url` into `dest` (fsynced), at most `max_bytes`; returns the size."""
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    request = urllib.request.Request(url, headers=headers)
    size = 0
    try:
        context = https_context(url, ca_file)
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp, dest.open("wb") as out:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                msg = f"the release archive at {url} is {int(declared)} bytes, over the {max_bytes}-byte cap"
                raise DownloadError(msg, permanent=True)
            while chunk := resp.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    msg = f"the release archive at {url} is over the {max_bytes}-byte cap"
                    raise DownloadError(msg, permanent=True)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except urllib.error.HTTPError as exc:
        with exc:
            detail = exc.read(500).decode(errors="replace")
        why = {401: "refused this device's credentials", 403: "says this device is revoked",
               404: "has no such release"}.get(exc.code, "failed")
        msg = f"the fleet {why} (HTTP {exc.code} for {url}): {detail}"
        raise DownloadError(msg, permanent=exc.code in (401, 403, 404)) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        msg = f"cannot download the release from {url}: {exc}"
        raise DownloadError(msg, permanent=False) from None
    return size


def golden_of(release: Release, options: SessionOptions | None) -> dict[str, Any] | None:
    """The recommended rung's golden check on this machine, as reported; None when it carries no golden inputs."""
    variants = release.variant_set()
    rec = variants.recommended.id
    package = variants.open(rec)
    with package.open_session(options) as session:
        result = check_golden(package, session)
    if result is None:
        return None
    error = result.max_rel_error if result.max_rel_error < float("inf") else None
    out: dict[str, Any] = {"ok": result.passed, "max_rel_error": error, "variant": rec, "tolerance": result.tolerance}
    if result.reason:
        out["reason"] = result.reason
    return out


class _Refused(Exception):
    """A swap step said no: the swap ends refused with `reason` (`permanent`: not retried for this desired)."""

    def __init__(self, reason: str, *, permanent: bool = True) -> None:
        super().__init__(reason)
        self.permanent = permanent


class Swapper:
    """Runs the swaps a device's desired state asks for, one at a time, off the request path.

    Args:
        store: the slots and journal (already recovered).
        host: the daemon.
        options: keys, fleet address and credentials.
        running: the verified release the daemon runs now (None: its configured model).
    """

    def __init__(self, store: SlotStore, host: SwapHost, options: SwapOptions, running: Release | None) -> None:
        self.store, self.host, self.options, self.running = store, host, options, running
        self._wish: tuple[str | None, dict[str, float], int] | None = None
        self._wake: asyncio.Event | None = None
        self._retry_at = 0.0
        self._retries = 0
        self.busy = False

    def want(self, desired: Mapping[str, Any]) -> None:
        """Take a desired document (on the event loop); raises `ConfigError` for malformed release keys."""
        parsed = parse_desired(desired)
        if parsed is None:
            return
        target, soak, _rollback = parsed
        version = desired.get("version")
        self._wish = (target, soak, version if isinstance(version, int) else 0)
        self._retries, self._retry_at = 0, 0.0
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """The background task: apply the latest wish, watch the soak."""
        self._wake = wake = asyncio.Event()
        while True:
            try:
                async with asyncio.timeout(0.2):
                    await wake.wait()
            except TimeoutError:
                pass
            wake.clear()
            try:
                await self._soak_check()
                wish = self._wish
                if wish is not None and time.monotonic() >= self._retry_at:
                    self._wish = None
                    self.busy = True
                    try:
                        await self._apply(*wish)
                    finally:
                        self.busy = False
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the swap failed unexpectedly; the running model keeps serving")

    # -- the swap ------------------------------------------------------------------------------

    async def _step(self, state: str, target: str | None, **extra: Any) -> None:
        await asyncio.to_thread(self.store.begin, state, target, **extra)
        self.host.report()
        if os.environ.get(PAUSE_ENV) == state:
            logger.warning("test hook %s: the swap stops at %s", PAUSE_ENV, state)
            await asyncio.sleep(3600)

    async def _apply(self, target: str | None, soak: dict[str, float], version: int) -> None:
        store, st = self.store, self.store.state
        if target == store.running:
            return  # running it (soaking, or committed)
        if target is not None and st.failed.get(target, -1) >= version:
            return  # refused or rolled back here under this desired version: the journal says why
        slot = None if target is None else store.holding(target)
        if target is None or (slot is not None and (slot == st.committed or store.committed_here(target))):
            await self._flip(slot, target)
            return
        if st.active != st.committed:  # an uncommitted release is running: back to the committed one first
            await self._flip(st.committed, store.committed_release())
        try:
            release = await self._stage(target, version)
            await self._step("golden", target, desired_version=version)
            golden = await asyncio.to_thread(golden_of, release, self.options.session)
            if golden is not None and not golden["ok"]:
                msg = f"golden check failed on {golden['variant']}: {golden.get('reason', '')}"
                raise _Refused(msg)
            agent = await asyncio.to_thread(self._build, release)
            rec = release.variant_set().recommended.id
            if rec in agent.refused:
                await agent.aclose()
                msg = f"golden check failed on {rec}: {agent.refused[rec]}"
                raise _Refused(msg)
            await asyncio.to_thread(store.end, "golden")
        except Exception as exc:  # any failure before activation refuses the release; the old model serves on
            permanent = getattr(exc, "permanent", True)
            await asyncio.to_thread(store.fail if permanent else self._transient, target, "refused", str(exc),
                                    version)
            if not permanent:
                self._wish = self._wish or (target, soak, version)
            logger.warning("release %s refused: %s", target, exc)
            self.host.report()
            return
        st.active, st.golden = store.holding(target), golden
        await self._step("active", target, desired_version=version)
        await self.host.switch(agent, release)
        self.running = release
        await asyncio.to_thread(store.end, "active")
        await self._step("soaking", target, desired_version=version, soak={"requests": 0, "seconds": 0.0},
                         soak_target=soak)

    def _build(self, release: Release | None) -> EdgeAgent:
        return self.host.build_agent(release, successor_of=self.host.agent)

    def _transient(self, target: str | None, state: str, error: str, version: int) -> None:
        delay = _RETRY_S[min(self._retries, len(_RETRY_S) - 1)]
        self._retries += 1
        self._retry_at = time.monotonic() + delay
        self.store.begin(state, target, error=f"{error} (retrying in {delay:.0f} s)", desired_version=version)

    async def _stage(self, target: str, version: int) -> Release:
        store, opts = self.store, self.options
        if not opts.keys:
            msg = ("this device has no release key (agent.yaml fleet.release_keys) and refuses every release; "
                   "add the operators' public key")
            raise _Refused(msg)
        slot = store.staging_slot()
        if store.digest(slot) != target:
            if opts.fleet_url is None or opts.auth is None:
                msg = "this device is not enrolled in a fleet (no fleet identity): it cannot download releases"
                raise _Refused(msg)
            await self._step("downloading", target, desired_version=version)
            url = f"{opts.fleet_url.rstrip('/')}/v1/releases/{target}/archive"
            await asyncio.to_thread(self._download, url)
            await self._step("verifying", target, desired_version=version)
            release = await asyncio.to_thread(self._verify, store.incoming / "release", target)
            await asyncio.to_thread(store.end, "verifying")
            await self._step("staged", target, desired_version=version)
            await asyncio.to_thread(self._move_into, slot, target)
            return dataclasses.replace(release, directory=store.slot_dir(slot))
        # staged here before (an interrupted swap): verified again, not downloaded
        await self._step("verifying", target, desired_version=version)
        return await asyncio.to_thread(self._verify, store.slot_dir(slot), target)

    def _download(self, url: str) -> None:
        self.store.clear_incoming()
        self.store.incoming.mkdir(parents=True)
        archive = self.store.incoming / "release.tar"
        size = download(url, archive, self.options.auth, max_bytes=self.options.max_bytes,
                        timeout_s=self.options.timeout_s, ca_file=self.options.ca_file)
        unpack_release(archive, self.store.incoming / "release")
        archive.unlink()
        self.store.end("downloading")
        logger.info("downloaded %d bytes from %s", size, url)

    def _verify(self, directory: Path, target: str) -> Release:
        return open_release(directory, trusted_keys=list(self.options.keys), floor=self.store.floor,
                            leaving=self.running, expect_digest=target)

    def _move_into(self, slot: str, target: str) -> None:
        store = self.store
        store.state.slots[slot] = None
        store.save()
        shutil.rmtree(store.slot_dir(slot), ignore_errors=True)
        os.replace(store.incoming / "release", store.slot_dir(slot))
        store.state.slots[slot] = target
        store.end("staged")
        store.clear_incoming()

    async def _flip(self, slot: str | None, target: str | None) -> None:
        """A/B pointer flip to a release this device committed before (or None: the configured model)."""
        store = self.store
        try:
            release = None
            if slot is not None:
                release = await asyncio.to_thread(open_release, store.slot_dir(slot),
                                                  trusted_keys=list(self.options.keys), expect_digest=target)
            golden = None if release is None else await asyncio.to_thread(golden_of, release, self.options.session)
            agent = await asyncio.to_thread(self._build, release)
        except TierkitError as exc:
            await asyncio.to_thread(store.fail, target, "refused", f"cannot go back to {target}: {exc}", 0)
            self.host.report()
            return
        store.state.active, store.state.golden = slot, golden
        await self._step("active", target)
        await self.host.switch(agent, release)
        self.running = release
        await asyncio.to_thread(self._commit, release, slot)
        self.host.report()

    def _commit(self, release: Release | None, slot: str | None) -> None:
        store = self.store
        if release is not None:  # admitted by the floor when verified (or a flip to a release committed here)
            store.floor.admit_version(f"release:{release.name}", release.version, f"release {release.digest}",
                                      rollback_ok=True, record=True)
        store.commit(slot)
        soak = (store.state.swap or {}).get("soak")
        store.begin("committed", release.digest if release else None, **({"soak": soak} if soak else {}))
        store.end("committed")

    async def _soak_check(self) -> None:
        swap = self.store.state.swap
        if swap is None or swap.get("state") != "soaking" or self.busy:
            return
        agent = self.host.agent
        agent.fold()
        done = {"requests": agent.stats.requests, "seconds": round(time.time() - float(swap["since"]), 1)}
        swap["soak"] = done
        need = swap.get("soak_target") or DEFAULT_SOAK
        if all(done[k] >= v for k, v in need.items()):
            await asyncio.to_thread(self._commit, self.running, self.store.state.active)
            self.host.report()
            if os.environ.get(PAUSE_ENV) == "committed":
                await asyncio.sleep(3600)
