"""The policy's choice scores as well as the best of every subset, by the brute-force reference.

Random nodes of up to 8 GPUs, random availabilities, must_include, admission contexts and free sets: the
GPU choice (first and after NICs) against all GPU subsets, the VF choice (first and given GPUs) against all
VF subsets of up to 12 available VFs.
"""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agent.placement.policy import AllocationRequest, DeviceKind, achieved_levels, preferred_allocation
from tests.placement.conftest import nodes
from tests.placement.reference import LEVELS, best_matching, best_reference_score, reference_score
from tests.placement.strategies import ids_of, requests


def _agrees(request: AllocationRequest) -> None:
    free_choices = len(request.available) - len(request.must_include)
    assume(math.comb(free_choices, request.size - len(request.must_include)) > 1)  # a real choice
    chosen = preferred_allocation(request)
    assert reference_score(request, chosen) == best_reference_score(request)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.booleans())
def test_gpu_choice_is_as_good_as_every_subset(data: st.DataObject, with_context: bool) -> None:
    topology = data.draw(nodes(max_gpus=8, max_pfs=4, max_vfs=4))
    _agrees(data.draw(requests(topology, DeviceKind.GPU, context=with_context)))


@settings(max_examples=80, deadline=None)
@given(st.data(), st.booleans())
def test_vf_choice_is_as_good_as_every_subset(data: st.DataObject, with_context: bool) -> None:
    topology = data.draw(nodes(max_gpus=8, max_pfs=4, max_vfs=8, max_units=16))
    _agrees(data.draw(requests(topology, DeviceKind.NIC, max_available=12, max_size=5, context=with_context)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_achieved_levels_are_the_best_matching(data: st.DataObject) -> None:
    topology = data.draw(nodes(max_gpus=8, max_pfs=4, max_vfs=4))
    gpus = data.draw(st.lists(st.sampled_from(ids_of(topology, DeviceKind.GPU)), unique=True, max_size=6))
    nics = data.draw(st.lists(st.sampled_from(ids_of(topology, DeviceKind.NIC)), unique=True, max_size=6))
    histogram = best_matching([topology.gpu_by_uuid(g).location for g in gpus],
                              [topology.location(n) for n in nics])
    expected = [level for level, count in zip(LEVELS, histogram, strict=True) for _ in range(count)]
    assert achieved_levels(topology, gpus, nics) == expected
