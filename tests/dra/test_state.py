"""The prepared-claims record survives restarts and a broken file never stops the driver."""

from __future__ import annotations

from pathlib import Path

from agent.dra.state import PreparedClaim, PreparedDevice, PreparedStore


def test_record_round_trip_and_owner(tmp_path: Path) -> None:
    store = PreparedStore(tmp_path)
    claim = PreparedClaim("ns", "c", (PreparedDevice(("gpu",), "node", "gpu-0", ("k=id",)),))
    store.put("uid-1", claim)
    again = PreparedStore(tmp_path)
    assert again.claims == {"uid-1": claim}
    assert again.owner("node", "gpu-0") == "uid-1" and again.owner("node", "gpu-1") is None
    assert again.remove("uid-1") == claim and PreparedStore(tmp_path).claims == {}
    assert [p.name for p in tmp_path.iterdir()] == ["dra-prepared.json"]


def test_unreadable_record_starts_empty(tmp_path: Path) -> None:
    (tmp_path / "dra-prepared.json").write_text("{not json")
    assert PreparedStore(tmp_path).claims == {}
    (tmp_path / "dra-prepared.json").write_text('{"uid": {"namespace": 1}}')
    assert PreparedStore(tmp_path).claims == {}
