"""What this node has prepared, persisted so unprepare works in a new process when the claim is gone.

The kubelet retries both calls and may send `NodeUnprepareResources` after an agent restart with nothing but
namespace, UID and name, often after the claim was deleted with its pod. So each prepared claim is written to
`<state dir>/dra-prepared.json` (one JSON object keyed by claim UID, replaced atomically) before the answer
goes back; it also lets prepare refuse a device already prepared for another claim.

During a rolling update two agent processes serve the same node for a while, so every call holds
`serialize.lock` (an exclusive `flock`, as the Go helper's rolling-update mode does) and reads the record again
under it before acting.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "dra-prepared.json"
LOCK_NAME = "serialize.lock"
LOCK_POLL_SECONDS = 0.02


class LockTimeout(OSError):
    """Another process held the serialize lock for longer than a kubelet call may take."""


@contextlib.asynccontextmanager
async def serialized(path: Path, timeout: float = 40.0) -> AsyncIterator[None]:
    """Hold an exclusive flock on `path` without blocking the event loop (non-blocking attempts, polled)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if loop.time() > deadline:
                    raise LockTimeout(f"{path} held by another process for {timeout:.0f} s") from None
                await asyncio.sleep(LOCK_POLL_SECONDS)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PreparedDevice:
    """One device as returned to the kubelet."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class PreparedClaim:
    """A claim prepared on this node."""

    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


class PreparedStore:
    """The prepared claims, in memory and in one JSON file."""

    def __init__(self, state_dir: Path | str) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.lock_path = Path(state_dir) / LOCK_NAME
        self.claims: dict[str, PreparedClaim] = self._load()

    def reload(self) -> None:
        """Read the record again (another process may have written it)."""
        self.claims = self._load()

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            raw = json.loads(self.path.read_text())
            return {uid: PreparedClaim(c["namespace"], c["name"], tuple(
                PreparedDevice(tuple(d["requests"]), d["pool"], d["device"], tuple(d["cdi_ids"]))
                for d in c["devices"])) for uid, c in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # a broken file must not stop prepare; what it held can no longer be refused or cleaned up by uid
            log.error("DRA: prepared-claims state %s is unreadable (%s); starting empty", self.path, exc)
            return {}

    def owner(self, pool: str, device: str) -> str | None:
        """The UID of the claim holding this device, if any."""
        return next((uid for uid, claim in self.claims.items()
                     if any(d.pool == pool and d.device == device for d in claim.devices)), None)

    def put(self, uid: str, claim: PreparedClaim) -> None:
        """Record a prepared claim (written before returning)."""
        self.claims[uid] = claim
        self._save()

    def remove(self, uid: str) -> PreparedClaim | None:
        """Forget a claim; the removed record or None."""
        claim = self.claims.pop(uid, None)
        if claim is not None:
            self._save()
        return claim

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".dra-prepared-", suffix=".part")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump({uid: asdict(claim) for uid, claim in self.claims.items()}, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
