"""The real NVML port's GPU-reset support over the real `pynvml` wrappers and a stand-in libnvidia-ml
(tests/fakes/libnvml.py: sessions, event sets and process lists as NVML documents them): who runs on a GPU, and
the session closed while a reset runs, with no call in flight, every event set freed, and everything reopened
after it."""

from __future__ import annotations

import threading
import time

import pynvml

from agent.host.nvml import NvmlEvent, RealNvml
from agent.host.nvml.gate import SessionGate
from tests.fakes.libnvml import StandInGpu, StandInLibNvml
from tests.fakes.polling import until_blocking


def test_running_processes_merge_compute_graphics_and_mps_and_older_drivers_use_the_v2_calls() -> None:
    gpus = [StandInGpu("GPU-0", processes=[4242, 17], graphics=[17], mps=[99]), StandInGpu("GPU-1")]
    with StandInLibNvml(gpus).install():
        nvml = RealNvml(pynvml)
        assert nvml.running_processes("GPU-0") == [17, 99, 4242]
        assert nvml.running_processes("GPU-1") == []
    with StandInLibNvml([StandInGpu("GPU-0", processes=[5])], old_driver=True).install():
        assert RealNvml(pynvml).running_processes("GPU-0") == [5]


def test_suspend_frees_the_event_set_and_closes_the_session_then_everything_reopens() -> None:
    library = StandInLibNvml([StandInGpu("GPU-0"), StandInGpu("GPU-1")])
    with library.install():
        nvml = RealNvml(pynvml)
        events = nvml.open_events(["GPU-0", "GPU-1"])
        seen: list[NvmlEvent] = []
        halt = threading.Event()

        def watch() -> None:  # the health watch's thread
            while not halt.is_set():
                seen.extend(events.wait(0.05))
            events.close()

        watcher = threading.Thread(target=watch)
        watcher.start()
        library.inject_xid("GPU-1", 31)
        until_blocking(lambda: len(seen) == 1, "the first Xid")
        assert nvml.suspend(5.0)
        assert library.holders() == []  # what nvidia-smi --gpu-reset needs: nothing holds the GPUs
        answered: list[list[int]] = []
        poll = threading.Thread(target=lambda: answered.append(nvml.running_processes("GPU-0")))
        poll.start()
        time.sleep(0.2)
        assert answered == [] and library.holders() == []  # a poll during the reset waits, it does not fail
        nvml.resume()
        poll.join(5)
        assert answered == [[]]
        until_blocking(lambda: len(library.holders()) == 2, "the session and the event set reopened")
        # the set exists before it registers the GPUs: an Xid in between would reach no set (a race under load)
        until_blocking(lambda: any(epoch == library.epoch and len(registered) == 2
                                   for epoch, registered in library.event_sets.values()), "both GPUs registered again")
        library.inject_xid("GPU-0", 79)
        until_blocking(lambda: len(seen) == 2, "the Xid after the reset")
        halt.set()
        watcher.join(5)
    assert seen == [NvmlEvent("xid", "GPU-1", 31), NvmlEvent("xid", "GPU-0", 79)]
    assert library.event_sets == {}  # closed for good: nothing left behind


def test_suspend_gives_up_when_a_call_does_not_finish_and_leaves_the_session_open() -> None:
    library = StandInLibNvml([StandInGpu("GPU-0")])
    release = threading.Event()
    with library.install():
        nvml = RealNvml(pynvml)
        assert nvml.running_processes("GPU-0") == []
        entered = threading.Event()

        def stuck_in_driver() -> None:  # a call stuck in the driver (a GPU falling off the bus)
            entered.set()
            release.wait(5)

        library.in_call = stuck_in_driver
        stuck = threading.Thread(target=lambda: nvml.running_processes("GPU-0"))
        stuck.start()
        assert entered.wait(5)
        assert not nvml.suspend(0.2)
        assert library.sessions == 1
        release.set()
        stuck.join(5)
        library.in_call = lambda: None
        assert nvml.running_processes("GPU-0") == []  # calls go on in the same session


def test_gate_lets_a_waiting_suspension_in_before_new_calls() -> None:
    gate = SessionGate()
    order: list[str] = []
    entered, finish = threading.Event(), threading.Event()
    suspended: list[bool] = []

    def long_call() -> None:
        with gate.call():
            entered.set()
            finish.wait(5)
            order.append("first call")

    def late_call() -> None:
        with gate.call():
            order.append("late call")

    first = threading.Thread(target=long_call)
    first.start()
    entered.wait(5)
    suspender = threading.Thread(target=lambda: suspended.append(gate.suspend(5.0, lambda: order.append("shutdown"))))
    suspender.start()
    until_blocking(lambda: gate.suspending, "the suspension waiting for the running call")
    late = threading.Thread(target=late_call)
    late.start()
    time.sleep(0.05)  # room for a wrong gate to let the late call in ahead of the suspension
    finish.set()
    suspender.join(5)
    assert suspended == [True] and order == ["first call", "shutdown"] and gate.suspended
    gate.resume()
    for thread in (first, late):
        thread.join(5)
    assert order == ["first call", "shutdown", "late call"] and gate.generation == 1


def test_a_long_event_wait_is_interrupted_within_a_slice_and_lets_a_reset_in_without_losing_events() -> None:
    """The C wait cannot be woken: the port waits in slices of at most 0.5 s, so a stop (`interrupt`) and a GPU
    reset's suspension each wait for one slice, not for the caller's whole timeout (5 s by default), and an Xid
    arriving mid-timeout is delivered at once."""
    library = StandInLibNvml([StandInGpu("GPU-0")])
    with library.install():
        nvml = RealNvml(pynvml)
        events = nvml.open_events(["GPU-0"])
        waits: list[tuple[float, list[NvmlEvent]]] = []

        def wait() -> None:
            started = time.monotonic()
            found = events.wait(5.0)
            waits.append((time.monotonic() - started, found))

        first = threading.Thread(target=wait)
        first.start()
        time.sleep(0.8)  # past the first slice
        library.inject_xid("GPU-0", 79)
        first.join(5)
        assert [e.xid for e in waits[0][1]] == [79] and waits[0][0] < 1.0
        second = threading.Thread(target=wait)
        second.start()
        time.sleep(0.1)
        started = time.monotonic()
        assert nvml.suspend(5.0)
        assert time.monotonic() - started < 0.7  # one slice, not the rest of 5 s
        nvml.resume()
        time.sleep(0.1)
        events.interrupt()
        second.join(5)
        assert waits[1][1] == [] and waits[1][0] < 1.5, waits
        started = time.monotonic()
        assert events.wait(5.0) == [] and time.monotonic() - started < 0.1  # later waits return at once
        events.close()
