"""Uninstalling, through the CLI in a real network namespace: each subsystem's cleanup removes its own objects.

`netacct cleanup` used to remove shaping's qdiscs and IFBs too; shaping owns its objects now (`agent.pods` is what
the two share), so `netacct cleanup` leaves them and says so, and `shaping cleanup` removes them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from agent.host.tc_netlink import NetlinkTc

IP = shutil.which("ip") or "/usr/sbin/ip"
IFB = "gnas" + "0" * 11  # one of ours by name (`agent.host.tc.IFB_PREFIX` + 11 hex digits)


@pytest.fixture
def namespace() -> Iterator[str]:
    if os.geteuid() != 0 or not os.path.exists(IP):
        pytest.skip("needs root and iproute2 (a network namespace)")
    name = f"gns-clean-{uuid.uuid4().hex[:8]}"
    subprocess.run([IP, "netns", "add", name], check=True, timeout=10)
    try:
        yield name
    finally:
        subprocess.run([IP, "netns", "del", name], check=False, timeout=10)


def agent(namespace: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([IP, "netns", "exec", namespace, sys.executable, "-m", "agent", *argv],
                          capture_output=True, text=True, timeout=60, check=False)


def ifbs(namespace: str) -> list[str]:
    port = NetlinkTc(namespace)
    try:
        return sorted(port.read().ifbs)
    finally:
        port.close()


def test_netacct_cleanup_leaves_shapers_and_says_so_shaping_cleanup_removes_them(namespace: str) -> None:
    port = NetlinkTc(namespace)
    try:
        port.ensure_ifb(IFB, 50_000_000)  # what a shaped pod's upload limit leaves in the namespace
    finally:
        port.close()
    assert ifbs(namespace) == [IFB]

    done = agent(namespace, "netacct", "cleanup")
    assert done.returncode == 0, done.stderr
    assert ifbs(namespace) == [IFB]  # not netacct's to remove
    assert "shaping objects remain (1)" in done.stdout and "shaping cleanup" in done.stdout

    done = agent(namespace, "shaping", "cleanup")
    assert done.returncode == 0, done.stderr
    assert ifbs(namespace) == [] and f"IFB {IFB}" in done.stdout

    done = agent(namespace, "netacct", "cleanup")  # nothing of shaping's left: no note
    assert done.returncode == 0 and "shaping objects remain" not in done.stdout, done.stdout
