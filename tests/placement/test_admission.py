"""The admission context hands one container's devices from one resource to the other, and no further."""

from __future__ import annotations

from agent.placement.admission import AdmissionContext
from agent.placement.policy import DeviceKind

GPU, NIC = DeviceKind.GPU, DeviceKind.NIC


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_order_hands_the_first_resource_to_the_second_once() -> None:
    for first, second in ((GPU, NIC), (NIC, GPU)):
        context = AdmissionContext(clock=Clock())
        assert context.begin_preference(first) == frozenset()
        context.record_allocation(first, ["a", "b"])
        assert context.begin_preference(second) == {"a", "b"}
        context.record_allocation(second, ["x", "y"], completes=True)  # the preference took the record
        # The next container starts clean, whichever resource comes first.
        assert context.begin_preference(first) == frozenset()
        context.record_allocation(first, ["c"])
        assert context.begin_preference(second) == {"c"}


def test_completing_allocate_is_not_handed_on() -> None:
    context = AdmissionContext(clock=Clock())
    context.begin_preference(GPU)
    context.record_allocation(GPU, ["g0"])
    completes = bool(context.begin_preference(NIC))  # the caller hands back whether it took the record
    context.record_allocation(NIC, ["v0"], completes=completes)
    assert context.begin_preference(GPU) == frozenset()  # v0 belonged to the previous container


def test_new_preference_for_the_same_resource_drops_the_record() -> None:
    context = AdmissionContext(clock=Clock())
    context.begin_preference(GPU)
    context.record_allocation(GPU, ["g0"])  # a GPU-only container
    assert context.begin_preference(GPU) == frozenset()
    context.record_allocation(GPU, ["g1"])
    assert context.begin_preference(NIC) == {"g1"}


def test_record_expires_after_the_ttl() -> None:
    clock = Clock()
    context = AdmissionContext(ttl_s=2.0, clock=clock)
    context.record_allocation(NIC, ["v0"])
    clock.now += 2.5
    assert context.begin_preference(GPU) == frozenset()
    context.record_allocation(NIC, ["v1"])
    clock.now += 1.5
    assert context.begin_preference(GPU) == {"v1"}


def test_allocate_without_a_preference_call_closes_the_pair() -> None:
    context = AdmissionContext(clock=Clock())
    context.record_allocation(GPU, ["g0"])
    context.record_allocation(NIC, ["v0"])  # the kubelet did not ask for a NIC preference
    assert context.begin_preference(GPU) == frozenset()
    assert context.begin_preference(NIC) == frozenset()


def test_consumed_record_is_gone_even_without_the_allocate() -> None:
    context = AdmissionContext(clock=Clock())
    context.record_allocation(GPU, ["g0"])
    assert context.begin_preference(NIC) == {"g0"}
    assert context.begin_preference(NIC) == frozenset()
