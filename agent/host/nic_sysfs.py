"""One pass over the kernel's NIC and PCIe health files: InfiniBand/RoCE port counters, PCIe link widths, AER.

Everything is read from sysfs under a root (`/sys`, or a simulated tree whose files tests and `run --simulate`
rewrite), in the kernel's formats (Linux drivers/infiniband/core/sysfs.c, drivers/pci/pci-sysfs.c,
drivers/pci/pcie/aer.c):

- `class/infiniband/<dev>/ports/<n>/{state,phys_state,rate}` ("4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)")
  and the counters in `counters/` (PMA, decimal, most saturate at 4/8/16 bits) and `hw_counters/` (driver).
  Only the counters health judges or exports are read: each read is a MAD to the HCA on real hardware.
- `bus/pci/devices/<bdf>/{current,max}_link_{width,speed}` ("16", "16.0 GT/s PCIe"; "Unknown" or 0 = no link).
- `bus/pci/devices/<bdf>/aer_dev_{fatal,nonfatal,correctable}`: lines "<Name> <count>", ending "TOTAL_ERR_*".

Judging the values is health's job (`agent.health.nic_counters`); this module only reads, and says which files
it could not read, so a check that cannot look never passes for a healthy one.
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

#: PMA counters health judges or exports (`counters/`).
PORT_COUNTERS = ("link_downed", "link_error_recovery", "symbol_error", "port_rcv_errors",
                 "local_link_integrity_errors", "excessive_buffer_overrun_errors", "port_xmit_discards",
                 "port_rcv_remote_physical_errors")
#: Driver counters (`hw_counters/`, mlx5); absent ones (ConnectX generation, firmware) are skipped.
HW_COUNTERS = ("rnr_nak_retry_err", "local_ack_timeout_err", "roce_slow_restart", "req_transport_retries_exceeded")
AER_KINDS = ("fatal", "nonfatal", "correctable")
_AER_TOTAL = {"fatal": "TOTAL_ERR_FATAL", "nonfatal": "TOTAL_ERR_NONFATAL", "correctable": "TOTAL_ERR_COR"}
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_RATE = re.compile(r"^\s*([0-9.]+)\s*Gb/sec")


@dataclass(frozen=True)
class PortReading:
    """One RDMA port: state names ("ACTIVE", "LinkUp"), rate in Gb/s, and counter values by file name."""

    device: str
    port: int
    state: str = ""
    phys_state: str = ""
    rate_gbps: float | None = None
    link_layer: str = ""
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PcieLink:
    """Link width (lanes) and speed of one PCI function; None where the file is missing or says Unknown."""

    bus_id: str
    current_width: int | None = None
    max_width: int | None = None
    current_speed: float | None = None  # GT/s
    max_speed: float | None = None


@dataclass(frozen=True)
class CounterPass:
    """Everything one pass read. `missing`: what should have been there and could not be read (why)."""

    ports: tuple[PortReading, ...] = ()
    links: tuple[PcieLink, ...] = ()
    aer: dict[str, dict[str, int]] = field(default_factory=dict)  # bus id -> kind -> TOTAL_ERR_* value
    present: frozenset[str] = frozenset()  # PCI functions asked about whose directory exists
    missing: dict[str, str] = field(default_factory=dict)  # "mlx5_0/1" or a bus id -> why unreadable


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


class OpenFiles:
    """Sysfs files kept open between passes and re-read with one `pread` at offset 0.

    A sysfs attribute regenerates its text on every read from offset 0, and opening it (the path walk) costs
    about 30 times the read, so a pass keeps its files open. A file that went away is noticed either way: sysfs
    answers ENODEV for a removed device, and a plain file (a simulated tree) shows no links left after an unlink;
    both are closed and opened again by path, which then fails. At most `limit` files are kept (fds are a
    process-wide budget); beyond that a read opens and closes.
    """

    def __init__(self, limit: int | None = None) -> None:
        if limit is None:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            limit = max(0, min(2048, soft // 4)) if soft != resource.RLIM_INFINITY else 2048
        self.limit = limit
        self._fds: dict[str, int] = {}

    def read(self, path: str) -> str | None:
        """The file's text now, or None when it cannot be read."""
        fd = self._fds.get(path)
        if fd is not None:
            try:
                if os.fstat(fd).st_nlink > 0:
                    return os.pread(fd, 4096, 0).decode("ascii", "replace")
            except OSError:
                pass
            self._drop(path)
        if len(self._fds) >= self.limit:
            return _read(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            text = os.pread(fd, 4096, 0).decode("ascii", "replace")
        except OSError:
            os.close(fd)
            return None
        self._fds[path] = fd
        return text

    def _drop(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close every kept file."""
        for path in list(self._fds):
            self._drop(path)

    def __len__(self) -> int:
        return len(self._fds)


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _speed(text: str | None) -> float | None:
    """"16.0 GT/s PCIe" or (kernels <= 5.6) "16 GT/s" -> 16.0; "Unknown" -> None."""
    if not text:
        return None
    head = text.strip().split(" ", 1)[0]
    try:
        return float(head)
    except ValueError:
        return None


def _state_name(text: str | None) -> str:
    """"4: ACTIVE" -> "ACTIVE" (match the number's name, the kernel prints "%d: %s")."""
    return text.split(":", 1)[-1].strip() if text else ""


def parse_aer(text: str, kind: str) -> int | None:
    """The TOTAL_ERR_* line of an `aer_dev_<kind>` file; None when the file has none."""
    total = _AER_TOTAL[kind]
    for line in text.splitlines():
        name, _, value = line.strip().rpartition(" ")
        if name == total:
            return _int(value)
    return None


class NicSysfs:
    """Reads one health pass from a sysfs root. Counter file lists are found once per port and kept."""

    def __init__(self, sysfs_root: str | os.PathLike[str]) -> None:
        self.root = str(sysfs_root)
        self._counter_files: dict[tuple[str, int], tuple[tuple[str, str], ...]] = {}
        self._ports: dict[str, tuple[int, ...]] = {}
        self._upstream: dict[str, tuple[str, ...]] = {}
        self._link_layer: dict[tuple[str, int], str] = {}
        self.files = OpenFiles()

    def close(self) -> None:
        """Close the files kept open between passes."""
        self.files.close()

    def ports(self, device: str) -> tuple[int, ...]:
        """Port numbers of an RDMA device (cached; () when it has none or is gone)."""
        if device not in self._ports:
            try:
                names = os.listdir(f"{self.root}/class/infiniband/{device}/ports")
            except OSError:
                return ()
            self._ports[device] = tuple(sorted(int(n) for n in names if n.isdigit()))
        return self._ports[device]

    def upstream_ports(self, bus_id: str) -> tuple[str, ...]:
        """Bridges between a function and its root complex, nearest first (from the sysfs device path)."""
        if bus_id not in self._upstream:
            try:
                real = Path(os.path.realpath(f"{self.root}/bus/pci/devices/{bus_id}"))
            except OSError:
                return ()
            chain = [p.name for p in real.parents if _BDF.match(p.name)]
            self._upstream[bus_id] = tuple(chain)
        return self._upstream[bus_id]

    def _files(self, device: str, port: int) -> tuple[tuple[str, str], ...]:
        key = (device, port)
        if key not in self._counter_files:
            base = f"{self.root}/class/infiniband/{device}/ports/{port}"
            found = []
            for sub, names in (("counters", PORT_COUNTERS), ("hw_counters", HW_COUNTERS)):
                try:
                    there = set(os.listdir(f"{base}/{sub}"))
                except OSError:
                    continue
                found += [(name, f"{base}/{sub}/{name}") for name in names if name in there]
            self._counter_files[key] = tuple(found)
        return self._counter_files[key]

    def read_port(self, device: str, port: int) -> tuple[PortReading | None, str]:
        """One port's state and counters; (None, why) when its state cannot be read."""
        base = f"{self.root}/class/infiniband/{device}/ports/{port}"
        state = self.files.read(f"{base}/state")
        if state is None:
            self._counter_files.pop((device, port), None)
            self._ports.pop(device, None)
            return None, f"cannot read {base}/state"
        rate = _RATE.match(self.files.read(f"{base}/rate") or "")
        counters: dict[str, int] = {}
        files = self._files(device, port)
        for name, path in files:
            value = _int(self.files.read(path))
            if value is not None:
                counters[name] = value
        if files and not counters:
            self._counter_files.pop((device, port), None)
            return None, f"cannot read the counters under {base}"
        name = _state_name(state).upper()
        if (device, port) not in self._link_layer:  # fixed for the port's life; the others change
            self._link_layer[(device, port)] = (self.files.read(f"{base}/link_layer") or "").strip()
        physical = "LinkUp" if name == "ACTIVE" else _state_name(self.files.read(f"{base}/phys_state"))
        return PortReading(device, port, name, physical, float(rate.group(1)) if rate else None,
                           self._link_layer[(device, port)], counters), ""

    def read_link(self, bus_id: str, speed: bool = True) -> PcieLink | None:
        """Link width (and speed) of a function; None when its directory is gone."""
        base = f"{self.root}/bus/pci/devices/{bus_id}"
        width = self.files.read(f"{base}/current_link_width")
        if width is None and not os.path.isdir(base):
            return None
        if not speed:
            return PcieLink(bus_id, _int(width), _int(self.files.read(f"{base}/max_link_width")))
        read = self.files.read
        return PcieLink(bus_id, _int(width), _int(read(f"{base}/max_link_width")),
                        _speed(read(f"{base}/current_link_speed")), _speed(read(f"{base}/max_link_speed")))

    def read_aer(self, bus_id: str) -> dict[str, int]:
        """TOTAL_ERR_* per kind; {} when AER files are absent (AER off, firmware-first)."""
        found: dict[str, int] = {}
        for kind in AER_KINDS:
            text = self.files.read(f"{self.root}/bus/pci/devices/{bus_id}/aer_dev_{kind}")
            value = parse_aer(text, kind) if text is not None else None
            if value is not None:
                found[kind] = value
        return found

    def modules_loaded(self, *names: str) -> tuple[str, ...]:
        """Which of these kernel modules are loaded (`module/<name>` exists; `nvidia_peermem`, `gdrdrv`)."""
        return tuple(name for name in names if os.path.isdir(f"{self.root}/module/{name}"))

    def read_pass(self, rdma_devices: Iterable[str], functions: Iterable[str]) -> CounterPass:
        """Every port of these RDMA devices, and link plus AER of these PCI functions (and their upstream ports)."""
        ports: list[PortReading] = []
        missing: dict[str, str] = {}
        for device in rdma_devices:
            numbers = self.ports(device)
            if not numbers:
                missing[device] = f"no ports under {self.root}/class/infiniband/{device}"
            for number in numbers:
                reading, why = self.read_port(device, number)
                if reading is None:
                    missing[f"{device}/{number}"] = why
                else:
                    ports.append(reading)
        endpoints = list(dict.fromkeys(functions))
        wanted = list(endpoints)
        for bus_id in endpoints:
            wanted.extend(b for b in self.upstream_ports(bus_id) if b not in wanted)
        links: list[PcieLink] = []
        aer: dict[str, dict[str, int]] = {}
        present: set[str] = set()
        for i, bus_id in enumerate(wanted):
            link = self.read_link(bus_id, speed=i < len(endpoints))  # bridges: width only (speed is exported)
            if link is None:
                continue
            present.add(bus_id)
            links.append(link)
            counts = self.read_aer(bus_id)
            if counts:
                aer[bus_id] = counts
        return CounterPass(tuple(ports), tuple(links), aer, frozenset(present), missing)
