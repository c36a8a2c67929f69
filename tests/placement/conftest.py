"""Topology builders for the allocation tests: the two reference nodes and random nodes of up to 8 GPUs.

The builders themselves live in `tests/fakes/nodes.py` (the benchmark uses them too); this adds the hypothesis
strategies that draw random PCIe trees: sockets, root complexes, top and lower switches, and GPUs and RDMA
NIC PFs (1-8 VFs, or none: the PF is then the device) placed on them.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from agent.topology.model import Topology
from tests.fakes.nodes import Slot, build_node, dgx_h100_like, pcie_pairs_like


@pytest.fixture(scope="session")
def dgx() -> Topology:
    return dgx_h100_like()


@pytest.fixture(scope="session")
def pairs() -> Topology:
    return pcie_pairs_like()


@st.composite
def slots(draw: st.DrawFn) -> list[Slot]:
    """The places of one random PCIe tree where devices can sit."""
    places: list[Slot] = []
    for socket in range(draw(st.integers(1, 2))):
        for root in range(draw(st.integers(1, 2))):
            places.append(Slot(socket, root))
            for top in range(draw(st.integers(0, 2))):
                places.append(Slot(socket, root, top))
                places.extend(Slot(socket, root, top, low) for low in range(draw(st.integers(0, 2))))
    return places


@st.composite
def nodes(draw: st.DrawFn, max_gpus: int = 8, max_pfs: int = 4, max_vfs: int = 8,
          max_units: int | None = None) -> Topology:
    """A random node: up to `max_gpus` GPUs and `max_pfs` NIC PFs on a random tree.

    `max_units` caps the NIC devices in all (VFs, or VF-less PFs) for brute-force tests.
    """
    places = draw(slots())
    # sampled_from draws counts uniformly; st.integers would favour the degenerate small ones.
    gpu_count = draw(st.sampled_from(range(1, max_gpus + 1)))
    pf_count = draw(st.sampled_from(range(1, max_pfs + 1)))
    gpus = draw(st.lists(st.sampled_from(places), min_size=gpu_count, max_size=gpu_count))
    pfs = draw(st.lists(st.tuples(st.sampled_from(places), st.integers(0, max_vfs)),
                        min_size=pf_count, max_size=pf_count))
    if max_units is not None:
        budget, capped = max_units, []
        for slot, vfs in pfs:
            units = min(max(vfs, 1), budget)
            if units <= 0:
                break
            capped.append((slot, vfs and units))
            budget -= units
        pfs = capped
    c2c = frozenset(draw(st.sets(st.integers(0, 1))))  # Grace/Vera sockets: P2C groups in the tree
    return build_node(gpus, pfs, numa_known=draw(st.booleans()), c2c_sockets=c2c)
