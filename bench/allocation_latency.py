"""In-process latency of the preferred-allocation policy on random requests.

The kubelet waits on GetPreferredAllocation with no deadline while admission of every pod on the node is
blocked (kubelet-device-plugin.md section 0), so the policy must stay far below a millisecond. This draws
random requests (random free devices, sizes, both kinds, with and without the other resource's devices as
admission context, sometimes must_include and a known free set) on the dgx-h100-like node (8 GPUs, 8 PFs,
64 VFs) and the pcie-pairs-like node, times each call and prints p50/p99/max per case.

    python bench/allocation_latency.py [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the node builders live in tests/fakes

from agent.placement.policy import AllocationRequest, DeviceKind, preferred_allocation
from agent.placement.tree import build_tree
from agent.topology.model import Topology
from tests.fakes.nodes import dgx_h100_like, gpu_ids, nic_ids, pcie_pairs_like

NODES: dict[str, Callable[[], Topology]] = {"dgx-h100": dgx_h100_like, "pcie-pairs": pcie_pairs_like}


def random_request(rng: random.Random, topology: Topology, kind: DeviceKind, with_context: bool
                   ) -> AllocationRequest:
    """A request as the kubelet could send it on a partly used node."""
    mine = gpu_ids(topology) if kind is DeviceKind.GPU else nic_ids(topology)
    theirs = nic_ids(topology) if kind is DeviceKind.GPU else gpu_ids(topology)
    free_share = rng.uniform(0.3, 1.0)
    available = [device for device in mine if rng.random() < free_share] or [rng.choice(mine)]
    size = rng.randint(1, min(len(available), 8 if kind is DeviceKind.GPU else 16))
    must = rng.sample(available, rng.randint(1, min(2, size))) if rng.random() < 0.1 else []
    context = rng.sample(theirs, min(size, len(theirs))) if with_context else []
    other_free = None if rng.random() < 0.5 else [d for d in theirs if d not in context and rng.random() < 0.7]
    return AllocationRequest(topology=topology, kind=kind, available=frozenset(available), size=size,
                             must_include=frozenset(must), context=frozenset(context),
                             other_free=None if other_free is None else frozenset(other_free))


def measure(requests: list[AllocationRequest]) -> list[float]:
    """Microseconds per call."""
    timings = []
    for request in requests:
        start = time.perf_counter_ns()
        chosen = preferred_allocation(request)
        timings.append((time.perf_counter_ns() - start) / 1000)
        assert len(chosen) == request.size, "the policy broke its contract"
    return timings


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="random requests per row")
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    header = f"{'node':<11} {'kind':<4} {'context':<8} {'calls':>6} {'p50 us':>8} {'p99 us':>8} {'max us':>8}"
    print(header)
    print("-" * len(header))
    for name, build in NODES.items():
        topology = build()
        start = time.perf_counter_ns()
        build_tree(topology)
        tree_us = (time.perf_counter_ns() - start) / 1000
        everything: list[float] = []
        for kind in DeviceKind:
            for with_context in (False, True):
                requests = [random_request(rng, topology, kind, with_context) for _ in range(args.requests)]
                measure(requests[:50])  # warm up: memoized tree, allocator, caches
                timings = measure(requests)
                everything += timings
                print(f"{name:<11} {kind.value:<4} {'yes' if with_context else 'no':<8} {len(timings):>6} "
                      f"{percentile(timings, 0.5):>8.0f} {percentile(timings, 0.99):>8.0f} {max(timings):>8.0f}")
        print(f"{name:<11} {'all':<4} {'':<8} {len(everything):>6} {percentile(everything, 0.5):>8.0f} "
              f"{percentile(everything, 0.99):>8.0f} {max(everything):>8.0f}"
              f"   (tree built once per topology: {tree_us:.0f} us; mean {statistics.fmean(everything):.0f} us)")


if __name__ == "__main__":
    main()
