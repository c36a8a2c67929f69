"""Preferred allocation of time-sliced replicas (`<id>::<n>`), as NVIDIA's plugin chooses them, behind the topology.

NVIDIA's `greedyAlloc` (internal/rm/allocate.go) picks one replica at a time: the GPU whose replicas are least
allocated (`distributed`, the default) or most allocated (`packed`), where allocated = the GPU's replicas served
less those still offered; a tie goes to the GPU picked least often in this call, so two replicas of one request
land on two GPUs when they can. Here one key comes first: with the container's NICs known (`rank`), the GPUs
nearest to them (PIX before PXB ...), since replicas of one GPU are one device for topology. Ties after all keys
go to the lowest ID, so equal inputs give equal answers. Pure: no I/O.

Cost: picking one replica changes only its own GPU's key, and within a GPU the lowest remaining ID always goes
first, so a heap of one entry per GPU gives the same picks as scanning every offered replica per pick:
O(served + size log offered) instead of O(size x offered) (8,000 of 8,192 replicas: ~10 ms, not 20 s).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence

DISTRIBUTED = "distributed"
PACKED = "packed"


def physical(device_id: str) -> str:
    """The GPU or MIG device ID a replica ID names (an ID without `::` names itself)."""
    return device_id.partition("::")[0]


def preferred_replicas(served: Sequence[str], offered: Sequence[str], must_include: Sequence[str], size: int, *,
                       policy: str = DISTRIBUTED, rank: Callable[[str], int] | None = None) -> list[str]:
    """`size` IDs from `offered`, `must_include` first; [] when there are not enough (NVIDIA: an error).

    `rank(physical id)`: lower is better, before the policy (the container's NIC distance); None ranks all equal.
    """
    must = list(dict.fromkeys(must_include))
    candidates = set(offered).difference(must)
    needed = size - len(must)
    if needed < 0 or len(candidates) < needed:
        return []
    by_gpu: dict[str, list[str]] = {}  # each GPU's offered replicas, a heap: the lowest ID first
    for candidate in candidates:
        by_gpu.setdefault(physical(candidate), []).append(candidate)
    allocated = _allocated(served, candidates, by_gpu)
    sign = -1 if policy == PACKED else 1
    # (rank, sign x allocated, picked in this call, its lowest offered ID, GPU): the key of the old per-replica
    # min(); the ID is unique, so the GPU never decides a tie
    heap = []
    for gpu, ids in by_gpu.items():
        heapq.heapify(ids)  # per GPU, not one sort of them all: no single step holds the interpreter for long
        heap.append((rank(gpu) if rank is not None else 0, sign * allocated[gpu], 0, heapq.heappop(ids), gpu))
    heapq.heapify(heap)
    chosen: list[str] = []
    while len(chosen) < needed:
        ranked, allocation, picked, best, gpu = heapq.heappop(heap)
        chosen.append(best)
        ids = by_gpu[gpu]
        if ids:  # one more of this GPU allocated, and picked once more in this call
            heapq.heappush(heap, (ranked, allocation + sign, picked + 1, heapq.heappop(ids), gpu))
    return must + chosen


def _allocated(served: Sequence[str], candidates: set[str], by_gpu: dict[str, list[str]]) -> Counter[str]:
    """Per GPU: its replicas served less those offered (`candidates`), as NVIDIA counts them. Served IDs are
    unique (a pool's), so that is the served IDs not offered less the offered IDs not served, which leaves the
    name of most replicas unread: of a big offer, only the few taken ones are."""
    unique = set(served)
    if len(unique) != len(served):  # not a pool's IDs: count them all
        total = Counter(gpu for gpu in map(physical, served) if gpu in by_gpu)
        return Counter({gpu: total[gpu] - len(ids) for gpu, ids in by_gpu.items()})
    allocated = Counter(map(physical, unique.difference(candidates)))
    allocated.subtract(map(physical, candidates.difference(unique)))
    return allocated
