"""A node with pods, a cluster peer and an internet peer behind a masquerading uplink, in network namespaces.

    pod1 (10.244.1.2/32, routed veth `cali1`, Calico-style: default via 169.254.1.1)  ┐
    pod3 (10.244.1.3/32, routed veth `cali3`, never annotated)                        ├─ node ── up0 ── inet
    pod2 (10.244.2.2/24, veth `veth2` on bridge `cni0` 10.244.2.1, flannel-style)     ┘    │ MASQUERADE  198.51.100.2
                                                                                           └─ cl0 ── cluster 10.1.0.2

Internet traffic leaves through `up0` with MASQUERADE (iptables, on the backend under test), so downloads reach
the pods only through the reverse NAT, as on a real node. Throughput is measured with iperf3 (TCP, short runs,
receiver goodput); servers run in the peers and are stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

INET = "198.51.100.2"
CLUSTER = "10.1.0.2"
POD1, POD2, POD3 = "10.244.1.2", "10.244.2.2", "10.244.1.3"
PORT = 5201


def missing_prerequisite() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "shaping namespace tests need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    tools = ("ip", "bridge", "iperf3", "sysctl", "iptables-nft", "iptables-legacy")
    missing = [t for t in tools if not shutil.which(t)]
    return f"missing tools {', '.join(missing)} (apt-get install -y iproute2 iperf3 iptables)" if missing else None


def sh(*argv: str, ns: str | None = None, check: bool = True, timeout: float = 30) -> str:
    """Run a command (inside `ns` when given) and return stdout."""
    full = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class Net:
    """Namespace names and the iperf3 servers running in them."""

    tag: str
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def ns(self, role: str) -> str:
        """The namespace of `role` (node, pod1, pod2, pod3, cluster, inet)."""
        return f"gns-{role}-{self.tag}"

    @property
    def node(self) -> str:
        """The node's namespace (where the agent's port runs)."""
        return self.ns("node")

    def all(self) -> list[str]:
        """Every namespace."""
        return [self.ns(r) for r in ("node", "pod1", "pod2", "pod3", "cluster", "inet")]


def _veth(net: Net, node_dev: str, peer_role: str, peer_dev: str = "eth0") -> None:
    sh("ip", "link", "add", node_dev, "netns", net.node, "type", "veth", "peer", "name", peer_dev,
       "netns", net.ns(peer_role))
    sh("ip", "-n", net.node, "link", "set", node_dev, "up")
    sh("ip", "-n", net.ns(peer_role), "link", "set", peer_dev, "up")


def build(backend: str) -> Net:
    """Create everything; MASQUERADE with iptables-`backend` (nft or legacy)."""
    net = Net(uuid.uuid4().hex[:6])
    try:
        for ns in net.all():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=net.node)
        ip = lambda role, *a: sh("ip", "-n", net.ns(role), *a)  # noqa: E731
        _veth(net, "up0", "inet")
        ip("node", "addr", "add", "198.51.100.1/24", "dev", "up0")
        ip("inet", "addr", "add", f"{INET}/24", "dev", "eth0")  # the internet knows no pod routes: NAT needed
        ip("node", "route", "add", "default", "via", INET)
        _veth(net, "cl0", "cluster")
        ip("node", "addr", "add", "10.1.0.1/24", "dev", "cl0")
        ip("cluster", "addr", "add", f"{CLUSTER}/24", "dev", "eth0")
        ip("cluster", "route", "add", "10.244.0.0/16", "via", "10.1.0.1")
        for role, dev, addr in (("pod1", "cali1", POD1), ("pod3", "cali3", POD3)):  # routed, Calico-style
            _veth(net, dev, role)
            ip("node", "addr", "add", "169.254.1.1/32", "dev", dev)
            ip("node", "route", "add", f"{addr}/32", "dev", dev, "scope", "link")
            ip(role, "addr", "add", f"{addr}/32", "dev", "eth0")
            ip(role, "route", "add", "169.254.1.1", "dev", "eth0", "scope", "link")
            ip(role, "route", "add", "default", "via", "169.254.1.1", "dev", "eth0")
        ip("node", "link", "add", "cni0", "type", "bridge")  # bridged, flannel-style
        ip("node", "addr", "add", "10.244.2.1/24", "dev", "cni0")
        ip("node", "link", "set", "cni0", "up")
        _veth(net, "veth2", "pod2")
        ip("node", "link", "set", "veth2", "master", "cni0")
        ip("pod2", "addr", "add", f"{POD2}/24", "dev", "eth0")
        ip("pod2", "route", "add", "default", "via", "10.244.2.1")
        sh(f"iptables-{backend}", "-w", "5", "-t", "nat", "-A", "POSTROUTING", "-s", "10.244.0.0/16", "-o", "up0",
           "-j", "MASQUERADE", ns=net.node)
        for role, address in (("inet", INET), ("cluster", CLUSTER)):
            net.servers.append(subprocess.Popen(
                ["ip", "netns", "exec", net.ns(role), "iperf3", "-s", "-B", address, "-p", str(PORT)],  # noqa: S607
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    except BaseException:
        destroy(net)
        raise
    return net


def destroy(net: Net) -> None:
    """Stop the servers and delete the namespaces (their links and qdiscs go with them; IFBs live in node)."""
    for server in net.servers:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(5)
    for ns in net.all():
        sh("ip", "netns", "del", ns, check=False)


def mbps(net: Net, role: str, server: str, *, reverse: bool = False, seconds: int = 3) -> float:
    """Receiver goodput of one TCP iperf3 run from pod `role` to `server` (reverse: server sends), Mbit/s."""
    argv = ["iperf3", "-c", server, "-p", str(PORT), "-t", str(seconds), "-O", "1", "-J", *(["-R"] if reverse else [])]
    for attempt in range(3):  # the server takes a moment to listen, and serves one test at a time
        out = sh(*argv, ns=net.ns(role), check=False, timeout=seconds + 20)
        with contextlib.suppress(ValueError, KeyError):
            return float(json.loads(out)["end"]["sum_received"]["bits_per_second"]) / 1e6
        sh("sleep", str(0.5 * (attempt + 1)))
    raise RuntimeError(f"iperf3 from {role} to {server} failed: {out[-500:]}")


def poke(net: Net, role: str, address: str) -> None:
    """One UDP datagram from the pod to `address` (its ARP request fills the node's neighbour entry and the
    bridge's forwarding entry, as any first packet would)."""
    code = f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('{address}', 9))"
    sh(sys.executable, "-c", code, ns=net.ns(role))
    sh("sleep", "0.2")


def tc_objects(net: Net) -> list[str]:
    """Every qdisc and filter in the node namespace that is not a default, plus IFB links (residue check).

    HTB prints a live counter (`direct_packets_stat`) in its parameters: a packet still in flight between two
    snapshots would change it, so it is left out of what is compared.
    """
    out: list[str] = []
    for line in sh("tc", "qdisc", "show", ns=net.node).splitlines():
        if not line.startswith("qdisc noqueue"):
            out.append(re.sub(r" direct_packets_stat \d+", "", line))
    for line in sh("ip", "-o", "link", "show", "type", "ifb", ns=net.node).splitlines():
        out.append(line.split(":")[1].strip())
    return out


@contextlib.contextmanager
def network(backend: str) -> Iterator[Net]:
    """`build` ... `destroy`."""
    net = build(backend)
    try:
        yield net
    finally:
        destroy(net)
