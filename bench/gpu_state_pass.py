"""One NVLink / fabric / recovery-action pass over 8 GPUs: what the agent spends per `--gpu-state-interval`.

`RealNvml.gpu_state` for 8 H100-like GPUs (18 NVLinks each; 36 link-state fields in one read, or on an older
driver 36 nvmlDeviceGetNvLinkState calls; the fabric v3 struct; the recovery-action field) plus
`GpuStateJudge.judge`, through the real `pynvml` wrappers over a stand-in libnvidia-ml (tests/fakes/libnvml.py:
ctypes callbacks in Python). So the figure is the agent's own cost (wrappers, ctypes, translation, judging) plus
Python stand-ins for the C calls, not the driver's time: on a node each call enters the kernel driver instead.

    python bench/gpu_state_pass.py --trials 2000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for tests.fakes

from agent.config.health import CHECK_ACTIONS
from agent.health.findings import GpuRef
from agent.health.gpu_state import GpuStateJudge
from agent.host.nvml import RealNvml
from agent.signals import Severity
from tests.fakes.libnvml import StandInGpu, StandInLibNvml


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(trials: int, link_state_field: bool) -> None:
    gpus = [StandInGpu(f"GPU-{i}", link_state_field=link_state_field) for i in range(8)]
    gpus[3].links[5] = False  # one finding to judge
    refs = [GpuRef(str(i), g.uuid, f"0000:{0x1b + i:02x}:00.0") for i, g in enumerate(gpus)]
    judge = GpuStateJudge({k: Severity.parse(v) for k, v in CHECK_ACTIONS.items()}, 600.0)
    library = StandInLibNvml(gpus)
    with library.install():
        nvml = RealNvml(pynvml)
        for gpu in gpus:  # init and handle lookups happen once
            nvml.gpu_state(gpu.uuid)
        library.calls = 0
        times: list[float] = []
        for trial in range(trials):
            start = time.perf_counter()
            states = [(ref, nvml.gpu_state(ref.uuid)) for ref in refs]
            findings = judge.judge(states, float(trial))
            times.append((time.perf_counter() - start) * 1000)
        calls = library.calls / trials
    assert len(findings) == 1
    how = "link-state field (one read for 36 links)" if link_state_field else \
        "older driver: nvmlDeviceGetNvLinkState per link (36)"
    print(f"{len(gpus)} GPUs, {how}, fabric, recovery-action field: {calls:.0f} NVML C calls per pass")
    print(f"  pass read + judge: p50 {statistics.median(times):.2f} ms, p99 {_percentile(times, 0.99):.2f} ms, "
          f"max {max(times):.2f} ms over {trials} trials")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    trials = parser.parse_args().trials
    run(trials, link_state_field=True)
    run(trials, link_state_field=False)


if __name__ == "__main__":
    main()
