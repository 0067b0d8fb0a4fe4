"""Taking a release on the device: download, verify, stage, golden check, activate, soak, commit.

The fleet names the release a device must run in its desired state (`"release": "sha256:..."`, with
`"soak": {"requests": N}` or `{"seconds": T}`; `fleet_docs.Desired`). `Swapper` does the swap in the
background, every step journaled in `edge_agent.slots`, and yields each transition
(`async for step in swapper.transitions(served)`): the fleet sync reports it, and at `active` the daemon
serves from the new agent before the swap goes on:

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

`SwapOptions.pause_at` stops the swap once it has journaled and reported a state, so a test can
`kill -9` the agent there (the crash matrix; `tierkit agent` sets it from the environment).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloud_service.protocol.fleet_docs import DEFAULT_SOAK, UNSET, Desired, Soak, SwapState
from compilers.golden import check_golden
from compilers.release import Release, open_release, unpack_release
from edge_agent.fleet_sync import https_context
from edge_agent.slots import SlotStore
from runtimes.errors import TierkitError
from runtimes.session import SessionOptions

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from edge_agent.agent import EdgeAgent

logger = logging.getLogger(__name__)

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
        pause_at: stop the swap for good once it reached this state (the crash tests kill the agent there).
    """

    keys: tuple[Ed25519PublicKey, ...] = ()
    fleet_url: str | None = None
    auth: tuple[str, str] | None = None
    max_bytes: int = 2 * 1024**3
    timeout_s: float = 30.0
    session: SessionOptions | None = None
    ca_file: str | None = None
    pause_at: SwapState | None = None


@dataclass(frozen=True)
class Transition:
    """One step of a swap, journaled before it is yielded.

    Args:
        state: the swap's state now (None: the journal changed without a new state, e.g. a refusal retried).
        target: the release it takes (None: the configured model).
        agent: at `active`, the agent built for it: serve from it before asking for the next step.
    """

    state: SwapState | None
    target: str | None
    agent: EdgeAgent | None = None


_Wish = tuple[str | None, Soak, int]


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

    The slot store is the one record of what runs: the swapper changes it through its methods and yields
    each transition; it neither reports nor switches agents itself.

    Args:
        store: the slots and journal (already recovered).
        options: keys, fleet address and credentials.
        build: the agent for a release (None: the configured model), a successor of the one serving now;
            called in a worker thread.

    Example:
        >>> async for step in Swapper(store, options, build).transitions(served=lambda: agent.stats.requests):
        ...     if step.agent is not None:
        ...         await daemon.switch(step.agent)
        ...     sync.report()
    """

    def __init__(self, store: SlotStore, options: SwapOptions, build: Callable[[Release | None], EdgeAgent]) -> None:
        self.store, self.options, self.build = store, options, build
        self._wish: _Wish | None = None
        self._wake = asyncio.Event()
        self._retry_at = 0.0
        self._retries = 0
        self._staged: Release | None = None
        self.busy = False

    def want(self, desired: Desired) -> None:
        """Take a desired document (on the event loop); one without "release" changes nothing here."""
        if desired.release is UNSET:
            return
        self._wish = (desired.release, desired.soak_or_default(), desired.version or 0)
        self._retries, self._retry_at = 0, 0.0
        self._wake.set()

    async def transitions(self, served: Callable[[], int]) -> AsyncIterator[Transition]:
        """The background loop: the latest wish applied, the soak watched (`served()`: the requests the serving
        agent answered), each step yielded once journaled; it runs until the consumer stops."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):
                    await self._wake.wait()
            self._wake.clear()
            try:
                async for step in self._steps(served):
                    yield step
                    if step.state is not None and step.state == self.options.pause_at:
                        logger.warning("the swap stops at %s (SwapOptions.pause_at)", step.state)
                        await asyncio.sleep(3600)
            except Exception:
                logger.exception("the swap failed unexpectedly; the running model keeps serving")

    async def _steps(self, served: Callable[[], int]) -> AsyncIterator[Transition]:
        if not self.busy:
            committed = await self._soak_check(served)
            if committed is not None:
                yield committed
        wish = self._wish
        if wish is not None and time.monotonic() >= self._retry_at:
            self._wish = None
            self.busy = True
            try:
                async for step in self._apply(*wish):
                    yield step
            finally:
                self.busy = False

    # -- the swap ------------------------------------------------------------------------------

    async def _begin(self, state: SwapState, target: str | None, **extra: Any) -> Transition:
        await asyncio.to_thread(self.store.begin, state, target, **extra)
        return Transition(state, target)

    async def _apply(self, target: str | None, soak: Soak, version: int) -> AsyncIterator[Transition]:
        store, st = self.store, self.store.state
        if target == store.running:
            return  # running it (soaking, or committed)
        if target is not None and st.failed.get(target, -1) >= version:
            return  # refused or rolled back here under this desired version: the journal says why
        slot = None if target is None else store.holding(target)
        if target is None or (slot is not None and (slot == st.committed or store.committed_here(target))):
            async for step in self._flip(slot, target):
                yield step
            return
        if st.active != st.committed:  # an uncommitted release is running: back to the committed one first
            async for step in self._flip(st.committed, store.committed_release()):
                yield step
        try:
            async for step in self._stage(target, version):
                yield step
            yield await self._begin(SwapState.GOLDEN, target, desired_version=version)
            release, golden, agent = await self._check(target)
        except Exception as exc:  # any failure before activation refuses the release; the old model serves on
            yield await self._refuse(target, soak, version, exc)
            return
        await self._begin(SwapState.ACTIVE, target, desired_version=version)
        yield Transition(SwapState.ACTIVE, target, agent)  # the consumer serves from the new agent before it resumes
        self._activate(release, golden)
        await asyncio.to_thread(store.end, SwapState.ACTIVE)
        yield await self._begin(SwapState.SOAKING, target, desired_version=version,
                                soak={"requests": 0, "seconds": 0.0}, soak_target=soak.to_json())

    async def _check(self, target: str) -> tuple[Release, dict[str, Any] | None, EdgeAgent]:
        """The staged release's golden check, then its agent (sessions opened, golden-checked, warmed)."""
        release = self._staged
        assert release is not None
        golden = await asyncio.to_thread(golden_of, release, self.options.session)
        if golden is not None and not golden["ok"]:
            msg = f"golden check failed on {golden['variant']}: {golden.get('reason', '')}"
            raise _Refused(msg)
        agent = await asyncio.to_thread(self.build, release)
        rec = release.variant_set().recommended.id
        if rec in agent.refused:
            await agent.aclose()
            msg = f"golden check failed on {rec}: {agent.refused[rec]}"
            raise _Refused(msg)
        await asyncio.to_thread(self.store.end, SwapState.GOLDEN)
        return release, golden, agent

    async def _refuse(self, target: str, soak: Soak, version: int, exc: Exception) -> Transition:
        permanent = getattr(exc, "permanent", True)
        await asyncio.to_thread(self.store.fail if permanent else self._transient, target, SwapState.REFUSED,
                                str(exc), version)
        if not permanent:
            self._wish = self._wish or (target, soak, version)
        logger.warning("release %s refused: %s", target, exc)
        return Transition(SwapState.REFUSED, target)

    def _activate(self, release: Release | None, golden: dict[str, Any] | None) -> None:
        slot = None if release is None else self.store.holding(release.digest)
        if slot is not None and release is not None:
            self.store.opened(slot, release)
        self.store.activate(slot, golden)

    def _transient(self, target: str | None, state: SwapState, error: str, version: int) -> None:
        delay = _RETRY_S[min(self._retries, len(_RETRY_S) - 1)]
        self._retries += 1
        self._retry_at = time.monotonic() + delay
        self.store.begin(state, target, error=f"{error} (retrying in {delay:.0f} s)", desired_version=version)

    async def _stage(self, target: str, version: int) -> AsyncIterator[Transition]:
        """Download (unless the staging slot holds it), verify and stage `target`; the result in `_staged`."""
        store, opts = self.store, self.options
        self._staged = None
        if not opts.keys:
            msg = ("this device has no release key (agent.yaml fleet.release_keys) and refuses every release; "
                   "add the operators' public key")
            raise _Refused(msg)
        slot = store.staging_slot()
        if store.digest(slot) != target:
            if opts.fleet_url is None or opts.auth is None:
                msg = "this device is not enrolled in a fleet (no fleet identity): it cannot download releases"
                raise _Refused(msg)
            yield await self._begin(SwapState.DOWNLOADING, target, desired_version=version)
            url = f"{opts.fleet_url.rstrip('/')}/v1/releases/{target}/archive"
            await asyncio.to_thread(self._download, url)
            yield await self._begin(SwapState.VERIFYING, target, desired_version=version)
            release = await asyncio.to_thread(self._verify, store.incoming / "release", target)
            await asyncio.to_thread(store.end, SwapState.VERIFYING)
            yield await self._begin(SwapState.STAGED, target, desired_version=version)
            await asyncio.to_thread(self._move_into, slot, target)
            self._staged = dataclasses.replace(release, directory=store.slot_dir(slot))
            return
        # staged here before (an interrupted swap): verified again, not downloaded
        yield await self._begin(SwapState.VERIFYING, target, desired_version=version)
        self._staged = await asyncio.to_thread(self._verify, store.slot_dir(slot), target)

    def _download(self, url: str) -> None:
        self.store.clear_incoming()
        self.store.incoming.mkdir(parents=True)
        archive = self.store.incoming / "release.tar"
        size = download(url, archive, self.options.auth, max_bytes=self.options.max_bytes,
                        timeout_s=self.options.timeout_s, ca_file=self.options.ca_file)
        unpack_release(archive, self.store.incoming / "release")
        archive.unlink()
        self.store.end(SwapState.DOWNLOADING)
        logger.info("downloaded %d bytes from %s", size, url)

    def _verify(self, directory: Path, target: str) -> Release:
        return open_release(directory, trusted_keys=list(self.options.keys), floor=self.store.floor,
                            leaving=self.store.running_release(), expect_digest=target)

    def _move_into(self, slot: str, target: str) -> None:
        store = self.store
        store.place(slot, None)
        shutil.rmtree(store.slot_dir(slot), ignore_errors=True)
        os.replace(store.incoming / "release", store.slot_dir(slot))
        store.place(slot, target)
        store.end(SwapState.STAGED)
        store.clear_incoming()

    async def _flip(self, slot: str | None, target: str | None) -> AsyncIterator[Transition]:
        """A/B pointer flip to a release this device committed before (or None: the configured model)."""
        store = self.store
        try:
            release = None
            if slot is not None:
                release = await asyncio.to_thread(open_release, store.slot_dir(slot),
                                                  trusted_keys=list(self.options.keys), expect_digest=target)
            golden = None if release is None else await asyncio.to_thread(golden_of, release, self.options.session)
            agent = await asyncio.to_thread(self.build, release)
        except TierkitError as exc:
            await asyncio.to_thread(store.fail, target, SwapState.REFUSED, f"cannot go back to {target}: {exc}", 0)
            yield Transition(SwapState.REFUSED, target)
            return
        await self._begin(SwapState.ACTIVE, target)
        yield Transition(SwapState.ACTIVE, target, agent)
        self._activate(release, golden)
        await asyncio.to_thread(self._commit, release, slot)
        yield Transition(SwapState.COMMITTED, target)

    def _commit(self, release: Release | None, slot: str | None) -> None:
        store = self.store
        if release is not None:  # admitted by the floor when verified (or a flip to a release committed here)
            store.floor.admit_version(f"release:{release.name}", release.version, f"release {release.digest}",
                                      rollback_ok=True, record=True)
        store.commit(slot)
        soak = (store.state.swap or {}).get("soak")
        store.begin(SwapState.COMMITTED, release.digest if release else None, **({"soak": soak} if soak else {}))
        store.end(SwapState.COMMITTED)

    async def _soak_check(self, served: Callable[[], int]) -> Transition | None:
        progress = self.store.soak_progress(served)
        if progress is None:
            return None
        done, need = progress
        if not (Soak.parse(need, where="the journal's soak") if need else DEFAULT_SOAK).reached(done):
            return None
        release = self.store.running_release()
        await asyncio.to_thread(self._commit, release, self.store.state.active)
        return Transition(SwapState.COMMITTED, release.digest if release else None)
