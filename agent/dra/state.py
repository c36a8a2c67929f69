"""What this node has prepared, persisted so unprepare works in a new process when the claim is gone.

The kubelet retries both calls and may send `NodeUnprepareResources` after an agent restart with nothing but
namespace, UID and name, often after the claim was deleted with its pod. So each prepared claim is written to
`<state dir>/dra-prepared.json` (one JSON object keyed by claim UID, replaced atomically) before the answer
goes back; it also lets prepare refuse a device already prepared for another claim.

During a rolling update two agent processes serve the same node for a while, so every call holds
`serialize.lock` (an exclusive `flock`, as the Go helper's rolling-update mode does) and reads the record again
under it before acting.

The record fails closed: a file that cannot be read (not JSON, nested past any record, larger than
`MAX_STATE_BYTES`, a field of the wrong type) means "devices in unknown use", not "nothing prepared". `problem`
says why; while it is set, prepare refuses every claim (a device held by a claim in the lost record must not be
handed to another), unprepare removes CDI specs but leaves the file as it is, and
`gpu_node_agent_dra_state_unreadable` is 1. An operator who has checked the node removes or repairs the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import operator
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "dra-prepared.json"
LOCK_NAME = "serialize.lock"
LOCK_POLL_SECONDS = 0.02
MAX_STATE_BYTES = 16 << 20  # about 40,000 prepared claims; far past what one node holds


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


class StateUnreadable(ValueError):
    """The record cannot be read; the message says why."""


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise StateUnreadable(f"{what} is not a string")
    return value


def _texts(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise StateUnreadable(f"{what} is not a list")
    return tuple(_text(item, what) for item in value)


def _mapping(value: object, what: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise StateUnreadable(f"{what} is not an object")
    return value


def _device(data: object) -> PreparedDevice:
    d = _mapping(data, "a device")
    return PreparedDevice(_texts(d.get("requests"), "requests"), _text(d.get("pool"), "pool"),
                          _text(d.get("device"), "device"), _texts(d.get("cdi_ids"), "cdi_ids"))


def _claim(data: object) -> PreparedClaim:
    c = _mapping(data, "a claim")
    namespace, name, devices = _text(c.get("namespace"), "namespace"), _text(c.get("name"), "name"), c.get("devices")
    if not isinstance(devices, list):
        raise StateUnreadable("devices is not a list")
    return PreparedClaim(namespace, name, tuple(_device(d) for d in devices))


class PreparedStore:
    """The prepared claims, in memory and in one JSON file."""

    def __init__(self, state_dir: Path | str) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.lock_path = Path(state_dir) / LOCK_NAME
        self.problem: str | None = None  # why the record cannot be read: devices in unknown use (fail closed)
        self.claims: dict[str, PreparedClaim] = {}
        self.reload()

    def reload(self) -> None:
        """Read the record again (another process may have written it)."""
        try:
            self.claims, problem = self._load(), None
        except StateUnreadable as exc:
            self.claims, problem = {}, str(exc)
        if problem != self.problem and problem is not None:
            log.error("DRA: prepared-claims state %s is unreadable (%s): devices in unknown use, every prepare "
                      "is refused until the file is repaired or removed", self.path, problem)
        elif problem != self.problem:
            log.info("DRA: prepared-claims state %s is readable again", self.path)
        self.problem = problem

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StateUnreadable(f"cannot read: {exc.strerror or exc}") from None
        if len(raw) > MAX_STATE_BYTES:
            raise StateUnreadable(f"larger than {MAX_STATE_BYTES} bytes")
        try:
            data = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise StateUnreadable("nested more deeply than any record") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise StateUnreadable(f"not JSON: {str(exc)[:120]}") from None
        return {_text(uid, "a claim uid"): _claim(claim) for uid, claim in _mapping(data, "the record").items()}

    def owner(self, pool: str, device: str, same: Callable[[str, str], bool] = operator.eq) -> str | None:
        """The UID of a claim holding this device (or, with `same`, a device that `same` says overlaps it)."""
        return next((uid for uid, claim in self.claims.items()
                     if any(d.pool == pool and same(d.device, device) for d in claim.devices)), None)

    def put(self, uid: str, claim: PreparedClaim) -> None:
        """Record a prepared claim (written before returning); StateUnreadable while the record is."""
        if self.problem is not None:
            raise StateUnreadable(f"prepared-claims state {self.path} is unreadable ({self.problem})")
        self.claims[uid] = claim
        self._save()

    def remove(self, uid: str) -> PreparedClaim | None:
        """Forget a claim; the removed record or None."""
        claim = self.claims.pop(uid, None)
        if claim is not None and self.problem is None:  # an unreadable record is left as it is
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
