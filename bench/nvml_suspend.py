"""What closing the NVML session for a GPU reset costs, and what the shared-session gate costs every call.

Through the real `pynvml` wrappers over the stand-in libnvidia-ml (tests/fakes/libnvml.py), 8 GPUs:

- per call: `RealNvml.running_processes` (three process lists, gated) against the same three wrapper calls made
  directly, so the difference is the gate plus the agent's translation;
- suspension: `suspend` + `resume` + the first call after it (which initialises NVML again) while 4 threads poll
  `gpu_state` in a loop, as health's pollers would: how long a reset waits before its command can start;
- with the event watch waiting (`--event-timeout`, the agent's `nvmlEventTimeoutSeconds`, 5 s by default): the
  suspension waits for the running slice of the wait (at most 0.5 s, whatever the timeout) to return.

The stand-in's C functions are Python callbacks: the figures are the agent's own overhead, not the driver's.

    python bench/nvml_suspend.py --trials 2000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for tests.fakes

from agent.host.nvml import RealNvml
from tests.fakes.libnvml import StandInGpu, StandInLibNvml


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _say(what: str, times: list[float], unit: str = "ms") -> None:
    print(f"  {what}: p50 {statistics.median(times):.3f} {unit}, p99 {_percentile(times, 0.99):.3f} {unit}, "
          f"max {max(times):.3f} {unit} over {len(times)}")


def per_call(nvml: RealNvml, trials: int) -> None:
    handle = pynvml.nvmlDeviceGetHandleByUUID(b"GPU-0")
    calls = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
             "nvmlDeviceGetMPSComputeRunningProcesses_v3")
    direct, gated = [], []
    for _ in range(trials):
        start = time.perf_counter()
        for name in calls:
            getattr(pynvml, name)(handle)
        direct.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        nvml.running_processes("GPU-0")
        gated.append((time.perf_counter() - start) * 1e6)
    print("process lists of one GPU (3 NVML calls):")
    _say("wrappers called directly", direct, "µs")
    _say("RealNvml.running_processes (gate + translation)", gated, "µs")


def suspension(nvml: RealNvml, gpus: list[StandInGpu], trials: int) -> None:
    halt = threading.Event()

    def poll() -> None:
        while not halt.is_set():
            for gpu in gpus:
                nvml.gpu_state(gpu.uuid)

    pollers = [threading.Thread(target=poll) for _ in range(4)]
    for thread in pollers:
        thread.start()
    waits, reopen = [], []
    try:
        for _ in range(trials):
            start = time.perf_counter()
            assert nvml.suspend(30.0)
            waits.append((time.perf_counter() - start) * 1000)
            nvml.resume()
            start = time.perf_counter()
            nvml.running_processes("GPU-0")  # nvmlInit again, a fresh handle
            reopen.append((time.perf_counter() - start) * 1000)
    finally:
        halt.set()
        for thread in pollers:
            thread.join()
    print("suspension while 4 threads poll gpu_state of 8 GPUs:")
    _say("suspend (running calls finish, NVML shut down)", waits)
    _say("first call after resume (NVML initialised again)", reopen)


def with_event_wait(nvml: RealNvml, event_timeout: float, trials: int) -> None:
    events = nvml.open_events([f"GPU-{i}" for i in range(8)])
    halt = threading.Event()

    def watch() -> None:
        while not halt.is_set():
            events.wait(event_timeout)
        events.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    waits = []
    try:
        for _ in range(trials):
            time.sleep(event_timeout * 0.37)  # anywhere inside a wait
            start = time.perf_counter()
            assert nvml.suspend(event_timeout * 3)
            waits.append(time.perf_counter() - start)
            nvml.resume()
    finally:
        halt.set()
        watcher.join()
    print(f"suspension while the event watch waits ({event_timeout:g} s timeout):")
    _say("suspend", waits, "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--event-timeout", type=float, default=5.0,
                        help="the event wait's timeout (the agent's default is 5 s)")
    parser.add_argument("--event-trials", type=int, default=5)
    args = parser.parse_args()
    gpus = [StandInGpu(f"GPU-{i}", processes=[1000 + i]) for i in range(8)]
    with StandInLibNvml(gpus).install():
        nvml = RealNvml(pynvml)
        nvml.running_processes("GPU-0")
        per_call(nvml, args.trials)
        suspension(nvml, gpus, min(args.trials, 500))
        with_event_wait(nvml, args.event_timeout, args.event_trials)


if __name__ == "__main__":
    main()
