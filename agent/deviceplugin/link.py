"""The loop both ways of registering device-plugin resources share: a set of served resources and one pass.

`KubeletLink` (Register on `kubelet.sock`) and `PluginWatcherLink` (a socket in `plugins_registry/`) differ only
in what one pass does and what "registered" means; adding and removing resources, starting and stopping, and
the loop that runs a pass, retries one that failed and sleeps until woken or the next poll are this one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Generic, Protocol, TypeVar

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.deviceplugin.server import DevicePlugin


class _Server(Protocol):
    async def stop(self) -> None: ...


class _Entry(Protocol):
    @property
    def server(self) -> _Server: ...


E = TypeVar("E", bound=_Entry)


class LinkLoop(Generic[E]):
    """Keeps a changing set of resources linked to the kubelet: one pass at a time, on a wake-up or every
    `poll_interval`; a pass that fails is logged and the next one retries. `registered` is set while every
    resource is registered; `registrations` counts the kubelet's acceptances."""

    task_name = "device-plugin-link"

    def __init__(self, directory: str, *, poll_interval: float = 1.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self.directory = directory
        self.clock = clock
        self.poll_interval = poll_interval
        self.registered = asyncio.Event()
        self.registrations = 0
        self._entries: dict[str, E] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one pass at a time; remove() and stop() wait for it
        self._task: asyncio.Task[None] | None = None
        self._log = logging.getLogger(type(self).__module__)  # each link's lines keep their module's logger

    def _entry(self, servicer: DevicePlugin, endpoint: str) -> E:
        """What the link keeps for one resource (its server first); may raise SocketPathError."""
        raise NotImplementedError

    async def step(self) -> None:
        """One pass over every resource."""
        raise NotImplementedError

    def _update_ready(self) -> None:
        """Set or clear `registered` from the entries."""
        raise NotImplementedError

    def _next_wait(self) -> float:
        """Seconds until the next pass unless woken sooner."""
        return self.poll_interval

    def add(self, servicer: DevicePlugin, endpoint: str) -> None:
        """Serve and register a resource at the next pass; SocketPathError at once if the path is too long."""
        name = servicer.resource_name
        if name in self._entries:
            raise ValueError(f"{name} is already served")
        self._entries[name] = self._entry(servicer, endpoint)
        self.registered.clear()
        self._wake.set()

    async def remove(self, resource_name: str) -> None:
        """Stop serving a resource: its socket goes, and the kubelet drops its devices."""
        async with self._lock:  # not in the middle of a pass that might (re)start its server
            entry = self._entries.pop(resource_name, None)
            if entry is not None:
                await entry.server.stop()
                self._log.info("%s: stopped serving", resource_name)
            self._update_ready()

    async def start(self) -> None:
        """Start the loop (once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        """Stop the loop and every server (their sockets are removed)."""
        task, self._task = self._task, None
        if task is not None:
            await aio.cancel_and_wait(task)
        async with self._lock:
            for entry in self._entries.values():
                await entry.server.stop()
        self.registered.clear()

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before the pass: a wake-up that arrives during it runs the next one at once
            try:
                async with self._lock:
                    await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._log.exception("device-plugin %s loop failed; retrying", self.task_name)
            await self.clock.wait(self._wake, self._next_wait())
