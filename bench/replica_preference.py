"""Cost of one time-sliced GetPreferredAllocation policy call (`placement.replicas.preferred_replicas`, as the
joint allocator calls it), with NVIDIA's README example (10 replicas of 8 GPUs) and the largest sharing the config
allows (1024 replicas of 8 GPUs), half of the replicas taken, for 1 and 8 replicas asked, with and without the
container's NICs known (the rank by PCIe level). Prints the median and p99 of 200 calls per case, in ms.

    python bench/replica_preference.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.placement.policy import achieved_levels
from agent.placement.replicas import preferred_replicas
from agent.simulate.node import simulated_topology
from agent.topology.model import Level

CALLS = 200


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


if __name__ == "__main__":
    main()
