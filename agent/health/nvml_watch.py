"""The NVML producers: an event watch (Xid, single/double-bit ECC) and a poll (ECC counts, retired pages,
remapped rows).

`nvmlEventSetWait` blocks, so the event watch runs in its own thread with a bounded wait (the config's event
timeout) and hands each event to the event loop with `loop.call_soon_threadsafe`. A stop interrupts the wait (the
simulated port wakes at once, the real one within one 0.5 s slice of the C wait), so stopping does not wait for the
timeout. The event set is created, waited on and freed by that one thread; only a GPU reset frees it from
elsewhere, with no wait running (`agent.host.nvml.gate`), and the next wait opens it again. The thread is a daemon
and the stop waits for it only `_STOP_GRACE_S`: a C call that hangs (a GPU falling off the bus can do that) cannot
hold the process at exit, and nothing calls nvmlShutdown at exit, so no wait is ever left on a closed session.
Polls run one NVML call batch per GPU in a worker thread, since a lost GPU can make NVML calls slow.
Without NVML both report "unavailable" and return; the other producers are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from agent import aio
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.host.nvml import GpuLostError, NvmlError, NvmlEvent, NvmlEventSet, NvmlHealth, NvmlUnavailableError

log = logging.getLogger(__name__)

_STOP_GRACE_S = 2.0  # how long a stop waits for the event thread (an interrupted wait returns within 0.5 s)


class NvmlEventWatcher:
    """Waits on an NVML event set in a thread; re-registers when the topology's GPU set changes."""

    def __init__(self, nvml: NvmlHealth, assessor: HealthAssessor, timeout_s: float, *,
                 checks: Checks | None = None) -> None:
        self.nvml = nvml
        self.assessor = assessor
        self.checks = checks if checks is not None else Checks()
        self.timeout_s = timeout_s
        self.first_pass = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until `stop`; returns at once (check "unavailable") without NVML."""
        if not await asyncio.to_thread(lambda: self.nvml.available):
            self.checks.set("nvml_events", CheckState.UNAVAILABLE, self.nvml.unavailable_reason)
            self.first_pass.set()
            return
        loop = asyncio.get_running_loop()
        halt = threading.Event()
        deliver = self._deliverer(loop)
        waiting: list[NvmlEventSet] = []  # the set the thread waits on, for the stop to interrupt
        worker: asyncio.Future[None] = loop.create_future()
        threading.Thread(target=self._thread, args=(halt, deliver, waiting, worker, loop), name="nvml-events",
                         daemon=True).start()
        try:
            await aio.wait_any(stop, asyncio.shield(worker))  # stop must not cancel the thread's future
        finally:
            halt.set()
            for events in list(waiting):
                events.interrupt()
            await aio.wait_any(asyncio.shield(worker), timeout=_STOP_GRACE_S)
            if worker.done():
                worker.result()  # an NvmlError ends the producer; the supervisor restarts it
            else:
                worker.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody reads it now
                log.warning("NVML event wait still running %.0f s after the stop; not waiting for it", _STOP_GRACE_S)

    def _thread(self, halt: threading.Event, deliver: Callable[[Callable[[], None]], None],
                waiting: list[NvmlEventSet], worker: asyncio.Future[None], loop: asyncio.AbstractEventLoop) -> None:
        """The thread's body: `_watch`, its outcome handed to `worker` on the loop."""
        def settle(outcome: BaseException | None) -> None:
            if worker.done():
                return
            if outcome is None:
                worker.set_result(None)
            else:
                worker.set_exception(outcome)
        try:
            self._watch(halt, deliver, waiting)
        except BaseException as exc:  # handed to the awaiting coroutine, like run_in_executor does
            outcome: BaseException | None = exc
        else:
            outcome = None
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting
            loop.call_soon_threadsafe(settle, outcome)

    def _deliverer(self, loop: asyncio.AbstractEventLoop) -> Callable[[Callable[[], None]], None]:
        def deliver(call: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closing: nothing left to tell
                loop.call_soon_threadsafe(call)
        return deliver

    def _opened(self) -> None:
        self.checks.set("nvml_events", CheckState.OK)
        self.first_pass.set()

    def _watch(self, halt: threading.Event, deliver: Callable[[Callable[[], None]], None],
               waiting: list[NvmlEventSet]) -> None:
        """The blocking loop (worker thread): open, wait, hand over, re-open when the GPU set changes."""
        while not halt.is_set():
            uuids = self.assessor.names.uuids()
            events = self.nvml.open_events(uuids)  # NvmlError ends the producer; the supervisor restarts it
            waiting[:] = [events]  # published before `halt` is read again: a stop sees it or the loop sees `halt`
            deliver(self._opened)
            failing = False
            try:
                while not halt.is_set() and self.assessor.names.uuids() == uuids:
                    try:
                        found = events.wait(self.timeout_s)
                    except NvmlError as exc:
                        if not failing:
                            log.warning("NVML event wait failed (%s); retrying every %.0f s", exc, self.timeout_s)
                        failing = True
                        halt.wait(self.timeout_s)
                        continue
                    failing = False
                    for event in found:
                        deliver(_bind(self.assessor.on_nvml_event, event))
            finally:
                waiting.clear()
                events.close()


def _bind(handler: Callable[[NvmlEvent], None], event: NvmlEvent) -> Callable[[], None]:
    return lambda: handler(event)


class NvmlPoller:
    """Polls each GPU's memory health every `interval` seconds."""

    def __init__(self, nvml: NvmlHealth, assessor: HealthAssessor, interval: float, *,
                 checks: Checks | None = None) -> None:
        self.nvml = nvml
        self.assessor = assessor
        self.checks = checks if checks is not None else Checks()
        self.interval = interval
        self.first_pass = asyncio.Event()
        self.polls = 0
        self._failing: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop`. Without NVML the check is "unavailable" and the poller keeps looking every interval
        (the port retries nvmlInit itself): a driver loaded later, or NVML opened again after a GPU reset, is
        picked up without a restart."""
        while not stop.is_set():
            try:
                if not await asyncio.to_thread(lambda: self.nvml.available):
                    raise NvmlUnavailableError(self.nvml.unavailable_reason or "NVML unavailable")
                await self.poll_once()
            except NvmlUnavailableError as exc:
                self.checks.set("nvml_poll", CheckState.UNAVAILABLE, str(exc))
            else:
                self.checks.set("nvml_poll", CheckState.OK)
            self.first_pass.set()
            await aio.sleep_or_stop(stop, self.interval)

    async def poll_once(self) -> None:
        """One pass over every GPU of the topology."""
        for uuid in self.assessor.names.uuids():
            try:
                health = await asyncio.to_thread(self.nvml.memory_health, uuid)
            except GpuLostError as exc:
                self.assessor.on_gpu_lost(self.assessor.names.by_uuid(uuid), f"NVML: {exc}", from_nvml=True)
                continue
            except NvmlUnavailableError:
                raise
            except NvmlError as exc:
                if uuid not in self._failing:
                    log.warning("NVML poll of %s failed (%s); will retry", uuid, exc)
                self._failing.add(uuid)
                continue
            self._failing.discard(uuid)
            self.assessor.on_memory(health)
        self.polls += 1
