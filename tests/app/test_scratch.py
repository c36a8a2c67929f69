"""Where `run --simulate` writes its scratch tree: in memory when it can (start time), else the temp directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.app import RAM_DIR_MIN_FREE, scratch_parent


def test_a_simulated_node_goes_to_the_first_writable_ram_directory_with_room(tmp_path: Path):
    missing, there = tmp_path / "missing", tmp_path / "shm"
    there.mkdir()
    assert scratch_parent(True, [str(missing), str(there)]) == str(there)


def test_a_real_node_or_no_ram_directory_keeps_the_default(tmp_path: Path):
    assert scratch_parent(False, [str(tmp_path)]) is None
    assert scratch_parent(True, [str(tmp_path / "missing")]) is None


def test_too_little_room_keeps_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real = os.statvfs(tmp_path)

    class Full:
        f_frsize = real.f_frsize
        f_bavail = (RAM_DIR_MIN_FREE - 1) // real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda _: Full())
    assert scratch_parent(True, [str(tmp_path)]) is None
