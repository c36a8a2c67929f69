"""Where netacct learns this node's pods and their IPs: a feed that any pod source publishes into.

Two producers: `FilePodSource` (a JSON file re-read when it changes, for standalone use and tests) and
`kubepods.KubePodSource` (the Kubernetes pod watch of the shared cluster port), which calls `PodFeed.publish`.
The engine never talks to either; it takes snapshots and waits for changes. Addresses are validated and
normalised here (`ipaddress`), so nothing downstream ever formats an unchecked string into a command. Names and
namespaces are kept verbatim: they only ever become Prometheus label values.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from agent import aio
from agent.config.files import read_regular

log = logging.getLogger(__name__)

# A node's pod list: ~200 bytes a pod, so 64 MiB is far beyond any node (and bounds what one read can take)
MAX_PODS_FILE_BYTES = 64 << 20


class PodListError(ValueError):
    """A pod list that cannot be used; the message says where it is wrong."""


@dataclass(frozen=True)
class Pod:
    """One pod on this node: namespace, name, its IPs (normalised, IPv4 and/or IPv6), and optionally its UID and
    annotations (sorted pairs, so pods stay hashable; shaping reads its limits from them)."""

    namespace: str
    name: str
    ips: tuple[str, ...]
    uid: str = ""
    annotations: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        """(namespace, name)."""
        return self.namespace, self.name

    @property
    def annotation_map(self) -> dict[str, str]:
        """The annotations as a mapping."""
        return dict(self.annotations)


def make_pod(namespace: str, name: str, ips: Iterable[str], uid: str = "",
             annotations: Mapping[str, str] | None = None) -> Pod:
    """A Pod with validated, normalised, de-duplicated IPs; PodListError on a bad address."""
    out: list[str] = []
    for ip in ips:
        try:
            text = ipaddress.ip_address(str(ip).strip()).compressed
        except ValueError:
            raise PodListError(f"pod {namespace}/{name}: {ip!r} is not an IP address") from None
        if text not in out:
            out.append(text)
    pairs = tuple(sorted((str(k), str(v)) for k, v in (annotations or {}).items()))
    return Pod(str(namespace), str(name), tuple(out), str(uid), pairs)


def parse_pods(data: Any) -> list[Pod]:
    """`{"pods":[{"namespace":..,"name":..,"ips":[..],"uid":..,"annotations":{..}}]}` -> pods (uid and annotations
    optional); PodListError on anything malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("pods"), list):
        raise PodListError('expected an object with a "pods" list')
    pods: list[Pod] = []
    seen: set[tuple[str, str]] = set()
    for index, entry in enumerate(data["pods"]):
        if not isinstance(entry, dict):
            raise PodListError(f"pods[{index}]: expected an object")
        namespace, name, ips = entry.get("namespace"), entry.get("name"), entry.get("ips", [])
        if not isinstance(namespace, str) or not namespace or not isinstance(name, str) or not name:
            raise PodListError(f"pods[{index}]: namespace and name must be non-empty strings")
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise PodListError(f"pods[{index}] ({namespace}/{name}): ips must be a list of strings")
        uid, annotations = entry.get("uid", ""), entry.get("annotations", {})
        if not isinstance(uid, str):
            raise PodListError(f"pods[{index}] ({namespace}/{name}): uid must be a string")
        if not isinstance(annotations, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()):
            raise PodListError(f"pods[{index}] ({namespace}/{name}): annotations must map strings to strings")
        if (namespace, name) in seen:
            raise PodListError(f"pods[{index}]: {namespace}/{name} is listed twice")
        seen.add((namespace, name))
        pods.append(make_pod(namespace, name, ips, uid, annotations))
    return pods


class PodSource(Protocol):
    """What the netacct service needs from a pod source."""

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
