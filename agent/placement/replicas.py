"""Preferred allocation of time-sliced replicas (`<id>::<n>`), as NVIDIA's plugin chooses them, behind the topology.

NVIDIA's `greedyAlloc` (internal/rm/allocate.go) picks one replica at a time: the GPU whose replicas are least
allocated (`distributed`, the default) or most allocated (`packed`), where allocated = the GPU's replicas served
less those still offered; a tie goes to the GPU picked least often in this call, so two replicas of one request
land on two GPUs when they can. Here one key comes first: with the container's NICs known (`rank`), the GPUs
nearest to them (PIX before PXB ...), since replicas of one GPU are one device for topology. Ties after all keys
go to the lowest ID, so equal inputs give equal answers. Pure: no I/O, O(size x offered).
"""

from __future__ import annotations

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
    candidates = sorted(set(offered) - set(must))
    needed = size - len(must)
    if needed < 0 or len(candidates) < needed:
        return []
    available = Counter(physical(c) for c in candidates)
    total = Counter(physical(s) for s in served if physical(s) in available)
    picked: Counter[str] = Counter()
    sign = -1 if policy == PACKED else 1
    ranks = {gpu: rank(gpu) for gpu in available} if rank is not None else {}

    def key(candidate: str) -> tuple[int, int, int, str]:
        gpu = physical(candidate)
        return ranks.get(gpu, 0), sign * (total[gpu] - available[gpu]), picked[gpu], candidate

    chosen: list[str] = []
    for _ in range(needed):
        best = min(candidates, key=key)
        gpu = physical(best)
        picked[gpu] += 1
        available[gpu] -= 1
        chosen.append(best)
        candidates.remove(best)
    return must + chosen
