"""Distance levels: the switch chain NCCL derives from a sysfs path, and the properties of Location.level_to."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.topology.model import Level, Location, normalize_bus_id
from agent.topology.sysfs import switch_chain

ROOT = "pci0000:15"


@pytest.mark.parametrize(
    ("elements", "expected"),
    [
        # root complex / root port / USP / DSP / endpoint: the switch is named by its upstream port
        ([ROOT, "0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:18:00.0"], ("0000:16:00.0",)),
        # two levels of switches: top USP, then the lower USP
        ([ROOT, "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"],
         ("0000:16:00.0", "0000:18:00.0")),
        # a device on a root port has no switch above it
        ([ROOT, "0000:15:01.0", "0000:16:00.0"], ()),
        # a device on the root bus itself
        ([ROOT, "0000:15:00.0"], ()),
    ],
)
def test_switch_chain_climbs_two_elements_at_a_time(elements, expected):
    assert switch_chain(elements) == expected


def test_levels_follow_the_nvidia_smi_definitions():
    pix_a = Location(ROOT, ("top", "low1"), 0)
    pix_b = Location(ROOT, ("top", "low1"), 0)
    pxb = Location(ROOT, ("top", "low2"), 0)
    phb = Location(ROOT, ("other",), 0)
    node = Location("pci0000:40", ("x",), 0)
    sys_ = Location("pci0000:90", ("x",), 1)
    assert pix_a.level_to(pix_b) is Level.PIX
    assert pix_a.level_to(pxb) is Level.PXB
    assert pix_a.level_to(phb) is Level.PHB
    assert pix_a.level_to(node) is Level.NODE
    assert pix_a.level_to(sys_) is Level.SYS
    # two devices hanging off the root complex without a switch meet at the host bridge
    assert Location(ROOT, (), 0).level_to(Location(ROOT, (), 0)) is Level.PHB


def test_unknown_numa_never_claims_a_socket_crossing():
    assert Location("pci0000:01", (), None).level_to(Location("pci0000:02", (), 1)) is Level.NODE


@pytest.mark.parametrize(("raw", "canonical"), [
    ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML form
    ("0000:3b:00.0", "0000:3b:00.0"),
    ("0001:00:00.0", "0001:00:00.0"),
])
def test_bus_ids_normalise_to_the_sysfs_form(raw, canonical):
    assert normalize_bus_id(raw) == canonical


# Random trees: sockets hold root complexes, which hold switch chains (each chain element names a switch).
_locations = st.builds(
    lambda socket, root, chain: Location(f"pci{socket}{root}", tuple(f"s{socket}{root}{c}" for c in chain),
                                         socket),
    st.integers(0, 1), st.integers(0, 2),
    # each switch is named by its whole path from the root, so the random chains always form one tree
    st.lists(st.integers(0, 2), max_size=3).map(lambda xs: ["".join(map(str, xs[: i + 1]))
                                                            for i in range(len(xs))]),
)


@given(_locations, _locations)
def test_level_is_symmetric(a, b):
    assert a.level_to(b) == b.level_to(a)


@given(_locations, _locations, _locations)
def test_levels_nest_like_a_tree(a, b, c):
    # Going through an intermediate device can never be "closer" than the direct path allows: the direct
    # level is at most the worse of the two legs (an ultrametric, as for any tree with known NUMA nodes).
    assert a.level_to(c) <= max(a.level_to(b), b.level_to(c))


@given(_locations)
def test_a_location_is_never_farther_from_itself_than_its_host_bridge(a):
    assert a.level_to(a) in (Level.PIX, Level.PHB)
