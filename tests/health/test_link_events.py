"""NIC links judged on real netlink events, in a network namespace of their own.

The namespace holds a veth pair whose agent-side end carries the simulated dgx-h100's first RDMA PF netdev name
(`ibp24s0`); its RDMA port state comes from the simulated sysfs tree. The service runs on a fake clock that no
test advances unless it says so, so the 30 s safety-net poll never fires: a verdict that changes proves the event
path. The overrun test shrinks the subscription's socket buffer and keeps the agent's event loop busy while
hundreds of links change, so the kernel really drops notifications (ENOBUFS) and only the resync can see the
link that went down meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from agent.host.links import NetdevState, NetlinkLinkPort
from agent.host.rtnetlink import LinkNews
from agent.simulate.node import SimulatedNode
from agent.topology.model import Nic
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until
from tests.health.conftest import fast_config

PF_NETDEV, PEER = "ibp24s0", "ibpeer"
SAFETY_POLL = 30.0
RESYNCS = "gpu_node_agent_link_event_resyncs_total"
IP = shutil.which("ip") or "/usr/sbin/ip"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "netlink namespace tests need root (ip netns)"
    return None if shutil.which("ip") else "missing iproute2 (apt-get install -y iproute2)"


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def ip(ns: str, *argv: str, stdin: str | None = None) -> str:
    """`ip -n NS ...`; RuntimeError with stderr on failure."""
    done = subprocess.run([IP, "-n", ns, *argv], input=stdin, capture_output=True, text=True, timeout=60,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip -n {ns} {' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def operstate(ns: str, name: str) -> str:
    """The link's operstate as `ip` reads it (a fresh dump, outside the agent)."""
    return ip(ns, "-o", "link", "show", name).split(" state ", 1)[1].split()[0]


@pytest.fixture
def netns() -> Iterator[str]:
    """A namespace with the veth pair ibp24s0 <-> ibpeer, both up."""
    name = f"gna-link-{uuid.uuid4().hex[:6]}"
    subprocess.run([IP, "netns", "add", name], check=True, timeout=30, capture_output=True)
    try:
        ip(name, "link", "add", PF_NETDEV, "type", "veth", "peer", "name", PEER)
        ip(name, "link", "set", PEER, "up")
        ip(name, "link", "set", PF_NETDEV, "up")
        yield name
    finally:
        subprocess.run([IP, "netns", "del", name], check=False, timeout=30, capture_output=True)


def _pf(node: SimulatedNode) -> Nic:
    nic = node.topology().rdma_nics[0]
    assert nic.netdevs[0] == PF_NETDEV
    return nic


async def _up_and_healthy(running, nic: Nic) -> None:
    await until(lambda: running.service.assessor.links[nic.bus_id].up, "link seen up")
    assert running.service.verdict.verdict == "healthy"


async def test_link_down_is_seen_from_the_event_not_the_poll(netns, writable_node, kmsg_file,
                                                             start_service) -> None:
    node, clock = writable_node, FakeClock()
    nic = _pf(node)
    vfs = {vf.bus_id for vf in nic.vfs}
    await until(lambda: operstate(netns, PF_NETDEV) == "UP", "veth up")
    running = await start_service(node, fast_config(kmsg_file, link_check_interval_seconds=SAFETY_POLL),
                                  link_port=NetlinkLinkPort(node.sysfs_root, netns=netns), clock=clock)
    await _up_and_healthy(running, nic)
    start = clock.monotonic()

    ip(netns, "link", "set", PF_NETDEV, "down")
    await until(lambda: all(running.health().get(vf) is False for vf in vfs), "VFs Unhealthy")
    assert running.health()[nic.bus_id] is False
    assert running.service.verdict.verdict == "degraded"
    assert f"link down: {PF_NETDEV} no carrier" in running.service.verdict.reasons[0]
    assert running.registry.get_sample_value(
        "gpu_node_agent_nic_link_up", {"pci_bus_id": nic.bus_id, "netdev": PF_NETDEV, "rdma": nic.rdma}) == 0

    ip(netns, "link", "set", PF_NETDEV, "up")
    await until(lambda: all(running.health().get(vf) is True for vf in vfs), "VFs Healthy again")
    assert running.service.verdict.verdict == "healthy"

    ip(netns, "link", "set", PEER, "down")  # the far end: this end loses its carrier
    await until(lambda: running.service.verdict.verdict == "degraded", "carrier loss seen")
    assert f"{PF_NETDEV} no carrier" in running.service.verdict.reasons[0]
    ip(netns, "link", "set", PEER, "up")
    await until(lambda: running.service.verdict.verdict == "healthy", "carrier back")
    assert clock.monotonic() == start  # no fake time passed: the safety poll never ran
    assert running.registry.get_sample_value(RESYNCS) == 0


async def test_safety_poll_catches_an_rdma_port_change(netns, writable_node, kmsg_file, start_service) -> None:
    """RDMA port state lives in sysfs and sends no netlink event: the poll (on the fake clock) finds it. The NIC
    counter pass, which would notice it too (test_links.py), is off here."""
    node, clock = writable_node, FakeClock()
    nic = _pf(node)
    await until(lambda: operstate(netns, PF_NETDEV) == "UP", "veth up")
    running = await start_service(node, fast_config(kmsg_file, link_check_interval_seconds=SAFETY_POLL,
                                                    nic_counter_interval_seconds=0),
                                  link_port=NetlinkLinkPort(node.sysfs_root, netns=netns), clock=clock)
    await _up_and_healthy(running, nic)
    state = node.sysfs_root / "class" / "infiniband" / (nic.rdma or "") / "ports" / "1" / "state"
    state.write_text("1: DOWN\n")
    await clock.advance(SAFETY_POLL - 1)
    await asyncio.sleep(0.2)
    assert running.service.assessor.links[nic.bus_id].up  # not yet: nothing told the agent
    await until(lambda: not running.service.assessor.links[nic.bus_id].up, "port DOWN seen by the poll",
                clock=clock, step=1.0)
    assert f"{nic.rdma} port 1 DOWN" in running.service.verdict.reasons[0]


async def test_an_overrun_subscription_resyncs_with_a_dump(netns, writable_node, kmsg_file,
                                                           start_service) -> None:
    node, clock = writable_node, FakeClock()
    nic = _pf(node)
    await until(lambda: operstate(netns, PF_NETDEV) == "UP", "veth up")
    port = NetlinkLinkPort(node.sysfs_root, netns=netns, receive_buffer=0)  # the kernel's minimum
    running = await start_service(node, fast_config(kmsg_file, link_check_interval_seconds=SAFETY_POLL),
                                  link_port=port, clock=clock)
    await _up_and_healthy(running, nic)
    # The agent's loop is blocked while this runs (a synchronous call in the test's coroutine), so nothing
    # drains the socket: 100 new veth pairs and their state changes overflow it, and the PF going down
    # meanwhile is among the notifications the kernel drops or queues behind the loss.
    batch = "".join(f"link add gna{i} type veth peer name gnb{i}\nlink set gna{i} up\n" for i in range(100))
    ip(netns, "-batch", "-", stdin=batch + f"link set {PF_NETDEV} down\n")
    await until(lambda: running.registry.get_sample_value(RESYNCS) >= 1, "resync counted")
    await until(lambda: running.service.verdict.verdict == "degraded", "down PF seen after the resync")
    assert f"link down: {PF_NETDEV} no carrier" in running.service.verdict.reasons[0]
    ip(netns, "link", "set", PF_NETDEV, "up")  # and the stream goes on after the loss
    await until(lambda: running.service.verdict.verdict == "healthy", "up again")
    assert clock.monotonic() == 1_800_000_000.0


async def test_subscription_reports_changes_and_removals_only_for_netdevs(netns) -> None:
    """RTM_NEWLINK/RTM_DELLINK of AF_UNSPEC; a bridge port leaving its bridge (AF_BRIDGE DELLINK) is no removal."""
    stream = await asyncio.to_thread(NetlinkLinkPort("/sys", netns=netns).subscribe)
    try:
        seen, history = LinkNews(), []

        async def collect(done) -> None:
            while not done(seen):
                news = await asyncio.wait_for(stream.changed(), 10)
                assert not news.lost
                seen.changes.update(news.changes)
                history.extend(state for name, state in news.changes.items() if name == "gnad")

        ip(netns, "link", "add", "gnabr", "type", "bridge")
        ip(netns, "link", "add", "gnad", "type", "veth", "peer", "name", "gnae")
        ip(netns, "link", "set", "gnad", "master", "gnabr")
        ip(netns, "link", "set", "gnad", "up")
        await collect(lambda s: s.changes.get("gnad") == NetdevState("lowerlayerdown", False))  # peer down
        ip(netns, "link", "set", "gnad", "nomaster")
        ip(netns, "link", "set", "gnad", "down")
        await collect(lambda s: s.changes.get("gnad") == NetdevState("down", False) and s.changes["gnabr"] is not None)
        assert None not in history  # leaving the bridge did not read as the netdev going away
        ip(netns, "link", "del", "gnad")
        await collect(lambda s: "gnad" in s.changes and s.changes["gnad"] is None)
        assert stream.overruns == 0
    finally:
        stream.close()
    states = NetlinkLinkPort("/sys", netns=netns).netdev_states()
    assert states[PF_NETDEV] == NetdevState("up", True)
    assert "gnad" not in states and states["lo"].operstate in ("unknown", "down")
