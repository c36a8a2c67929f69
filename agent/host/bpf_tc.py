"""What the eBPF layout needs from rtnetlink: the node's interfaces and addresses, and the tc clsact + cls_bpf
direct-action attachment used where the kernel has no tcx (before 6.6).

The filter holds its program, so it survives the agent without a pin; it is told apart from anyone else's filters
on the shared clsact qdisc by its priority (`PRIO`) and name, and only those are ever replaced or deleted.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from agent.host.netns import entered

ARPHRD_ETHER, ARPHRD_LOOPBACK = 1, 772
IFF_LOOPBACK = 0x8
PRIO = 0xC0A7  # our cls_bpf filters' priority on the clsact hooks
PARENTS = {"ingress": "ffff:fff2", "egress": "ffff:fff3"}

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
T = TypeVar("T")


class TcBpfError(OSError):
    """A clsact / cls_bpf change failed."""


@dataclass(frozen=True)
class Iface:
    """One network interface: index, name, link-layer type (ARPHRD_*)."""

    index: int
    name: str
    arphrd: int

    @property
    def l2_len(self) -> int:
        """The link-layer header a tc program sees in front of the IP header."""
        return 14 if self.arphrd == ARPHRD_ETHER else 0


def _ipr(netns: str | None) -> IPRoute:
    with entered(netns):
        return IPRoute()


def _off_loop(fn: Callable[..., T]) -> Callable[..., T]:
    """Run `fn` on a short-lived thread of its own: pyroute2's synchronous IPRoute drives an event loop of its own,
    which it cannot start on a thread whose loop is running (the agent's services call in from theirs)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bpf-tc") as pool:
            return pool.submit(fn, *args, **kwargs).result()

    return call


@_off_loop
def interfaces(netns: str | None = None) -> list[Iface]:
    """Every interface but loopback (netfilter's hooks skip `lo` too)."""
    with _ipr(netns) as ipr:
        links = ipr.get_links()
    out = []
    for link in links:
        if link["ifi_type"] == ARPHRD_LOOPBACK or link["flags"] & IFF_LOOPBACK:
            continue
        out.append(Iface(int(link["index"]), str(link.get_attr("IFLA_IFNAME")), int(link["ifi_type"])))
    return sorted(out, key=lambda i: i.index)


@_off_loop
def addresses(netns: str | None = None) -> list[Address]:
    """The node's own addresses (every interface, loopback's included: a packet for one of them is local)."""
    with _ipr(netns) as ipr:
        found = ipr.get_addr()
    out: set[Address] = set()
    for msg in found:
        for name in ("IFA_LOCAL", "IFA_ADDRESS", "IFA_BROADCAST"):
            value = msg.get_attr(name)
            if value:
                out.add(ipaddress.ip_address(value))
    return sorted(out, key=lambda a: (a.version, int(a)))


def _filters(ipr: Any, index: int, direction: str) -> list[Any]:
    try:
        return list(ipr.get_filters(index=index, parent=PARENTS[direction]))
    except NetlinkError as exc:
        if exc.code in (errno.EINVAL, errno.ENOENT, errno.ENODEV):
            return []
        raise


@_off_loop
def cls_attached(index: int, direction: str, netns: str | None = None) -> str | None:
    """The name of our cls_bpf program on this hook, or None."""
    with _ipr(netns) as ipr:
        for msg in _filters(ipr, index, direction):
            if msg.get_attr("TCA_KIND") == "bpf" and (msg["info"] >> 16) == PRIO:
                options = msg.get_attr("TCA_OPTIONS")
                name = options.get_attr("TCA_BPF_NAME") if options is not None else None
                if name:
                    return str(name)
    return None


@_off_loop
def cls_attach(index: int, direction: str, prog_fd: int, name: str, netns: str | None = None) -> None:
    """Put the program on the hook (adding clsact if missing; replacing our own filter, never anyone else's)."""
    try:
        with _ipr(netns) as ipr:
            try:
                ipr.tc("add", "clsact", index)
            except NetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise
            ipr.tc("replace-filter", "bpf", index, ":1", fd=prog_fd, name=name, parent=PARENTS[direction],
                   classid=1, direct_action=True, prio=PRIO)
    except NetlinkError as exc:
        raise TcBpfError(exc.code, f"cls_bpf {direction} on ifindex {index}: {exc}") from None


@_off_loop
def cls_detach(index: int, direction: str, netns: str | None = None) -> bool:
    """Delete our filter from the hook (the clsact qdisc stays: others may use it); False when none was there."""
    try:
        with _ipr(netns) as ipr:
            if not any(msg.get_attr("TCA_KIND") == "bpf" and (msg["info"] >> 16) == PRIO
                       for msg in _filters(ipr, index, direction)):
                return False
            ipr.tc("del-filter", "bpf", index, ":1", parent=PARENTS[direction], prio=PRIO)
    except NetlinkError as exc:
        if exc.code in (errno.ENOENT, errno.ENODEV, errno.EINVAL):
            return False
        raise TcBpfError(exc.code, f"cls_bpf {direction} on ifindex {index}: {exc}") from None
    return True
