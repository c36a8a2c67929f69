"""The joint allocator's estimate of the other kind's free devices, on plain pools (no servers, no topology).

Moved here from the admission context, whose copy of this estimate was never read in production: the
assertions now hold for the estimate the allocator actually hands the policy (`other_free`).
"""

from __future__ import annotations

import dataclasses

from agent.placement.joint import JointAllocator
from agent.placement.policy import ContainerRequest, DeviceKind, Partner, Reason
from tests.placement.admission_sim import Pool

GPU, NIC = DeviceKind.GPU, DeviceKind.NIC
GPUS = Pool("test/gpu", "gpu", ("g0", "g1", "g2", "g3"), None)
VFS = Pool("test/vf", "nic", ("v0", "v1"), None)


class Server:
    def __init__(self, pool: Pool, unhealthy: frozenset[str] = frozenset()) -> None:
        self.pool = pool
        self.unhealthy = unhealthy

    def healthy_ids(self) -> frozenset[str]:
        return frozenset(self.pool.ids) - self.unhealthy


def test_believed_free_follows_offers_and_allocations() -> None:
    allocator = JointAllocator(lambda: [Server(GPUS)])
    assert allocator.other_free(NIC) == set(GPUS.ids)  # nothing seen taken yet
    preference = allocator.prefer(GPUS, ContainerRequest(served=GPUS.ids, available=("g0", "g1", "g2"),
                                                         must_include=("g2",), size=2))
    assert preference.reason is Reason.OK and set(preference.devices) == {"g0", "g2"}
    assert allocator.other_free(NIC) == {"g0", "g1"}  # g3 left out of the offer, g2 must be included
    assert allocator.allocated(GPUS, ["g0", "g2"], preference.decision) == [("test/gpu", "none")]  # alone
    assert allocator.other_free(NIC) == {"g1"}
    assert allocator.other_free(GPU) is None  # no NIC pool served here: unknown


def test_unhealthy_devices_are_never_believed_free_and_known_facts_win() -> None:
    servers = [Server(GPUS, unhealthy=frozenset({"g1"})), Server(VFS)]
    assert JointAllocator(lambda: servers).other_free(NIC) == {"g0", "g2", "g3"}
    known = JointAllocator(lambda: servers)
    assert known.other_free(NIC, Partner(free=frozenset({"g3"}))) == {"g3"}
    assert known.other_free(GPU, Partner()) == set(VFS.ids)  # no fact about NICs: the estimate


def test_invalid_request_leaves_the_allocator_untouched() -> None:
    allocator = JointAllocator(lambda: [Server(GPUS), Server(VFS)])
    allocator.allocated(GPUS, ["g0"])
    bad = allocator.prefer(VFS, ContainerRequest(served=VFS.ids, available=("v0", "nope"), size=1))
    assert bad.reason is Reason.INVALID_REQUEST and bad.devices == ()
    assert allocator.admission.begin_preference(NIC) == {"g0"}  # the GPU's record is still there


def test_the_pair_an_allocate_counts_is_the_one_its_preference_decided() -> None:
    """Issue 38 item 3: the container a NIC Allocate completes travels in its preference's decision
    (`Decision.pairs_with`); the allocator's record of the last Allocate is only where that container lives."""
    allocator = JointAllocator(lambda: [Server(GPUS), Server(VFS)])
    gpu = allocator.prefer(GPUS, ContainerRequest(served=GPUS.ids, available=GPUS.ids, size=1))
    assert gpu.decision is not None and gpu.decision.pairs_with is None  # nothing allocated before it
    assert allocator.allocated(GPUS, ["g0"], gpu.decision) == []  # its NIC may still come
    nic = allocator.prefer(VFS, ContainerRequest(served=VFS.ids, available=VFS.ids, size=1))
    assert nic.decision is not None and nic.decision.pairs_with == ("test/gpu", frozenset({"g0"}))
    decided_alone = dataclasses.replace(nic.decision, pairs_with=None)  # as if the preference paired nothing
    assert allocator.allocated(VFS, ["v0"], decided_alone) == [("test/gpu", "none")]  # not counted as a pair
    again = JointAllocator(lambda: [Server(GPUS), Server(VFS)])
    again.allocated(GPUS, ["g0"])
    nic = again.prefer(VFS, ContainerRequest(served=VFS.ids, available=VFS.ids, size=1))
    assert nic.decision is not None
    assert again.allocated(VFS, ["v0"], nic.decision) == [("test/gpu", "none"), ("test/vf", "none")]  # a pair
