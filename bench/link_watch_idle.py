"""Idle CPU of the NIC link watcher alone: the old 1 s poll against netlink events with a 30 s safety net.

Builds a network namespace that looks like a busy GPU node's: the dgx-h100 profile's eight RDMA PF netdevs (veth
pairs named like them, up) and `--pods` more veth pairs (pod interfaces), so every dump carries what a node's
would. The RDMA port state comes from the profile's simulated sysfs tree. Each mode runs `LinkWatcher` with a
real `HealthAssessor` in this process for `--seconds` of quiet (no link changes) and reports the process's CPU
time (user + system, all threads) as a percentage of one core:

- `old`: what the agent did before, a check every second, each an RTM_GETLINK dump through a fresh pyroute2
  `IPRoute()` (the code that used to be `NetlinkLinkPort.netdev_states`), no events;
- `poll-1s`: a check every second with the in-process rtnetlink dump that replaced it, no events;
- `events`: the RTNLGRP_LINK subscription, judged on events, with the 30 s safety-net poll (the default).
- `none`: the event loop with no watcher (the floor).

At the end of the events mode one PF is set down and the time until the watcher judged it is printed (one
sample, a sanity check rather than a latency figure).

    python bench/link_watch_idle.py --seconds 30 --pods 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.links import LinkWatcher
from agent.host.links import NetdevState, NetlinkLinkPort
from agent.host.netns import entered
from agent.host.nvml import SimulatedNvml
from agent.signals import DeviceHealth
from agent.simulate import profiles
from agent.simulate.node import build_simulated_node
from agent.topology.load import load_topology
from agent.topology.model import Topology

IP = shutil.which("ip") or "/usr/sbin/ip"


class Pyroute2LinkPort(NetlinkLinkPort):
    """The port as it was: one pyroute2 IPRoute per check (made in the namespace under test)."""

    def netdev_states(self) -> dict[str, NetdevState]:
        from pyroute2 import IPRoute

        states: dict[str, NetdevState] = {}
        with entered(self.netns), IPRoute() as ipr:
            for link in ipr.get_links():
                name = link.get("IFLA_IFNAME")
                if name:
                    carrier = link.get("IFLA_CARRIER")
                    states[name] = NetdevState(str(link.get("IFLA_OPERSTATE") or "unknown").lower(),
                                               None if carrier is None else bool(carrier))
        return states


def ip(ns: str, *argv: str, stdin: str | None = None) -> None:
    subprocess.run([IP, "-n", ns, *argv], input=stdin, text=True, check=True, timeout=120, capture_output=True)


def build_namespace(topology: Topology, pods: int) -> str:
    ns = f"gna-bench-{uuid.uuid4().hex[:6]}"
    subprocess.run([IP, "netns", "add", ns], check=True, timeout=30)
    batch = ""
    for i, nic in enumerate(topology.rdma_nics):
        batch += f"link add {nic.netdevs[0]} type veth peer name pfpeer{i}\nlink set pfpeer{i} up\n"
        batch += f"link set {nic.netdevs[0]} up\n"
    for i in range(pods):
        batch += f"link add vethpod{i} type veth peer name eth{i}\nlink set vethpod{i} up\nlink set eth{i} up\n"
    ip(ns, "-batch", "-", stdin=batch)
    return ns


async def measure(mode: str, port: NetlinkLinkPort, topology: Topology, seconds: float) -> tuple[float, int]:
    assessor = HealthAssessor(HealthConfig(), topology, DeviceHealth(), time.monotonic)
    interval = 1.0 if mode in ("old", "poll-1s") else 30.0
    watcher = LinkWatcher(port, assessor, interval, events=mode == "events")
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop)) if mode != "none" else None
    if task is not None:
        await asyncio.wait_for(watcher.first_pass.wait(), 30)
    await asyncio.sleep(1.0)  # settle: the first dump and imports are not idle cost
    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    percent = 100 * (time.process_time() - cpu) / (time.monotonic() - wall)
    passes = watcher.passes
    if mode == "events":
        nic = topology.rdma_nics[0]
        start = time.monotonic()
        await asyncio.to_thread(ip, port.netns or "", "link", "set", nic.netdevs[0], "down")
        while assessor.links[nic.bus_id].up:
            await asyncio.sleep(0.001)
        print(f"  events: {nic.netdevs[0]} set down -> judged down after {1000 * (time.monotonic() - start):.1f} ms "
              f"(including the `ip` process)")
        await asyncio.to_thread(ip, port.netns or "", "link", "set", nic.netdevs[0], "up")
    stop.set()
    if task is not None:
        await task
    return percent, passes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="quiet time measured per mode")
    parser.add_argument("--pods", type=int, default=100, help="extra veth pairs in the namespace (pod interfaces)")
    parser.add_argument("--modes", nargs="+", default=["none", "old", "poll-1s", "events"],
                        choices=["none", "old", "poll-1s", "events"])
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (ip netns)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "sys"
        build_simulated_node("dgx-h100", root)
        topology = load_topology(root, SimulatedNvml(profiles.load_profile("dgx-h100").gpu_uuids).gpu_uuids())
        ns = build_namespace(topology, args.pods)
        try:
            links = len(NetlinkLinkPort(root, netns=ns).netdev_states())
            print(f"namespace {ns}: {links} netdevs, {len(topology.rdma_nics)} RDMA PFs watched; "
                  f"{args.seconds:g} s quiet per mode; CPU of this process as % of one core")
            for mode in args.modes:
                port = Pyroute2LinkPort(root, netns=ns) if mode == "old" else NetlinkLinkPort(root, netns=ns)
                percent, passes = asyncio.run(measure(mode, port, topology, args.seconds))
                print(f"{mode:8} {percent:6.3f} %   ({passes} judgements of every PF)")
        finally:
            subprocess.run([IP, "netns", "del", ns], check=False, timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
