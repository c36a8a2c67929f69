"""Where the network subsystems learn this node's pods: a feed that any pod source publishes into.

Two producers: `FilePodSource` (a JSON file re-read when it changes, for standalone use and tests) and
`agent.pods.kube.KubePodSource` (the Kubernetes pod watch of the shared cluster port), which calls
`PodFeed.publish`. Consumers (netacct, shaping) never talk to either; they take snapshots and wait for changes.
One source per process: when netacct and shaping both run they read the same one (`agent.pods.choice` picks it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable
from typing import Protocol

from agent import aio
from agent.config.files import read_regular
from agent.pods.model import Pod, parse_pods

log = logging.getLogger(__name__)

# A node's pod list: ~200 bytes a pod, so 64 MiB is far beyond any node (and bounds what one read can take)
MAX_PODS_FILE_BYTES = 64 << 20


class PodSource(Protocol):
    """What a consumer (netacct, shaping) needs from a pod source."""

    def snapshot(self) -> tuple[int, tuple[Pod, ...] | None]:
        """(version, pods); pods is None until the source knows them."""
        ...

    async def wait_changed(self, version: int, timeout: float) -> None:
        """Return when the version differs from `version`, or after `timeout` seconds."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """Produce updates until `stop` is set (a no-op for push-fed sources)."""
        ...


class PodFeed:
    """The latest pod list; `publish` may be called from any thread (the hook for the Kubernetes pod watch)."""

    def __init__(self, pods: Iterable[Pod] | None = None) -> None:
        self._lock = threading.Lock()
        self._version = 0 if pods is None else 1
        self._pods: tuple[Pod, ...] | None = None if pods is None else tuple(pods)
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def publish(self, pods: Iterable[Pod]) -> None:
        """Replace the pod list (pods of this node, hostNetwork pods excluded) and wake waiters."""
        new = tuple(pods)
        with self._lock:
            if new == self._pods:
                return
            self._pods = new
            self._version += 1
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)

    def snapshot(self) -> tuple[int, tuple[Pod, ...] | None]:
        """(version, pods); pods is None until the first publish."""
        with self._lock:
            return self._version, self._pods

    async def wait_changed(self, version: int, timeout: float) -> None:
        """Return when the pod list changes, or after `timeout` seconds."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if self._version != version:
                return
            self._waiters.add(entry)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry[1].wait(), timeout)
        finally:
            with self._lock:
                self._waiters.discard(entry)

    async def run(self, stop: asyncio.Event) -> None:
        """Nothing to poll: producers push."""
        await stop.wait()


class FilePodSource(PodFeed):
    """Pods from a JSON file, re-read when its inode, size or mtime changes; a bad file keeps the last good list."""

    def __init__(self, path: str, poll_seconds: float = 1.0) -> None:
        super().__init__()
        self.path = path
        self.poll_seconds = poll_seconds
        self._stamp: tuple[int, int, int] | None = None

    def poll(self) -> bool:
        """Re-read the file if it changed; True when a new list was published."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._stamp != (-1, -1, -1):
                log.warning("pods file %s unreadable, keeping the last good pod list: %s", self.path, exc)
                self._stamp = (-1, -1, -1)
            return False
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            # never a blocking open (a FIFO put there froze the event loop) nor an endless read (/dev/zero)
            raw = read_regular(self.path, MAX_PODS_FILE_BYTES)
            if len(raw) > MAX_PODS_FILE_BYTES:
                raise ValueError(f"larger than {MAX_PODS_FILE_BYTES} bytes")
            pods = parse_pods(json.loads(raw.decode("utf-8")))
        except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError and PodListError are ValueErrors
            log.error("pods file %s is invalid, keeping the last good pod list: %s", self.path, exc)
            return False
        before = self.snapshot()[0]
        self.publish(pods)
        return self.snapshot()[0] != before

    async def run(self, stop: asyncio.Event) -> None:
        """Poll the file until `stop` is set."""
        while not stop.is_set():
            try:
                self.poll()
            except Exception:  # one bad read must not end the watch
                log.exception("pods file %s: unexpected error while reading", self.path)
            await aio.sleep_or_stop(stop, self.poll_seconds)

