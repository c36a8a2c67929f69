"""Cost of one time-sliced GetPreferredAllocation policy call (`placement.replicas.preferred_replicas`, as the
joint allocator calls it), with NVIDIA's README example (10 replicas of 8 GPUs) and the largest sharing the config
allows (1024 replicas of 8 GPUs), half of the replicas taken, for 1 and 8 replicas asked, with and without the
container's NICs known (the rank by PCIe level). Prints the median and p99 of 200 calls per case, in ms.
Then the big requests of issue 37 (every replica offered, no NIC known): 1000 / 4000 / 8000 of 8192 replicas on
dgx-h100 and 25,088 of 28,672 on dgx-h100-mig (1024 replicas of each 1g.10gb device), 20 calls each (they took
2.8 / 10.4 / 19.7 s and over 60 s per call before the heap). Last, building those two pools as a start or a
changed rescan does (`build_pools` and the pool's lookups, then the ListAndWatch list), 10 times each: work the
device-plugin manager does in a worker thread, off the event loop (the loop's share is asserted by
tests/deviceplugin/test_replica_pools.py: <= 20 ms CPU a turn).

    python bench/replica_preference.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.load import load
from agent.deviceplugin.pools import build_pools
from agent.deviceplugin.server import DevicePlugin
from agent.placement.policy import achieved_levels
from agent.placement.replicas import preferred_replicas
from agent.simulate.node import simulated_topology
from agent.topology.model import Level, Topology

CALLS = 200
BIG_CALLS = 20


def main() -> None:
    topology = simulated_topology("dgx-h100", Path(tempfile.mkdtemp(prefix="gnabench")))
    nic = sorted(vf.bus_id for n in topology.rdma_nics for vf in n.vfs)[0]
    print(f"{'replicas x GPUs':>16} {'asked':>6} {'NIC known':>10} {'median ms':>10} {'p99 ms':>8}")
    for replicas in (10, 1024):
        served = [f"{g.uuid}::{n}" for g in topology.gpus for n in range(replicas)]
        offered = served[::2]
        for size in (1, 8):
            for known in (False, True):
                rank = (lambda gpu: int(min(achieved_levels(topology, [gpu], [nic]), default=Level.SYS + 1))) \
                    if known else None
                times = []
                for _ in range(CALLS):
                    start = time.perf_counter()
                    got = preferred_replicas(served, offered, (), size, rank=rank)
                    times.append((time.perf_counter() - start) * 1000)
                assert len(got) == size
                times.sort()
                print(f"{replicas:>9} x {len(topology.gpus):<4} {size:>6} {known!s:>10} "
                      f"{statistics.median(times):>10.3f} {times[int(CALLS * 0.99) - 1]:>8.3f}")
    mig = simulated_topology("dgx-h100-mig", Path(tempfile.mkdtemp(prefix="gnabench")))
    big = [([f"{g.uuid}::{n}" for g in topology.gpus for n in range(1024)], (1000, 4000, 8000)),
           ([f"{m.uuid}::{n}" for g in mig.gpus for m in g.mig_devices for n in range(1024)], (25_088,))]
    print(f"{'offered':>16} {'asked':>6} {'median ms':>10} {'max ms':>8}")
    for served, sizes in big:
        for size in sizes:
            times = []
            for _ in range(BIG_CALLS):
                start = time.perf_counter()
                got = preferred_replicas(served, served, (), size)
                times.append((time.perf_counter() - start) * 1000)
            assert len(got) == size
            print(f"{len(served):>16} {size:>6} {statistics.median(times):>10.3f} {max(times):>8.3f}")
    pools(topology, mig)


def pools(dgx: Topology, mig: Topology) -> None:
    """Median ms to build, index and list the biggest replica pools (in a worker thread in the agent)."""
    directory = Path(tempfile.mkdtemp(prefix="gnabench"))
    print(f"{'pool':>24} {'replicas':>8} {'build+index ms':>15} {'list ms':>8}")
    for node, text, resource in (
            (dgx, "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1024\n",
             "nvidia.com/gpu"),
            (mig, "flags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                  "    - name: mig-1g.10gb\n      replicas: 1024\n", "nvidia.com/mig-1g.10gb")):
        path = directory / "nvidia-dp.yaml"
        path.write_text("version: v1\n" + text)
        config = replace(load(None, {"GPU_NODE_AGENT_NVIDIA_DP_CONFIG": str(path)}).device_plugin, serve_gpus=True)
        built, listed = [], []
        for _ in range(10):
            start = time.perf_counter()
            pool = build_pools(node, config).by_name()[resource].indexed()
            built.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            DevicePlugin(pool).device_list()
            listed.append((time.perf_counter() - start) * 1000)
        print(f"{resource:>24} {len(pool.devices):>8} {statistics.median(built):>15.1f} "
              f"{statistics.median(listed):>8.1f}")


if __name__ == "__main__":
    main()
