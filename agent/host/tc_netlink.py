"""`TcPort` over netlink through pyroute2: the shaping objects described in `agent.host.tc`.

Read-back: pyroute2 0.9 decodes the keys of `TCA_U32_SEL` from the wrong offset (4 bytes early), so
`_u32_keys` decodes the selector's bytes itself.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from agent.host.tc import (
    CLSACT_INGRESS,
    DEFAULT_ROOTS,
    ETH_P_ALL,
    ETH_P_IP,
    ETH_P_IPV6,
    IFB_NAME,
    LEAF,
    LIMITED,
    OUR_PRIOS,
    PRIO_REDIRECT,
    PRIO_V4,
    PRIO_V6,
    QUANTUM,
    ROOT,
    DeviceShaping,
    Exemption,
    IfbState,
    Link,
    ShaperCounters,
    TcError,
    TcPort,
    TcState,
    burst_bytes,
    queue_bytes,
)
from agent.host.tc_stats import ClassCounters


def _u32_keys(sel: Any) -> tuple[tuple[int, int, int], ...]:
    """(mask, value, offset) of each key of a decoded TCA_U32_SEL, read from its bytes (see module doc)."""
    data, start = sel.data, sel.offset
    nkeys = data[start + 4 + 2]  # nla header (4), then flags, offshift, nkeys
    keys = []
    for i in range(nkeys):
        at = start + 20 + 16 * i
        mask, value = struct.unpack_from(">II", data, at)  # network order
        (offset,) = struct.unpack_from("=i", data, at + 8)  # host order
        keys.append((mask, value, offset))
    return tuple(keys)


def _kind(msg: Any) -> str:
    return str(msg.get_attr("TCA_KIND") or "")


class NetlinkTc:
    """`TcPort` through pyroute2, in this namespace or a named one (`ip netns` name, tests and benches)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._socket: Any = None
        self._classes: ClassCounters | None = None

    @property
    def _ipr(self) -> Any:
        """The socket, opened on first use: pyroute2's synchronous IPRoute drives an asyncio loop of its own, so
        it must be made in the worker thread that uses it, never where the agent's loop runs."""
        if self._socket is None:
            from pyroute2 import IPRoute
            from pyroute2.netlink.rtnl.tcmsg import plugins, sched_pfifo

            # pyroute2 has no bfifo module; the kernel's bfifo takes the same tc_fifo_qopt (limit in bytes).
            plugins.setdefault("bfifo", sched_pfifo)
            self._socket = IPRoute(netns=self.netns) if self.netns else IPRoute()
        return self._socket

    def close(self) -> None:
        """Release the netlink socket."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._classes is not None:
            self._classes.close()
            self._classes = None

    def _call(self, what: str, *args: Any, **kwargs: Any) -> Any:
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            return self._ipr.tc(*args, **kwargs)
        except NetlinkError as exc:
            raise TcError(f"{what}: {exc}") from exc

    # -- finding interfaces ------------------------------------------------------------------------------------

    def _link(self, msg: Any) -> Link:
        info = msg.get_attr("IFLA_LINKINFO")
        kind = info.get_attr("IFLA_INFO_KIND") if info is not None else None
        return Link(int(msg["index"]), str(msg.get_attr("IFLA_IFNAME")), str(kind or ""))

    def link(self, index: int) -> Link | None:
        """The interface with this index, None if gone."""
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            return self._link(self._ipr.get_links(index)[0])
        except (NetlinkError, IndexError):
            return None

    def host_interface(self, ip: str) -> Link | None:
        """Routed CNIs: the route's output device. Bridge CNIs: the route points at the bridge; the pod's MAC
        comes from the bridge's neighbour entry and its port from the bridge forwarding database."""
        from pyroute2.netlink.exceptions import NetlinkError

        address = ipaddress.ip_address(ip)
        try:
            route = self._ipr.route("get", dst=str(address))
        except NetlinkError:
            return None
        if not route or route[0].get_attr("RTA_GATEWAY"):
            return None  # not on a local interface (yet): the default route, or another node's pod
        oif = route[0].get_attr("RTA_OIF")
        device = self.link(oif) if oif else None
        if device is None or device.kind != "bridge":
            return device
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        mac = next((n.get_attr("NDA_LLADDR") for n in self._ipr.get_neighbours(family=family, ifindex=device.index)
                    if n.get_attr("NDA_DST") == str(address) and n.get_attr("NDA_LLADDR")), None)
        if mac is None:
            return None  # not resolved yet; the caller retries
        for entry in self._ipr.fdb("dump", master=device.index):
            if entry.get_attr("NDA_LLADDR") == mac and entry.get_attr("NDA_MASTER") == device.index:
                return self.link(int(entry["ifindex"]))
        return None

    # -- reading -----------------------------------------------------------------------------------------------

    def _filters(self, index: int, parent: int) -> list[Any]:
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            return [f for f in self._ipr.get_filters(index=index, parent=parent) if f.get_attr("TCA_OPTIONS")]
        except NetlinkError:
            return []

    def _exempt(self, filters: Iterable[Any]) -> frozenset[Exemption]:
        found = set()
        for f in filters:
            prio = f["info"] >> 16
            sel = f.get_attr("TCA_OPTIONS").get_attr("TCA_U32_SEL")
            if prio in (PRIO_V4, PRIO_V6) and sel is not None:
                found.add(Exemption(4 if prio == PRIO_V4 else 6, _u32_keys(sel)))
        return frozenset(found)

    def _redirect(self, filters: Iterable[Any]) -> int | None:
        for f in filters:
            if f["info"] >> 16 != PRIO_REDIRECT:
                continue
            actions = f.get_attr("TCA_OPTIONS").get_attr("TCA_U32_ACT")
            for _, action in (actions or {}).get("attrs", []):
                parms = action.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
                if parms is not None:
                    return int(parms["ifindex"])
        return None

    def _rate(self, index: int) -> int | None:
        for cls in self._ipr.get_classes(index=index):
            if cls["handle"] == LIMITED:
                options = cls.get_attr("TCA_OPTIONS")
                rate64 = options.get_attr("TCA_HTB_RATE64")
                return int(rate64 if rate64 else options.get_attr("TCA_HTB_PARMS")["rate"]) * 8
        return None

    def _describe(self, index: int, qdiscs: Sequence[Any]) -> DeviceShaping:
        root = next((q for q in qdiscs if q["parent"] == 0xFFFFFFFF), None)
        hook = next((q for q in qdiscs if q["parent"] == 0xFFFFFFF1), None)
        foreign: list[str] = []
        ours_root = root is not None and root["handle"] == ROOT and _kind(root) == "htb"
        if root is not None and not ours_root and _kind(root) not in DEFAULT_ROOTS:
            foreign.append(f"root qdisc {_kind(root)} {root['handle'] >> 16:x}:")
        download, down_exempt, leaf = None, frozenset[Exemption](), False
        if ours_root:
            download = self._rate(index)
            down_exempt = self._exempt(self._filters(index, ROOT))
            leaf = any(q["parent"] == LIMITED and q["handle"] == LEAF for q in qdiscs)
        upload, up_exempt = None, frozenset[Exemption]()
        if hook is not None:
            filters = self._filters(index, CLSACT_INGRESS)
            others = sorted({f["info"] >> 16 for f in filters} - set(OUR_PRIOS))
            if others or _kind(hook) != "clsact":
                foreign.append(f"{_kind(hook)} hook with filters at priorities {others}")
            upload, up_exempt = self._redirect(filters), self._exempt(filters)
        return DeviceShaping(download, down_exempt, leaf, upload, up_exempt, "; ".join(foreign))

    def device(self, index: int) -> DeviceShaping:
        """One interface's shaping objects, foreign owners included."""
        return self._describe(index, self._dump().get(index, []))

    def _dump(self) -> dict[int, list[Any]]:
        """Every qdisc of the namespace by ifindex: one request (the kernel dumps all devices' qdiscs whatever
        index is asked for, so per-device qdisc reads would cost a full dump each)."""
        by_index: dict[int, list[Any]] = {}
        for q in self._ipr.get_qdiscs():
            by_index.setdefault(int(q["index"]), []).append(q)
        return by_index

    def read(self) -> TcState:
        """One qdisc dump and one link dump, then per-interface detail only where a root or hook is not default."""
        by_index = self._dump()
        state = TcState(counters=self._leaf_counters(by_index))
        raw = list(self._ipr.get_links())
        links = {link.index: link for link in map(self._link, raw)}
        flags = {int(msg["index"]): int(msg["flags"]) for msg in raw}
        for link in links.values():
            if link.kind == "ifb" and IFB_NAME.match(link.name):
                qdiscs = by_index.get(link.index, [])
                ours = any(q["handle"] == ROOT and q["parent"] == 0xFFFFFFFF for q in qdiscs)
                leaf = any(q["handle"] == LEAF and q["parent"] == LIMITED for q in qdiscs)
                up = bool(flags[link.index] & 1)  # IFF_UP
                state.ifbs[link.name] = IfbState(link.name, link.index, self._rate(link.index) if ours else None,
                                                 leaf, up)
        for index, qdiscs in by_index.items():
            found = links.get(index)
            if found is None or found.kind == "ifb":
                continue
            root = next((q for q in qdiscs if q["parent"] == 0xFFFFFFFF), None)
            hook = any(q["parent"] == 0xFFFFFFF1 for q in qdiscs)
            if hook or (root is not None and (root["handle"] == ROOT or _kind(root) not in DEFAULT_ROOTS)):
                shaping = self._describe(index, qdiscs)
                if shaping.download_bps is not None or shaping.upload_ifb is not None or shaping.upload_exempt:
                    state.devices[index] = shaping
                elif shaping.foreign:
                    state.foreign[index] = shaping.foreign
        return state

    def _leaf_counters(self, by_index: dict[int, list[Any]]) -> dict[int, ShaperCounters]:
        out: dict[int, ShaperCounters] = {}
        for index, qdiscs in by_index.items():
            for q in qdiscs:
                if q["handle"] == LEAF and q["parent"] == LIMITED:
                    stats = q.get_attr("TCA_STATS2")
                    basic = stats.get_attr("TCA_STATS_BASIC") if stats else None
                    queue = stats.get_attr("TCA_STATS_QUEUE") if stats else None
                    out[index] = ShaperCounters(int(basic["bytes"]) if basic else 0,
                                                int(queue["drops"]) if queue else 0)
        return out

    def counters(self, indexes: Iterable[int]) -> dict[int, ShaperCounters]:
        """The limited classes' counters of these interfaces only (`agent.host.tc_stats`: no pyroute2)."""
        if self._classes is None:
            self._classes = ClassCounters(self.netns)
        return self._classes.read(indexes)

    # -- changing ----------------------------------------------------------------------------------------------

    def _install_htb(self, index: int, rate_bps: int) -> None:
        burst = burst_bytes(rate_bps)
        rate = f"{rate_bps}bit"
        self._call("HTB root", "add", "htb", index=index, handle=ROOT, default=1)
        self._call("HTB class", "add-class", "htb", index=index, handle=LIMITED, parent=ROOT, rate=rate,
                   ceil=rate, burst=burst, cburst=burst, quantum=QUANTUM)
        self._call("bfifo leaf", "add", "bfifo", index=index, handle=LEAF, parent=LIMITED,
                   limit=queue_bytes(rate_bps))

    def _add_exemptions(self, index: int, parent: int, exempt: Sequence[Exemption], target: int) -> None:
        for item in exempt:
            keys = [f"0x{value:x}/0x{mask:x}+{offset}" for mask, value, offset in item.words]
            self._call(f"u32 exemption {keys}", "add-filter", "u32", index=index, parent=parent,
                       prio=PRIO_V4 if item.family == 4 else PRIO_V6,
                       protocol=ETH_P_IP if item.family == 4 else ETH_P_IPV6, target=target, keys=keys)

    def shape_download(self, index: int, rate_bps: int, exempt: Sequence[Exemption]) -> None:
        """Replace whatever of ours is at the root, then HTB, class, leaf and the exemption filters."""
        self.unshape_download(index)
        self._install_htb(index, rate_bps)
        # classid = the HTB's own handle means "direct": the packet skips every class (unshaped)
        self._add_exemptions(index, ROOT, exempt, ROOT)

    def set_download_rate(self, index: int, rate_bps: int) -> None:
        """Change the limited class (and the leaf's byte limit) in place."""
        burst = burst_bytes(rate_bps)
        rate = f"{rate_bps}bit"
        self._call("HTB class", "replace-class", "htb", index=index, handle=LIMITED, parent=ROOT, rate=rate,
                   ceil=rate, burst=burst, cburst=burst, quantum=QUANTUM)
        self._call("bfifo leaf", "replace", "bfifo", index=index, handle=LEAF, parent=LIMITED,
                   limit=queue_bytes(rate_bps))

    def unshape_download(self, index: int) -> None:
        """Remove our HTB root (and everything under it). The request names our handle, so the kernel refuses it
        for a root that is not ours (EINVAL) and there is none to remove (ENOENT): both mean nothing of ours."""
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            self._ipr.tc("del", "htb", index=index, handle=ROOT, parent=0xFFFFFFFF)
        except NetlinkError as exc:
            if exc.code not in (errno.ENOENT, errno.EINVAL):
                raise TcError(f"HTB root removal: {exc}") from exc

    def ensure_ifb(self, name: str, rate_bps: int) -> int:
        """Create, bring up (txqueuelen 1000: a new IFB has 32) and shape the IFB; its index."""
        from pyroute2.netlink.exceptions import NetlinkError

        if not IFB_NAME.match(name):
            raise TcError(f"refusing IFB name {name!r}: not one of ours")
        try:
            found = self._ipr.link_lookup(ifname=name)
            if not found:
                self._ipr.link("add", ifname=name, kind="ifb")
                found = self._ipr.link_lookup(ifname=name)
            index = int(found[0])
            self._ipr.link("set", index=index, state="up", txqlen=1000)
        except NetlinkError as exc:
            raise TcError(f"IFB {name}: {exc}") from exc
        current = self._rate(index)  # our limited class exists only under our root
        if current is None:
            self.unshape_download(index)
            self._install_htb(index, rate_bps)
        elif current != rate_bps:
            self.set_download_rate(index, rate_bps)
        return index

    def shape_upload(self, index: int, ifb_index: int, exempt: Sequence[Exemption]) -> None:
        """clsact on the interface; exemptions first (no action: the packet goes on), then the redirect."""
        from pyroute2.netlink.exceptions import NetlinkError

        self._remove_our_filters(index)
        try:
            self._ipr.tc("add", "clsact", index=index)
        except NetlinkError as exc:
            if exc.code != errno.EEXIST:  # already there (ours; a foreign hook was ruled out by the caller)
                raise TcError(f"clsact: {exc}") from exc
        # The classid of a clsact filter selects nothing; pyroute2 requires one, so it is our root's handle.
        self._add_exemptions(index, CLSACT_INGRESS, exempt, ROOT)
        self._call("upload redirect", "add-filter", "u32", index=index, parent=CLSACT_INGRESS, prio=PRIO_REDIRECT,
                   protocol=ETH_P_ALL, target=ROOT, keys=["0x0/0x0+0"],
                   action={"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": ifb_index})

    def _remove_our_filters(self, index: int) -> set[int]:
        """Delete our priorities from the ingress hook (the redirect first: an exemption-less moment is harmless,
        a redirect without exemptions is not); the priorities left, which are someone else's."""
        prios = {f["info"] >> 16 for f in self._filters(index, CLSACT_INGRESS)}
        for prio in sorted(prios & set(OUR_PRIOS), reverse=True):
            protocol = ETH_P_ALL if prio == PRIO_REDIRECT else ETH_P_IP if prio == PRIO_V4 else ETH_P_IPV6
            self._call("ingress filter removal", "del-filter", "u32", index=index, parent=CLSACT_INGRESS, prio=prio,
                       target=ROOT, protocol=protocol)
        return prios - set(OUR_PRIOS)

    def unshape_upload(self, index: int) -> None:
        """Delete our filters; the clsact hook too when nothing else is on it (by kind: an `ingress` qdisc is
        never removed)."""
        from pyroute2.netlink.exceptions import NetlinkError

        if self._remove_our_filters(index):
            return
        try:
            self._ipr.tc("del", "clsact", index=index)
        except NetlinkError as exc:
            if exc.code not in (errno.ENOENT, errno.EINVAL):
                raise TcError(f"clsact removal: {exc}") from exc

    def delete_ifb(self, name: str) -> None:
        """Delete one of our IFBs by name."""
        from pyroute2.netlink.exceptions import NetlinkError

        if not IFB_NAME.match(name):
            raise TcError(f"refusing to delete {name!r}: not one of our IFBs")
        try:
            for index in self._ipr.link_lookup(ifname=name):
                self._ipr.link("del", index=index)
        except NetlinkError as exc:
            raise TcError(f"IFB {name} removal: {exc}") from exc


if TYPE_CHECKING:  # mypy checks the implementation against the port
    _PORT: TcPort = NetlinkTc()
