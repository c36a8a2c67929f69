"""The whole-node drain a DRAIN verdict asks for, once the node is cordoned: started once per fault as a task of
its own (the engine's pass never waits for evictions), stopped as soon as the verdict no longer asks for it
(draino#50), and its outcome (`complete` or `deadline`) recorded on the node, so a restarted agent does not drain
again. The evictions themselves, with their drain modes and PDBs, are `agent.remediation.drain`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agent.clock import Clock
from agent.config.remediation import RemediationConfig
from agent.kube.model import format_time
from agent.remediation import state
from agent.remediation.actions import NodeActions
from agent.remediation.drain import Drainer, DrainResult
from agent.remediation.state import Keys, Recorded

log = logging.getLogger(__name__)

OVER = ("complete", "deadline")  # the recorded outcomes of a drain that has ended


class NodeDrain:
    """Runs at most one drain of the node at a time; `wanted` says whether the current verdict still asks for it."""

    def __init__(self, config: RemediationConfig, *, actions: NodeActions, drainer: Drainer, clock: Clock,
                 keys: Keys, wanted: Callable[[], bool], wake: Callable[[], None]) -> None:
        self.config = config
        self.drainer = drainer
        self._actions = actions
        self._clock = clock
        self._keys = keys
        self._wanted = wanted
        self._wake = wake
        self._task: asyncio.Task[DrainResult] | None = None
        self._stop = asyncio.Event()
        self._said_off = False  # "drain is off" logged once per process

    def _recorded(self) -> Recorded:
        return Recorded.from_node(self._actions.node, self._keys)

    def over(self) -> bool:
        """Whether the node's drain has ended (finished, or past its deadline)."""
        return self._recorded().drain in OVER

    async def start(self) -> None:
        """Start the drain unless it is off, running, or recorded as over; the engine's pass wakes when it ends."""
        if not self.config.drain:
            if not self._said_off:
                self._said_off = True
                log.info("drain verdict, but drain is off: cordon only")
            return
        rec = self._recorded()
        if rec.drain in OVER or self._task is not None:
            return
        started = rec.drain_started or self._clock.now()
        if rec.drain_started is None:
            await self._actions.apply("annotate", lambda n: state.annotate(
                {self._keys.drain: "running", self._keys.drain_started: format_time(started)}))
        self._stop = asyncio.Event()
        deadline = started + self.config.drain_deadline_seconds
        self._task = asyncio.create_task(self.drainer.run(self._stop, deadline, self._wanted, started),
                                         name="remediation-drain")
        self._task.add_done_callback(lambda _task: self._wake())

    def stop(self) -> None:
        """Ask a running drain to stop (an admin uncordoned the node)."""
        self._stop.set()

    async def collect(self) -> None:
        """Record the outcome of a drain that has ended, while the node is still the agent's cordon."""
        task = self._task
        if task is None or not task.done():
            return
        self._task = None
        result = task.result()
        if result.outcome in OVER and self._recorded().cordoned:
            await self._actions.apply("annotate", lambda n: state.annotate({self._keys.drain: result.outcome}))

    async def close(self) -> None:
        """Stop a running drain and wait for it."""
        self.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
