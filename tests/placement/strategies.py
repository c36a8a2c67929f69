"""Random preferred-allocation requests on random nodes, for the property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from agent.placement.policy import AllocationRequest, DeviceKind
from agent.topology.model import Topology
from tests.fakes.nodes import gpu_ids, nic_ids
from tests.placement.conftest import nodes


def ids_of(topology: Topology, kind: DeviceKind) -> list[str]:
    return gpu_ids(topology) if kind is DeviceKind.GPU else nic_ids(topology)


@st.composite
def requests(draw: st.DrawFn, topology: Topology | None = None, kind: DeviceKind | None = None, *,
             max_available: int | None = None, max_size: int | None = None,
             context: bool | None = None) -> AllocationRequest:
    """A valid request: a random availability, must_include, size, admission context and known free set."""
    if topology is None:
        topology = draw(nodes())
    if kind is None:
        kind = draw(st.sampled_from(DeviceKind))
    other = DeviceKind.NIC if kind is DeviceKind.GPU else DeviceKind.GPU
    mine = ids_of(topology, kind)
    # Mostly large availabilities (a few devices taken), so that there is a real choice to make.
    order = draw(st.permutations(mine))
    keep = draw(st.sampled_from(range(max(1, len(mine) // 2), len(mine) + 1)))
    available = order[: min(keep, max_available or keep)]
    must = order[: draw(st.sampled_from((0, 0, 0, 1, 2)))] if len(available) > 2 else []
    size = draw(st.sampled_from(range(max(1, len(must)), min(len(available), max_size or len(available)) + 1)))
    theirs = ids_of(topology, other)
    with_context = draw(st.booleans()) if context is None else context
    ctx = draw(st.lists(st.sampled_from(theirs), min_size=1, max_size=min(4, len(theirs)), unique=True)
               ) if with_context and theirs else []
    other_free = draw(st.none() | st.lists(st.sampled_from(theirs), unique=True)) if theirs else None
    return AllocationRequest(topology=topology, kind=kind, available=frozenset(available), size=size,
                             must_include=frozenset(must), context=frozenset(ctx),
                             other_free=None if other_free is None else frozenset(other_free))
