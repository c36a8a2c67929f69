"""The prepared-claims record survives restarts and a broken file never stops the driver."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from agent.dra.state import LockTimeout, PreparedClaim, PreparedDevice, PreparedStore, StateUnreadable, serialized


def test_record_round_trip_and_owner(tmp_path: Path) -> None:
    store = PreparedStore(tmp_path)
    claim = PreparedClaim("ns", "c", (PreparedDevice(("gpu",), "node", "gpu-0", ("k=id",)),))
    store.put("uid-1", claim)
    again = PreparedStore(tmp_path)
    assert again.claims == {"uid-1": claim}
    assert again.owner("node", "gpu-0") == "uid-1" and again.owner("node", "gpu-1") is None
    assert again.remove("uid-1") == claim and PreparedStore(tmp_path).claims == {}
    assert [p.name for p in tmp_path.iterdir()] == ["dra-prepared.json"]


@pytest.mark.parametrize(("content", "problem"), [
    (b"{not json", "not JSON"),
    (b'{"uid": {"namespace": 1}}', "namespace is not a string"),
    (b"[" * 100_000 + b"]" * 100_000, "nested more deeply"),  # issue 27: a RecursionError on every prepare
    (b'{"uid": "\xff"}', "not JSON"),
])
def test_unreadable_record_fails_closed(tmp_path: Path, content: bytes, problem: str) -> None:
    """Issue 27, item 7: a broken record "started empty", so a device it held was prepared for another claim."""
    (tmp_path / "dra-prepared.json").write_bytes(content)
    store = PreparedStore(tmp_path)
    assert store.claims == {} and store.problem is not None and problem in store.problem
    with pytest.raises(StateUnreadable):
        store.put("uid-1", PreparedClaim("ns", "c", ()))
    assert store.remove("uid-1") is None
    assert (tmp_path / "dra-prepared.json").read_bytes() == content  # left for the operator
    (tmp_path / "dra-prepared.json").unlink()
    store.reload()
    assert store.problem is None


async def test_two_processes_share_the_record_under_the_lock(tmp_path: Path) -> None:
    """A rolling update: the old and the new agent both answer the kubelet for a while."""
    old, new = PreparedStore(tmp_path), PreparedStore(tmp_path)
    claim = PreparedClaim("ns", "c", (PreparedDevice(("vf",), "node", "rdma-0", ("k=id",)),))
    async with serialized(old.lock_path):
        old.reload()
        old.put("uid-1", claim)
    async with serialized(new.lock_path):
        new.reload()
        assert new.owner("node", "rdma-0") == "uid-1"


async def test_a_held_lock_times_out_with_an_error(tmp_path: Path) -> None:
    store = PreparedStore(tmp_path)
    store.lock_path.touch()
    fd = os.open(store.lock_path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # flock locks are per open file: this stands for another process
    try:
        with pytest.raises(LockTimeout):
            async with serialized(store.lock_path, timeout=0.1):
                pass
    finally:
        os.close(fd)
