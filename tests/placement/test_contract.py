"""The GetPreferredAllocation contract, as properties over random nodes and requests."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.placement.policy import AllocationRequest, DeviceKind, preferred_allocation
from tests.placement.strategies import ids_of, requests


@settings(max_examples=150, deadline=None)
@given(requests())
def test_exact_size_subset_of_available_with_every_must_include(request: AllocationRequest) -> None:
    chosen = preferred_allocation(request)
    assert len(chosen) == request.size
    assert len(set(chosen)) == request.size
    assert set(chosen) <= request.available
    assert request.must_include <= set(chosen)


@settings(max_examples=60, deadline=None)
@given(requests(), st.randoms(use_true_random=False))
def test_same_answer_whatever_the_input_order(request: AllocationRequest, rng) -> None:
    def shuffled(ids: frozenset[str]) -> list[str]:
        listed = sorted(ids)
        rng.shuffle(listed)
        return listed

    # Rebuild the sets from shuffled lists, so their iteration order differs too.
    again = AllocationRequest(
        topology=request.topology, kind=request.kind, available=shuffled(request.available),
        size=request.size, must_include=shuffled(request.must_include), context=shuffled(request.context),
        other_free=None if request.other_free is None else shuffled(request.other_free))
    assert preferred_allocation(again) == preferred_allocation(request)


@settings(max_examples=60, deadline=None)
@given(requests(), st.sampled_from(["too_big", "zero", "negative", "must_not_available", "size_below_must",
                                    "unknown_id", "other_kind_id", "bad_kind"]))
def test_impossible_or_malformed_requests_get_no_preference(request: AllocationRequest, broken: str) -> None:
    other = DeviceKind.NIC if request.kind == DeviceKind.GPU else DeviceKind.GPU
    change: dict[str, object] = {}
    if broken == "too_big":
        change["size"] = len(request.available) + 1
    elif broken == "zero":
        change["size"] = 0
    elif broken == "negative":
        change["size"] = -1
    elif broken == "must_not_available":
        change["must_include"] = request.must_include | {"0000:ff:1f.7"}
    elif broken == "size_below_must":
        must = sorted(request.available)[:2]
        if len(must) < 2:
            return
        change.update(must_include=frozenset(must), size=1)
    elif broken == "unknown_id":
        change["available"] = request.available | {"GPU-not-here" if request.kind == "gpu" else "0000:ff:1f.7"}
    elif broken == "other_kind_id":
        theirs = ids_of(request.topology, other)
        if not theirs:
            return
        change["available"] = request.available | {theirs[0]}
    elif broken == "bad_kind":
        change["kind"] = "fpga"
    assert preferred_allocation(dataclasses.replace(request, **change)) == []


def test_unknown_context_and_free_devices_are_ignored(dgx) -> None:
    gpus = ids_of(dgx, DeviceKind.GPU)
    base = AllocationRequest(topology=dgx, kind=DeviceKind.GPU, available=frozenset(gpus), size=2)
    noisy = dataclasses.replace(base, context=frozenset({"0000:ff:1f.7", "garbage"}),
                                other_free=frozenset(ids_of(dgx, DeviceKind.NIC)) | {"garbage"})
    assert preferred_allocation(noisy) == preferred_allocation(base)


def test_no_choice_returns_everything_or_the_must_include(pairs) -> None:
    gpus = ids_of(pairs, DeviceKind.GPU)
    everything = AllocationRequest(topology=pairs, kind=DeviceKind.GPU, available=frozenset(gpus[:3]), size=3)
    assert preferred_allocation(everything) == gpus[:3]
    only_must = dataclasses.replace(everything, must_include=frozenset(gpus[1:3]), size=2)
    assert preferred_allocation(only_must) == gpus[1:3]
