"""The one validation of a kubelet container request (`check_request`) and the simple in-order policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.placement.policy import ContainerRequest, Reason, check_request, simple_preference

VFS = ("0000:1a:00.2", "0000:1a:00.3", "0000:1a:00.4", "0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4")


@pytest.mark.parametrize(("available", "must", "size"), [
    (list(VFS), [], 0),  # size not positive
    (list(VFS), [], -2),
    ([VFS[0], "0000:ee:00.2"], [], 1),  # unknown available ID
    (list(VFS), ["0000:ee:00.2"], 1),  # unknown must_include ID
    ([VFS[0], VFS[1]], [VFS[2]], 2),  # must_include not available
    (list(VFS), [VFS[0], VFS[1], VFS[2]], 2),  # must_include larger than size
    ([VFS[0]], [], 2),  # too few available
])
def test_inconsistent_requests_are_invalid(available: list[str], must: list[str], size: int) -> None:
    request = ContainerRequest(served=VFS, available=tuple(available), must_include=tuple(must), size=size)
    checked = check_request(request)
    assert checked.reason is Reason.INVALID_REQUEST and checked.detail and not checked.proceed
    preference = simple_preference(request)
    assert preference.reason is Reason.INVALID_REQUEST and preference.devices == ()


def test_unhealthy_offers_make_a_short_request_but_must_include_stays() -> None:
    request = ContainerRequest(served=VFS, available=VFS[:3], must_include=(VFS[0],), size=3,
                               unhealthy=frozenset({VFS[0], VFS[1]}))
    checked = check_request(request)
    assert checked.reason is Reason.SHORT and checked.offered == (VFS[0], VFS[2]) and checked.size == 2
    assert simple_preference(request).devices == (VFS[0], VFS[2])
    none_healthy = check_request(ContainerRequest(served=VFS, available=VFS[:2], size=1,
                                                  unhealthy=frozenset(VFS)))
    assert none_healthy.reason is Reason.SHORT and not none_healthy.proceed
    assert none_healthy.answered(()).reason is Reason.SHORT


def test_no_answer_to_a_whole_request_is_empty() -> None:
    checked = check_request(ContainerRequest(served=VFS, available=VFS, size=2))
    assert checked.reason is Reason.OK
    assert checked.answered(()).reason is Reason.EMPTY
    assert checked.answered(VFS[:2]).reason is Reason.OK


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_simple_policy_properties(data: st.DataObject) -> None:
    available = data.draw(st.lists(st.sampled_from(VFS), min_size=1, unique=True))
    must = data.draw(st.lists(st.sampled_from(available), unique=True))
    size = data.draw(st.integers(min_value=max(1, len(must)), max_value=len(available)))
    request = ContainerRequest(served=VFS, available=tuple(available), must_include=tuple(must), size=size)
    assert check_request(request).reason is Reason.OK  # valid input is never refused
    chosen = simple_preference(request).devices
    assert len(chosen) == size == len(set(chosen))
    assert set(must) <= set(chosen) <= set(available)
