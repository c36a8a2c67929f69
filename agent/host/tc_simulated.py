"""An in-memory `TcPort`: interfaces, routes, a bridge's neighbour and forwarding entries, and shapers.

It follows the kernel's published behaviour where shaping depends on it: deleting an interface deletes its
qdiscs and filters but not the IFB its redirect points at; `clsact` and `ingress` exclude each other; a root
qdisc or hook filters that are not ours are reported as foreign. Tests add traffic to the shapers' counters
(`add_traffic`) and make the next call of a named operation fail (`fail`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.host.tc import IFB_NAME, DeviceShaping, Exemption, IfbState, Link, ShaperCounters, TcError, TcPort, TcState


@dataclass
class _Device:
    link: Link
    up: bool = True
    download: tuple[int, frozenset[Exemption]] | None = None
    upload: tuple[int, frozenset[Exemption]] | None = None
    foreign_root: str = ""  # a root qdisc kind that is not ours
    foreign_hook: str = ""  # hook kind + filters not ours
    counters: ShaperCounters = field(default_factory=ShaperCounters)


class SimulatedTc:
    """`TcPort` over an in-memory network namespace."""

    def __init__(self) -> None:
        self._devices: dict[int, _Device] = {}
        self._next_index = 2
        self._routes: dict[str, int] = {}  # pod IP -> routed device (a veth, or a bridge)
        self._neighbours: dict[tuple[int, str], str] = {}  # (bridge, IP) -> MAC
        self._fdb: dict[tuple[int, str], int] = {}  # (bridge, MAC) -> port
        self._failures: dict[str, int] = {}
        self.calls: list[str] = []  # every changing operation, in order (tests check what was done)

    # -- building the simulated node -------------------------------------------------------------------------------

    def add_link(self, name: str, kind: str = "veth") -> int:
        """A new interface; its index."""
        index = self._next_index
        self._next_index += 1
        self._devices[index] = _Device(Link(index, name, kind))
        return index

    def remove_link(self, index: int) -> None:
        """The interface goes away with its qdiscs and filters (an IFB it redirected to stays)."""
        self._devices.pop(index, None)
        self._routes = {ip: dev for ip, dev in self._routes.items() if dev != index}
        self._fdb = {key: port for key, port in self._fdb.items() if port != index}

    def route(self, ip: str, index: int) -> None:
        """A route to a pod IP through a device (a routed veth or a bridge)."""
        self._routes[ipaddress.ip_address(ip).compressed] = index

    def bridge_entry(self, bridge: int, ip: str, mac: str, port: int) -> None:
        """The bridge's neighbour entry for `ip` and its forwarding entry for `mac` on `port`."""
        self._neighbours[(bridge, ipaddress.ip_address(ip).compressed)] = mac
        self._fdb[(bridge, mac)] = port

    def set_foreign(self, index: int, root: str = "", hook: str = "") -> None:
        """Someone else's root qdisc or ingress-hook filters on the interface (a CNI plugin, eBPF programs)."""
        device = self._devices[index]
        device.foreign_root, device.foreign_hook = root, hook

    def add_traffic(self, index: int, octets: int, drops: int = 0) -> None:
        """Traffic through the limited class of the shaper on `index` (a pod interface or an IFB)."""
        device = self._devices[index]
        device.counters = ShaperCounters(device.counters.bytes + octets, device.counters.drops + drops)

    def fail(self, operation: str, times: int = 1) -> None:
        """The next `times` calls of `operation` (a TcPort method name) raise TcError."""
        self._failures[operation] = times

    def _change(self, operation: str, index: int | str) -> None:
        if self._failures.get(operation):
            self._failures[operation] -= 1
            raise TcError(f"{operation} {index}: simulated failure")
        self.calls.append(f"{operation} {index}")

    def _device(self, index: int) -> _Device:
        if index not in self._devices:
            raise TcError(f"interface {index}: No such device")
        return self._devices[index]

    # -- the port --------------------------------------------------------------------------------------------------

    def host_interface(self, ip: str) -> Link | None:
        """The routed device, or for a bridge the port holding the pod's MAC."""
        address = ipaddress.ip_address(ip).compressed
        index = self._routes.get(address)
        if index is None or index not in self._devices:
            return None
        device = self._devices[index].link
        if device.kind != "bridge":
            return device
        mac = self._neighbours.get((index, address))
        port = self._fdb.get((index, mac)) if mac else None
        return self._devices[port].link if port in self._devices else None

    def link(self, index: int) -> Link | None:
        """The interface with this index, None if gone."""
        device = self._devices.get(index)
        return device.link if device else None

    def device(self, index: int) -> DeviceShaping:
        """One interface's shaping objects, foreign owners included."""
        device = self._devices.get(index)
        if device is None:
            return DeviceShaping()
        foreign = "; ".join(x for x in (device.foreign_root and f"root qdisc {device.foreign_root}",
                                         device.foreign_hook and f"{device.foreign_hook} hook") if x)
        down, up = device.download, device.upload
        return DeviceShaping(down[0] if down else None, down[1] if down else frozenset(), down is not None,
                             up[0] if up else None, up[1] if up else frozenset(), foreign)

    def read(self) -> TcState:
        """Our objects everywhere, with counters."""
        if self._failures.get("read"):
            self._failures["read"] -= 1
            raise TcError("read: simulated failure")
        state = TcState()
        for index, device in self._devices.items():
            if device.link.kind == "ifb":
                if IFB_NAME.match(device.link.name):
                    rate = device.download[0] if device.download else None
                    state.ifbs[device.link.name] = IfbState(device.link.name, index, rate, rate is not None,
                                                            device.up)
            elif device.download or device.upload:
                state.devices[index] = self.device(index)
            elif device.foreign_root or device.foreign_hook:
                state.foreign[index] = self.device(index).foreign
            if device.download:
                state.counters[index] = device.counters
        return state

    def counters(self, indexes: Iterable[int]) -> dict[int, ShaperCounters]:
        """Leaf counters of these interfaces, by ifindex."""
        if self._failures.get("read"):
            self._failures["read"] -= 1
            raise TcError("read: simulated failure")
        return {i: self._devices[i].counters for i in set(indexes)
                if i in self._devices and self._devices[i].download is not None}

    def shape_download(self, index: int, rate_bps: int, exempt: Sequence[Exemption]) -> None:
        """Replace our download shaper."""
        device = self._device(index)
        self._change("shape_download", index)
        if device.foreign_root:
            raise TcError(f"interface {index}: root qdisc {device.foreign_root} exists (File exists)")
        device.download = (rate_bps, frozenset(exempt))
        device.counters = ShaperCounters()

    def set_download_rate(self, index: int, rate_bps: int) -> None:
        """Change the rate in place; counters kept."""
        device = self._device(index)
        self._change("set_download_rate", index)
        if device.download is None:
            raise TcError(f"interface {index}: no shaper to change")
        device.download = (rate_bps, device.download[1])

    def unshape_download(self, index: int) -> None:
        """Remove our download shaper."""
        device = self._device(index)
        self._change("unshape_download", index)
        device.download = None

    def ensure_ifb(self, name: str, rate_bps: int) -> int:
        """Create (or find) the IFB, bring it up and shape it."""
        if not IFB_NAME.match(name):
            raise TcError(f"refusing IFB name {name!r}: not one of ours")
        self._change("ensure_ifb", name)
        index = next((i for i, d in self._devices.items() if d.link.name == name), None)
        if index is None:
            index = self.add_link(name, "ifb")
        device = self._devices[index]
        device.up = True
        device.download = (rate_bps, frozenset())
        return index

    def shape_upload(self, index: int, ifb_index: int, exempt: Sequence[Exemption]) -> None:
        """Redirect from the ingress hook to the IFB, exemptions first."""
        device = self._device(index)
        self._change("shape_upload", index)
        if device.foreign_hook:
            raise TcError(f"interface {index}: {device.foreign_hook} owns the ingress hook")
        device.upload = (ifb_index, frozenset(exempt))

    def unshape_upload(self, index: int) -> None:
        """Remove our redirect and exemptions."""
        device = self._device(index)
        self._change("unshape_upload", index)
        device.upload = None

    def delete_ifb(self, name: str) -> None:
        """Delete one of our IFBs."""
        if not IFB_NAME.match(name):
            raise TcError(f"refusing to delete {name!r}: not one of our IFBs")
        self._change("delete_ifb", name)
        for index in [i for i, d in self._devices.items() if d.link.name == name]:
            self.remove_link(index)

    def close(self) -> None:
        """Nothing to release."""


if TYPE_CHECKING:  # mypy checks the twin against the port it stands in for
    _PORT: TcPort = SimulatedTc()
