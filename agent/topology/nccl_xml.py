"""Device locations from an NCCL topology XML file (`NCCL_TOPO_FILE`), merged over what sysfs shows.

Why: cloud VMs hide the real PCIe tree. On Azure ND-series (Hyper-V) every passed-through GPU and NIC sits
in its own PCI domain, so sysfs gives each device its own root and GPU n / NIC n look no closer than any
other pair. The vendor publishes an NCCL topology XML that restores the pairing (ND H100 v5: per `cpu`,
four synthetic bridges `ffff:ff:01.0`..`08.0`, each holding one GPU and one NIC); NCCL reads it, and so
do we, so that the agent's allocation agrees with what NCCL will do.

Mapping to NCCL's tree (src/graph/topo.cc):
- a `cpu` element is a root: `Location.root` is `cpu<numaid>` (or `cpu#<index>` when numaid is absent,
  -1 or repeated) and `Location.numa` is its numaid (None when missing or -1);
- every `pci` element that encloses a device is a bridge on its path; `Location.switches` lists them from
  the cpu down to the device's nearest one. Synthetic bus ids repeat under different cpus, so a switch is
  named `<root>/<busid>` and two devices share a switch only when they share the element;
- a device is a `pci` element without `pci` children: a GPU when its class is 0x03xxxx or it holds `gpu`,
  a NIC when its class is 0x02xxxx or it holds `nic` (RDMA names from its `net` elements);
- a `nic` directly under a `cpu` has no bus id; it is known by its `net` names only.
`Location.level_to` then gives PIX on one bridge, PXB through nested bridges, PHB under one cpu, SYS
across cpus, as NCCL computes it.
"""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.config.files import read_regular
from agent.host.busid import BusIdError, normalize_bus_id
from agent.topology.model import Location, Topology

log = logging.getLogger(__name__)

SOURCE = "sysfs+nccl-xml"


MAX_FILE_BYTES = 16 << 20  # an NCCL topology of the largest node is tens of KiB
MAX_PCI_DEPTH = 32


class TopologyXmlError(ValueError):
    """An NCCL topology XML file that cannot be read or does not describe a topology."""


@dataclass(frozen=True)
class NcclXmlTopology:
    """What an NCCL topology XML says about device placement. Bus ids are canonical (`dddd:bb:dd.f`)."""

    locations: dict[str, Location] = field(default_factory=dict)
    gpus: tuple[str, ...] = ()
    nics: dict[str, tuple[str, ...]] = field(default_factory=dict)
    nics_without_bus_id: dict[str, Location] = field(default_factory=dict)
    origin: str = "<text>"


def _read(path_or_text: str | Path) -> tuple[str, str]:
    """(origin, text): a Path or a string not starting with `<` is a file name, anything else XML text."""
    if isinstance(path_or_text, str) and path_or_text.lstrip().startswith("<"):
        return "<text>", path_or_text
    origin = str(path_or_text)
    try:
        raw = read_regular(path_or_text, MAX_FILE_BYTES)  # a FIFO never answers an open; /dev/zero never ends
        if len(raw) > MAX_FILE_BYTES:
            raise TopologyXmlError(f"{origin}: larger than {MAX_FILE_BYTES} bytes: not an NCCL topology file")
        return origin, raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyXmlError(f"{origin}: cannot read NCCL topology file: {exc}") from None


def _describe(chain: list[ET.Element]) -> str:
    """Human path to an element, e.g. `system > cpu[numaid=0] > pci[ffff:ff:01.0] > pci`."""
    parts = []
    for elem in chain:
        attr = {"pci": "busid", "cpu": "numaid"}.get(elem.tag, "")
        value = elem.get(attr) if attr else None
        parts.append(elem.tag if value is None else f"{elem.tag}[{attr}={value}]")
    return " > ".join(parts)


def _net_names(nic: ET.Element) -> tuple[str, ...]:
    return tuple(name for net in nic.iter("net") if (name := (net.get("name") or "").strip()))


class _Parser:
    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.locations: dict[str, Location] = {}
        self.gpus: list[str] = []
        self.nics: dict[str, tuple[str, ...]] = {}
        self.by_name: dict[str, Location] = {}
        self.switch_ids: dict[str, int] = {}  # switch name -> id() of the element that owns it

    def error(self, chain: list[ET.Element], problem: str) -> TopologyXmlError:
        return TopologyXmlError(f"{self.origin}: {problem} (at {_describe(chain)})")

    def cpu(self, system: ET.Element, cpu: ET.Element, index: int, roots: set[str]) -> None:
        chain = [system, cpu]
        text = (cpu.get("numaid") or "").strip()
        try:
            numa: int | None = int(text) if text else None
        except ValueError:
            raise self.error(chain, f"numaid {text!r} is not an integer") from None
        numa = numa if numa is not None and numa >= 0 else None
        root = f"cpu{numa}" if numa is not None and f"cpu{numa}" not in roots else f"cpu#{index}"
        roots.add(root)
        for child in cpu:
            if child.tag == "pci":
                self.pci(child, chain, Location(root=root, numa=numa))
            elif child.tag == "nic":
                names = _net_names(child)
                if not names:
                    log.warning("%s: nic under %s has no named net; ignored", self.origin, _describe(chain))
                for name in names:
                    self.by_name[name] = Location(root=root, numa=numa)

    def pci(self, elem: ET.Element, parents: list[ET.Element], here: Location) -> None:
        if len(parents) > MAX_PCI_DEPTH:  # real trees are a handful of bridges deep; this bounds the recursion
            raise TopologyXmlError(f"{self.origin}: <pci> elements nested more than {MAX_PCI_DEPTH} deep")
        chain = [*parents, elem]
        raw = elem.get("busid")
        if raw is None or not raw.strip():
            raise self.error(chain, "pci element without a busid")
        try:
            bus_id = normalize_bus_id(raw)
        except BusIdError:
            raise self.error(chain, f"busid {raw!r} is not a PCI bus id (expected dddd:bb:dd.f)") from None
        children = [child for child in elem if child.tag == "pci"]
        pci_class = (elem.get("class") or "").strip().lower()
        if not children and pci_class.startswith("0x0604"):
            return  # an empty bridge: nothing to place
        if children:
            name = f"{here.root}/{bus_id}"
            suffix = 1
            while self.switch_ids.setdefault(name, id(elem)) != id(elem):
                suffix += 1
                name = f"{here.root}/{bus_id}#{suffix}"
            if suffix > 1:
                log.warning("%s: bridge %s repeats under %s; kept apart", self.origin, bus_id, here.root)
            below = replace(here, switches=(*here.switches, name))
            for child in children:
                self.pci(child, chain, below)
            return
        if bus_id in self.locations:
            raise self.error(chain, f"busid {bus_id} appears more than once")
        self.locations[bus_id] = here
        if pci_class.startswith("0x03") or elem.find("gpu") is not None:
            self.gpus.append(bus_id)
        nic = elem.find("nic")
        if pci_class.startswith("0x02") or nic is not None:
            self.nics[bus_id] = _net_names(nic) if nic is not None else ()


def parse_nccl_xml(path_or_text: str | Path) -> NcclXmlTopology:
    """Parse an NCCL topology XML file (a path) or XML text; TopologyXmlError says what is wrong."""
    origin, text = _read(path_or_text)
    for forbidden in ("<!DOCTYPE", "<!ENTITY"):
        if forbidden.lower() in text.lower():
            raise TopologyXmlError(f"{origin}: {forbidden} declarations are not allowed in a topology file")
    try:
        system = ET.fromstring(text)  # noqa: S314 - DOCTYPE/ENTITY refused above
    except ET.ParseError as exc:
        line, column = exc.position
        reason = str(exc).split(": line ")[0]
        where = f"line {line}, column {column + 1}"
        raise TopologyXmlError(f"{origin}: not well-formed XML at {where}: {reason}") from None
    if system.tag != "system":
        raise TopologyXmlError(f"{origin}: root element is <{system.tag}>, expected <system>")
    parser = _Parser(origin)
    roots: set[str] = set()
    for index, cpu in enumerate(system.findall("cpu")):
        parser.cpu(system, cpu, index, roots)
    log.debug("%s: %d GPUs, %d NICs", origin, len(parser.gpus), len(parser.nics) + len(parser.by_name))
    return NcclXmlTopology(
        locations=parser.locations,
        gpus=tuple(parser.gpus),
        nics=parser.nics,
        nics_without_bus_id=parser.by_name,
        origin=origin,
    )


def _merge(sysfs: Location, xml: Location) -> Location:
    """The XML location; a numa the XML leaves open keeps the sysfs value, and the sysfs root is kept aside."""
    return replace(xml, numa=sysfs.numa if xml.numa is None else xml.numa, pci_root=sysfs.pci_root or sysfs.root)


def apply_xml(topology: Topology, xml: NcclXmlTopology) -> Topology:
    """A new Topology whose GPUs and NICs named in the XML take the XML's location; others keep sysfs'."""
    missing: list[str] = []
    gpus = []
    for gpu in topology.gpus:
        where = xml.locations.get(gpu.bus_id)
        if where is None:
            missing.append(f"GPU {gpu.bus_id}")
            gpus.append(gpu)
        else:
            gpus.append(replace(gpu, location=_merge(gpu.location, where)))
    nics = []
    for nic in topology.nics:
        where = xml.locations.get(nic.bus_id)
        if where is None and nic.rdma is not None:
            where = xml.nics_without_bus_id.get(nic.rdma)
        if where is None:
            missing.append(f"NIC {nic.bus_id}" + (f" ({nic.rdma})" if nic.rdma else ""))
            nics.append(nic)
        else:
            nics.append(replace(nic, location=_merge(nic.location, where)))
    if missing:
        log.warning("%s does not place %s; keeping their sysfs locations", xml.origin, ", ".join(missing))
    unknown = [f"GPU {bus_id}" for bus_id in xml.gpus if topology.find(bus_id) is None]
    unknown += [f"NIC {bus_id}" for bus_id in xml.nics if topology.find(bus_id) is None]
    rdma_names = {nic.rdma for nic in topology.nics} | {vf.rdma for nic in topology.nics for vf in nic.vfs}
    unknown += [f"NIC {name}" for name in xml.nics_without_bus_id if name not in rdma_names]
    if unknown:
        log.warning("%s names devices this node does not have: %s; ignored", xml.origin, ", ".join(unknown))
    return replace(topology, gpus=tuple(gpus), nics=tuple(nics), source=SOURCE)
