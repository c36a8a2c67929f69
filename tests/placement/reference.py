"""Brute-force reference for the allocation score.

The definitions of `score`, computed the slow and obvious way: levels from `Location.level_to`
between explicit devices, best matchings by exhaustive search, and the best score by enumerating every
subset. Nothing here uses the policy's PCIe tree or its search.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from functools import cache

from agent.placement.policy import AllocationRequest, DeviceKind
from agent.placement.score import FIELDS, Mode, Term
from agent.topology.model import Gpu, Level, Location, Nic, Topology, Vf
from tests.fakes.nodes import gpu_ids, nic_ids

LEVELS = (Level.PIX, Level.PXB, Level.P2C, Level.PHB, Level.NODE, Level.SYS)


def _device(topology: Topology, kind: DeviceKind, device_id: str) -> tuple[Location, str] | None:
    """Location and PF bus id (the GPU's UUID for GPUs) of a known device of `kind`."""
    if kind is DeviceKind.GPU:
        gpu: Gpu | None = topology.gpu_by_uuid(device_id)
        return (gpu.location, device_id) if gpu else None
    found = topology.find(device_id)
    if isinstance(found, Vf):
        return topology.location(device_id), found.pf_bus_id
    if isinstance(found, Nic):
        return found.location, found.bus_id
    return None


def _locations(topology: Topology, kind: DeviceKind, ids: Iterable[str]) -> list[Location]:
    found = (_device(topology, kind, device_id) for device_id in sorted(set(ids)))
    return [device[0] for device in found if device is not None]


def mode_of(request: AllocationRequest) -> Mode:
    other = DeviceKind.NIC if request.kind == DeviceKind.GPU else DeviceKind.GPU
    has_context = bool(_locations(request.topology, other, request.context))
    if request.kind == DeviceKind.GPU:
        return Mode.GPU_AFTER_NIC if has_context else Mode.GPU_FIRST
    return Mode.NIC_AFTER_GPU if has_context else Mode.NIC_FIRST


def best_matching(chosen: Sequence[Location], partners: Sequence[Location]) -> tuple[int, ...]:
    """Lexicographically best (n_PIX, n_PXB, n_PHB, n_NODE, n_SYS) over all one-to-one matchings."""
    distinct = sorted(set(partners), key=repr)

    @cache
    def search(index: int, left: tuple[int, ...]) -> tuple[int, ...]:
        if index == len(chosen):
            return (0,) * len(LEVELS)
        best = search(index + 1, left)  # this one unmatched
        for j, location in enumerate(distinct):
            if left[j]:
                rest = search(index + 1, (*left[:j], left[j] - 1, *left[j + 1:]))
                slot = LEVELS.index(chosen[index].level_to(location))
                best = max(best, (*rest[:slot], rest[slot] + 1, *rest[slot + 1:]))
        return best

    return search(0, tuple(partners.count(location) for location in distinct))


def _pairs_within(locations: Sequence[Location], level: Level) -> int:
    return sum(a.level_to(b) <= level for a, b in itertools.combinations(locations, 2))


def _switch_counts(locations: Iterable[Location]) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for location in locations:
        if location.switches:
            key = (location.root, location.switches)
            counts[key] = counts.get(key, 0) + 1
    return counts


def reference_score(request: AllocationRequest, chosen: Iterable[str]) -> tuple[int, ...]:
    """The score of `chosen` for `request`, field by field as `FIELDS` orders them."""
    topology, kind = request.topology, DeviceKind(request.kind)
    other = DeviceKind.NIC if kind is DeviceKind.GPU else DeviceKind.GPU
    mode = mode_of(request)
    chosen = sorted(set(chosen))
    picked = [_device(topology, kind, device_id) for device_id in chosen]
    locations = [device[0] for device in picked if device]
    remaining = _locations(topology, kind, request.available - set(chosen))
    context_ids = {i for i in request.context if _device(topology, other, i)}
    everyone = nic_ids(topology) if other is DeviceKind.NIC else gpu_ids(topology)
    other_ids = everyone if request.other_free is None else request.other_free
    other_free = _locations(topology, other, set(other_ids) - context_ids)
    partners = _locations(topology, other, context_ids) if context_ids else other_free

    matching = best_matching(locations, partners)
    left_other = _switch_counts(other_free)
    if not mode.after_context:  # this container takes its PIX partners along
        for key, count in _switch_counts(locations).items():
            left_other[key] = left_other.get(key, 0) - min(count, left_other.get(key, 0))
    left_mine = _switch_counts(remaining)

    values: list[int] = []
    for term, level in FIELDS[mode]:
        if term is Term.ALIGNMENT:
            values.append(sum(matching[: LEVELS.index(level) + 1]))
        elif term is Term.LOCALITY:
            values.append(_pairs_within(locations, level))
        elif term is Term.SPREAD:
            pfs = [device[1] for device in picked if device]
            values.append(sum(a != b for a, b in itertools.combinations(pfs, 2)))
        elif term is Term.PROXIMITY:
            values.append(sum(any(mine.level_to(p) <= level for p in partners) for mine in locations))
        elif term is Term.PIX_PAIRS_LEFT:
            values.append(sum(min(count, left_other.get(key, 0)) for key, count in left_mine.items()))
        elif term is Term.FREE_CLUSTERING:
            values.append(_pairs_within(remaining, level))
    return tuple(values)


def best_reference_score(request: AllocationRequest) -> tuple[int, ...]:
    """The best score over every valid subset: `size` devices of `available` holding all of `must_include`."""
    must = sorted(request.must_include)
    optional = sorted(request.available - request.must_include)
    return max(reference_score(request, [*must, *extra])
               for extra in itertools.combinations(optional, request.size - len(must)))
