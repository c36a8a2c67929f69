"""A three-namespace test network: pod <-> node (router, where netacct runs) <-> internet, and exact UDP flows.

Addresses are test-only (TEST-NET-3, 2001:db8::/32 documentation, 10.244/16 and fd00::/8 private ranges) and
exist only inside the namespaces; nothing touches the host's own tables. Neighbours are permanent and IPv6 DAD,
router solicitations and RAs are off, so the only IP packets are the ones a test sends. Sockets are opened inside
a namespace by switching this thread in and out (network namespaces are per thread), so traffic runs
in-process (`entered`, shared with the agent's netlink reader).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass

from agent.host.netns import entered

TOOLS = ("ip", "sysctl", "ipset", "iptables-nft-save", "iptables-legacy-save", "ip6tables-nft-save",
         "ip6tables-legacy-save")

POD4, POD6 = "10.244.1.2", "fd00:244:1::2"
OTHER_POD4, OTHER_POD6 = "10.244.1.3", "fd00:244:1::3"
NODE_POD4, NODE_POD6 = "10.244.1.1", "fd00:244:1::1"
NODE_UP4, NODE_UP6 = "203.0.113.1", "2001:db8:1::1"
INET4, INET6 = "203.0.113.2", "2001:db8:1::2"  # an internet peer (not in the internal set)
PEER4, PEER6 = "10.9.9.9", "fd00:9::9"  # a cluster peer on the far side of the uplink
IP_HEADER = {4: 28, 6: 48}  # IP + UDP header bytes added to each payload


def missing_prerequisite() -> str | None:
    """Why netns tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "netns tests need root (CAP_NET_ADMIN and CAP_SYS_ADMIN for ip netns)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing tools {', '.join(missing)} (apt-get install -y iptables ipset iproute2 procps)"
    return None


def sh(*argv: str, ns: str | None = None, stdin: str | None = None, check: bool = True) -> str:
    """Run a command (inside `ns` when given) and return stdout."""
    full = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    done = subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def udp_socket(ns: str, family: int, bind: str) -> socket.socket:
    """A UDP socket living in namespace `ns`, bound to address `bind` (any port)."""
    with entered(ns):
        sock = socket.socket(socket.AF_INET if family == 4 else socket.AF_INET6, socket.SOCK_DGRAM)
    sock.bind((bind, 0))
    sock.settimeout(5.0)
    return sock


def flow(src_ns: str, src: str, dst_ns: str, dst: str, *, count: int, size: int) -> tuple[int, int]:
    """Send `count` UDP datagrams of `size` payload bytes and wait for all; (packets, IP-level bytes)."""
    family = 6 if ":" in dst else 4
    with udp_socket(dst_ns, family, dst) as rx, udp_socket(src_ns, family, src) as tx:
        port = rx.getsockname()[1]
        for _ in range(count):
            tx.sendto(b"\xa5" * size, (dst, port))
        for _ in range(count):
            rx.recv(65535)
    return count, count * (size + IP_HEADER[family])


@dataclass
class Topology:
    """Names of the three namespaces."""

    node: str
    pod: str
    inet: str

    def namespaces(self) -> tuple[str, str, str]:
        """All three names."""
        return self.node, self.pod, self.inet


def _mac(ns: str, dev: str) -> str:
    return json.loads(sh("ip", "-j", "link", "show", dev, ns=ns))[0]["address"]


def build() -> Topology:
    """Create the namespaces, links, addresses, routes and permanent neighbours."""
    tag = uuid.uuid4().hex[:6]
    topo = Topology(f"gna-node-{tag}", f"gna-pod-{tag}", f"gna-inet-{tag}")
    try:
        for ns in topo.namespaces():
            sh("ip", "netns", "add", ns)
            sh("sysctl", "-qw", "net.ipv6.conf.default.accept_ra=0", "net.ipv6.conf.default.router_solicitations=0",
               "net.ipv6.conf.default.dad_transmits=0", "net.ipv6.conf.all.accept_ra=0", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1", ns=topo.node)
        sh("ip", "link", "add", "v-pod", "netns", topo.pod, "type", "veth", "peer", "name", "v-node-pod",
           "netns", topo.node)
        sh("ip", "link", "add", "v-inet", "netns", topo.inet, "type", "veth", "peer", "name", "v-node-inet",
           "netns", topo.node)
        addresses = [
            (topo.pod, "v-pod", [f"{POD4}/24", f"{OTHER_POD4}/24", f"{POD6}/64", f"{OTHER_POD6}/64"]),
            (topo.node, "v-node-pod", [f"{NODE_POD4}/24", f"{NODE_POD6}/64"]),
            (topo.node, "v-node-inet", [f"{NODE_UP4}/24", f"{NODE_UP6}/64"]),
            (topo.inet, "v-inet", [f"{INET4}/24", f"{PEER4}/32", f"{INET6}/64", f"{PEER6}/128"]),
        ]
        for ns, dev, addrs in addresses:
            for addr in addrs:
                sh("ip", "addr", "add", addr, "dev", dev, *(["nodad"] if ":" in addr else []), ns=ns)
            sh("ip", "link", "set", dev, "up", ns=ns)
        routes = [
            (topo.pod, ["default", "via", NODE_POD4]), (topo.pod, ["-6", "default", "via", NODE_POD6]),
            (topo.inet, ["10.244.1.0/24", "via", NODE_UP4]), (topo.inet, ["-6", "fd00:244:1::/64", "via", NODE_UP6]),
            (topo.node, [f"{PEER4}/32", "via", INET4]), (topo.node, ["-6", f"{PEER6}/128", "via", INET6]),
        ]
        for ns, route in routes:
            family = ["-6"] if route[0] == "-6" else []
            sh("ip", *family, "route", "add", *route[len(family):], ns=ns)
        macs = {(ns, dev): _mac(ns, dev) for ns, dev, _ in addresses}
        neighbours = [
            (topo.node, "v-node-pod", (topo.pod, "v-pod"), [POD4, OTHER_POD4, POD6, OTHER_POD6]),
            (topo.node, "v-node-inet", (topo.inet, "v-inet"), [INET4, INET6]),
            (topo.pod, "v-pod", (topo.node, "v-node-pod"), [NODE_POD4, NODE_POD6]),
            (topo.inet, "v-inet", (topo.node, "v-node-inet"), [NODE_UP4, NODE_UP6]),
        ]
        for ns, dev, peer, ips in neighbours:
            for ip in ips:
                sh("ip", "neigh", "replace", ip, "lladdr", macs[peer], "dev", dev, "nud", "permanent", ns=ns)
        _wait_quiet(topo.node)
    except BaseException:
        destroy(topo)
        raise
    return topo


def _ip_counters(ns: str) -> str:
    snmp = sh("cat", "/proc/net/snmp", ns=ns).splitlines()
    snmp6 = [line for line in sh("cat", "/proc/net/snmp6", ns=ns).splitlines() if line.startswith("Ip6")]
    return "\n".join(snmp[:2] + snmp6)


def _wait_quiet(ns: str, quiet: float = 1.0, limit: float = 10.0) -> None:
    """Wait until the node's IP counters stop moving (link-up MLD reports), so tests see only their packets."""
    deadline = time.monotonic() + limit
    last, since = _ip_counters(ns), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _ip_counters(ns)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return


def build_or_skip() -> Topology:
    """`build()`, or skip the calling test (with the reason) where namespaces cannot be made here."""
    import pytest

    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    try:
        return build()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"cannot build test network namespaces: {exc}")


def destroy(topo: Topology) -> None:
    """Delete the namespaces (their links, rules and sets go with them)."""
    for ns in topo.namespaces():
        sh("ip", "netns", "del", ns, check=False)


def members(ns: str, name: str) -> set[str]:
    """Addresses (or prefixes) in one ipset."""
    return {line.split()[2] for line in sh("ipset", "save", name, ns=ns).splitlines() if line.startswith("add ")}


NFT_TABLE = "gpu_node_agent_netacct"


def nft_members(ns: str, name: str) -> set[str]:
    """Addresses (or prefixes) in one set of netacct's nftables table, read with `nft -j`."""
    found: set[str] = set()
    for item in json.loads(sh("nft", "-j", "list", "set", "inet", NFT_TABLE, name, ns=ns))["nftables"]:
        for elem in item.get("set", {}).get("elem", []):
            value = elem["elem"]["val"] if isinstance(elem, dict) and "elem" in elem else elem
            if isinstance(value, dict) and "prefix" in value:
                value = f"{value['prefix']['addr']}/{value['prefix']['len']}"
            found.add(str(value))
    return found


def ebpf_members(bpffs: str, role: str, family: int) -> set[str]:
    """Addresses with a `role` entry of one family in the eBPF layout's pinned pods map, read with bpftool."""
    if shutil.which("bpftool") is None:
        import pytest

        pytest.skip("bpftool is not installed (apt-get install -y bpftool)")
    found: set[str] = set()
    roles = ("rx-inet", "tx-inet", "rx-clus", "tx-clus")
    for entry in json.loads(sh("bpftool", "-j", "map", "dump", "pinned", f"{bpffs}/pods")):
        key = bytes(int(b, 16) for b in entry["key"])
        code = int.from_bytes(key[16:20], "little")
        if roles[code & 3] == role and (6 if code & 4 else 4) == family:
            found.add(str(ipaddress.ip_address(key[:4] if family == 4 else key[:16])))
    return found


def layout_members(ns: str, layout: str, role: str, family: int, bpffs: str | None = None) -> set[str]:
    """Members of the counted set `role` (rx-inet, tx-clus, ...) of one family, in any layout (ebpf: the pods map
    pinned under `bpffs`)."""
    if layout == "ebpf" and bpffs is not None:
        return ebpf_members(bpffs, role, family)
    if layout == "nft":
        return nft_members(ns, f"{role.replace('-', '_')}{family}")
    return members(ns, f"gna-{role}{family}")


def nft_table(ns: str) -> str | None:
    """netacct's nftables table as `nft list` prints it, counters blanked; None when it does not exist."""
    try:
        listed = sh("nft", "list", "table", "inet", NFT_TABLE, ns=ns)
    except RuntimeError:
        return None
    return re.sub(r"packets \d+ bytes \d+", "packets - bytes -", listed)


def save_state(ns: str) -> dict[str, str]:
    """Everything netacct could touch, without counters or timestamps: both backends, both families, ipsets, and
    the whole nftables ruleset (the native layout's table, and the iptables-nft tables once more)."""
    state: dict[str, str] = {}
    for tool in ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        text = sh(tool, ns=ns)
        lines = (re.sub(r"\[\d+:\d+\]", "[-]", line) for line in text.splitlines() if not line.startswith("#"))
        state[tool] = "\n".join(lines)
    state["ipset"] = "\n".join(sorted(sh("ipset", "save", ns=ns).splitlines()))
    if shutil.which("nft"):
        state["nft"] = re.sub(r"packets \d+ bytes \d+", "packets - bytes -", sh("nft", "list", "ruleset", ns=ns))
    return state
