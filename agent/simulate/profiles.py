"""Built-in simulated nodes, stored as JSON data files in `agent/simulate/profiles/`.

A profile describes the PCIe tree of one node; `sysfs_writer.write_sysfs` turns it into a sysfs tree.
Schema (unknown keys are errors, so typos fail loudly):

    {
      "name": "dgx-h100",                    # must equal the file's stem
      "description": "one line for humans",
      "topology_xml": "vm-flat.xml",         # optional: NCCL topology XML next to the JSON file
      "sources": {"bus ids": "NVIDIA ... guide (URL)", "V3": "synthetic"},  # optional: where values come from
      "models": {                            # device kinds, referenced by name below
        "h100": {
          "vendor": "0x10de", "device": "0x2330", "class": "0x030200",
          "subsystem_vendor": "0x10de", "subsystem_device": "0x16c1",   # optional, default 0x0000
          "driver": "nvidia",                                           # optional: unbound without
          "link_speed": "32.0 GT/s PCIe", "link_width": 16,             # max_link_speed / _width
          "current_link_speed": "...", "current_link_width": 16,        # optional, default = max
          "net": {                                                      # optional: network function
            "link_layer": "InfiniBand",      # or "Ethernet" (netdev type 32 / 1)
            "rdma": true,                    # RDMA device (infiniband/, uverbs, umad, issm)
            "rate": "400 Gb/sec (4X NDR)", "fw_ver": "28.39.1002"      # optional
          },
          "vf_model": "cx7-vf",              # optional: SR-IOV PF; VFs use that model
          "sriov_totalvfs": 16               # optional with vf_model, default 16
        }
      },
      "root_complexes": [
        {"root": "pci0000:10", "numa_node": 0,   # numa_node null means unknown (-1); inherited below
         "children": [DEVICE, ...]}
      ]
    }

    DEVICE = {"bdf": "0000:10:01.0", "model": "root-port", "children": [DEVICE, ...]}  # a bridge
           | {"bdf": "0000:18:00.0", "model": "cx7-ib", "netdev": "ibp24s0", "vfs": 8, "link_up": true}
           | {"bdf": "0000:1b:00.0", "model": "h100", "uuid": "GPU-...", "mig": {"profile": "1g.10gb", "count": 7}}
           | {"bdf": "0009:03:00.0", "model": "cx8-dma",
              "vpd": {"name": "... -Prime", "keywords": {"PN": "...", "SN": "...", "V3": "<ASIC id>"}}}

Only bridge models (class 0x0604xx) take `children`; children of a root complex sit on its bus, children of
a bridge all on one bus above the bridge's, and the bus ranges of sibling subtrees do not overlap. `netdev`
is required for network models; VFs are expanded from `vfs` (VF i: devfn = PF devfn + 1 + i, netdev
`<pf netdev>v<i>`). GPUs (class 0x03xxxx) get `uuid` or a stable `GPU-<uuid5(profile/bus id)>`; `mig` puts a GPU
in MIG mode with `count` MIG devices of one profile (NVIDIA's name, `<G>g.<GB>gb`), which the simulated NVML serves.
`sources` names, per value or group of values, the public capture it comes from, or says `synthetic` or
`[inference]`: a profile standing in for real hardware shows which of its numbers are real.
`vpd` gives any function a PCI VPD (identifier string and VPD-R keywords: two characters, at most 255 ASCII bytes
each), written as its binary `vpd` file: a ConnectX-8 PF and its Data Direct DMA function pair by equal `V3`.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.host.busid import BusIdError, normalize_bus_id

PROFILE_DIR = Path(__file__).with_name("profiles")
_UUID_NAMESPACE = uuid.UUID("6f1b6a52-5d0e-4b55-9a38-3a4c1e0e7d11")
_HEX4 = re.compile(r"^0x[0-9a-f]{4}$")
_HEX6 = re.compile(r"^0x[0-9a-f]{6}$")
_ROOT = re.compile(r"^pci([0-9a-f]{4}):([0-9a-f]{2})$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_MIG_PROFILE = re.compile(r"^[1-7]g\.[0-9]+gb$")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says which file and where."""


class UnknownProfileError(ValueError):
    """No built-in profile by that name; the message lists the known ones."""


@dataclass(frozen=True)
class NetSpec:
    """Network side of a function model."""

    link_layer: str  # "InfiniBand" or "Ethernet"
    rdma: bool
    rate: str = ""
    fw_ver: str = ""


@dataclass(frozen=True)
class Model:
    """What every function of one kind reports in sysfs."""

    name: str
    vendor: str
    device: str
    pci_class: str
    subsystem_vendor: str = "0x0000"
    subsystem_device: str = "0x0000"
    driver: str | None = None
    link_speed: str = ""
    link_width: int = 0
    current_link_speed: str = ""
    current_link_width: int = 0
    net: NetSpec | None = None
    vf_model: Model | None = None
    sriov_totalvfs: int = 0

    @property
    def is_bridge(self) -> bool:
        """PCI-to-PCI bridge (root or switch port)."""
        return self.pci_class.startswith("0x0604")

    @property
    def is_gpu(self) -> bool:
        """Display/3D controller."""
        return self.pci_class.startswith("0x03")


@dataclass(frozen=True)
class Device:
    """One PCI function in the tree; VFs are not listed, only counted in `vfs`."""

    bdf: str
    model: Model
    children: tuple[Device, ...] = ()
    netdev: str | None = None
    vfs: int = 0
    link_up: bool = True
    vpd: tuple[str, tuple[tuple[str, str], ...]] | None = None  # (identifier string, VPD-R keywords)


@dataclass(frozen=True)
class RootComplex:
    """A host bridge, `pciDDDD:BB` in sysfs."""

    name: str
    numa_node: int | None
    children: tuple[Device, ...] = ()


@dataclass(frozen=True)
class Profile:
    """A simulated node."""

    name: str
    description: str
    root_complexes: tuple[RootComplex, ...]
    gpu_uuids: dict[str, str]
    topology_xml: Path | None = None
    gpu_mig: dict[str, tuple[str, int]] = field(default_factory=dict)  # GPU bus id -> (MIG profile, count)

    def walk(self) -> Iterator[tuple[RootComplex, tuple[Device, ...], Device]]:
        """Every listed function, depth first: (root complex, ancestor bridges top down, device)."""

        def below(rc: RootComplex, chain: tuple[Device, ...], devs: tuple[Device, ...]) -> Iterator[Any]:
            for dev in devs:
                yield rc, chain, dev
                yield from below(rc, (*chain, dev), dev.children)

        for rc in self.root_complexes:
            yield from below(rc, (), rc.children)


def vf_bus_id(pf_bdf: str, index: int) -> str:
    """Bus id of VF `index` of a PF (offset 1, stride 1, same bus); ValueError past the bus's last devfn."""
    domain, bus, devfn_text = pf_bdf[:4], pf_bdf[5:7], pf_bdf[8:]
    dev, fn = devfn_text.split(".")
    devfn = (int(dev, 16) << 3 | int(fn)) + 1 + index
    if devfn > 0xFF:
        raise ValueError(f"VF {index} of {pf_bdf} does not fit on bus {bus}")
    return f"{domain}:{bus}:{devfn >> 3:02x}.{devfn & 7}"


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name: str) -> Profile:
    """A built-in profile by name."""
    known = list_profiles()
    if name not in known:
        raise UnknownProfileError(f"unknown simulated profile {name!r}; known profiles: {', '.join(known)}")
    return load_profile_file(PROFILE_DIR / f"{name}.json", expect_name=name)


def load_profile_file(path: Path, expect_name: str | None = None) -> Profile:
    """A profile from any JSON file in the schema above; ProfileError when it is invalid."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"profile {path}: cannot read JSON: {exc}") from exc
    try:
        return _Parser(Path(path)).profile(data, expect_name)
    except _Invalid as exc:
        raise ProfileError(f"profile {path}: at {exc.where}: {exc.message}") from None


class _Invalid(Exception):
    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


def _obj(value: object, where: str, required: set[str], optional: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(where, f"expected an object, got {type(value).__name__}")
    if missing := required - value.keys():
        raise _Invalid(where, f"missing {', '.join(sorted(missing))}")
    if extra := value.keys() - required - optional:
        raise _Invalid(where, f"unknown key(s) {', '.join(sorted(extra))}")
    return value


def _typed(value: object, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise _Invalid(where, f"expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _hex(value: object, pattern: re.Pattern[str], where: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise _Invalid(where, f"expected lowercase hex like {'0x15b3' if pattern is _HEX4 else '0x020700'}")
    return value


class _Parser:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.models: dict[str, Model] = {}
        self.bdfs: set[str] = set()
        self.netdevs: set[str] = set()
        self.uuids: dict[str, str] = {}
        self.mig: dict[str, tuple[str, int]] = {}
        self.name = ""

    def profile(self, data: object, expect_name: str | None) -> Profile:
        top = _obj(data, "top level", {"name", "description", "models", "root_complexes"},
                   {"topology_xml", "sources"})
        for what, source in _typed(top.get("sources", {}), dict, "sources").items():
            if not isinstance(source, str) or not source.strip():
                raise _Invalid(f"sources.{what}", "expected the public source (or 'synthetic', '[inference]')")
        self.name = _typed(top["name"], str, "name")
        if expect_name is not None and self.name != expect_name:
            raise _Invalid("name", f"{self.name!r} does not match the file name {expect_name!r}")
        raw_models = _typed(top["models"], dict, "models")
        for name in raw_models:
            self._model(raw_models, name, ())
        xml = None
        if top.get("topology_xml") is not None:
            xml = self.path.parent / _typed(top["topology_xml"], str, "topology_xml")
            if not xml.is_file():
                raise _Invalid("topology_xml", f"no such file {xml}")
        raw_rcs = _typed(top["root_complexes"], list, "root_complexes")
        rcs = [self._root(rc, f"root_complexes[{i}]") for i, rc in enumerate(raw_rcs)]
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for i, rc in enumerate(rcs):
            domain, bus = rc.name[3:7], int(rc.name[8:], 16)
            spans.setdefault(domain, []).append((bus, self._span(bus, rc.children), f"root_complexes[{i}]"))
        for ranges in spans.values():
            self._disjoint(ranges)
        description = _typed(top["description"], str, "description")
        return Profile(self.name, description, tuple(rcs), dict(sorted(self.uuids.items())), xml,
                       dict(sorted(self.mig.items())))

    def _model(self, raw: dict[str, Any], name: str, seen: tuple[str, ...]) -> Model:
        if name in self.models:
            return self.models[name]
        where = f"models.{name}"
        if name in seen:
            raise _Invalid(where, "vf_model refers back to itself")
        m = _obj(raw[name], where, {"vendor", "device", "class"}, {
            "subsystem_vendor", "subsystem_device", "driver", "link_speed", "link_width",
            "current_link_speed", "current_link_width", "net", "vf_model", "sriov_totalvfs"})
        net = None
        if m.get("net") is not None:
            n = _obj(m["net"], f"{where}.net", {"link_layer", "rdma"}, {"rate", "fw_ver"})
            if n["link_layer"] not in ("InfiniBand", "Ethernet"):
                raise _Invalid(f"{where}.net.link_layer", "expected InfiniBand or Ethernet")
            net = NetSpec(n["link_layer"], _typed(n["rdma"], bool, f"{where}.net.rdma"),
                          _typed(n.get("rate", ""), str, f"{where}.net.rate"),
                          _typed(n.get("fw_ver", ""), str, f"{where}.net.fw_ver"))
        vf_model = None
        if "vf_model" in m:
            vf_name = _typed(m["vf_model"], str, f"{where}.vf_model")
            if vf_name not in raw:
                raise _Invalid(f"{where}.vf_model", f"no model named {vf_name!r}")
            vf_model = self._model(raw, vf_name, (*seen, name))
            if vf_model.vf_model is not None or vf_model.is_bridge:
                raise _Invalid(f"{where}.vf_model", f"{vf_name!r} cannot be a VF model")

        def get(key: str, default: object, kind: type | tuple[type, ...] = str) -> Any:
            value = _typed(m.get(key, default), kind, f"{where}.{key}")
            if isinstance(value, int) and value < 0:
                raise _Invalid(f"{where}.{key}", "must not be negative")
            return value

        def ids(key: str, pattern: re.Pattern[str] = _HEX4) -> str:
            return _hex(m.get(key, "0x0000"), pattern, f"{where}.{key}")

        speed, width = get("link_speed", ""), get("link_width", 0, int)
        model = Model(
            name, ids("vendor"), ids("device"), ids("class", _HEX6), ids("subsystem_vendor"),
            ids("subsystem_device"), get("driver", None, (str, type(None))), speed, width,
            get("current_link_speed", speed), get("current_link_width", width, int), net, vf_model,
            get("sriov_totalvfs", 16 if vf_model else 0, int))
        self.models[name] = model
        return model

    def _root(self, raw: object, where: str) -> RootComplex:
        rc = _obj(raw, where, {"root", "numa_node", "children"}, set())
        name = _typed(rc["root"], str, f"{where}.root")
        match = _ROOT.match(name)
        if match is None:
            raise _Invalid(f"{where}.root", f"expected pciDDDD:BB in lowercase hex, got {name!r}")
        numa = _typed(rc["numa_node"], (int, type(None)), f"{where}.numa_node")
        if isinstance(numa, bool) or (numa is not None and numa < 0):
            raise _Invalid(f"{where}.numa_node", "expected a node number >= 0 or null")
        bus = f"{match.group(1)}:{match.group(2)}"
        return RootComplex(name, numa, self._children(rc["children"], where, root_bus=bus))

    def _children(self, raw: object, where: str, root_bus: str = "", parent: str = "") -> tuple[Device, ...]:
        listed = _typed(raw, list, where)
        devs = tuple(self._device(d, f"{where}.children[{i}]") for i, d in enumerate(listed))
        buses = {d.bdf[:7] for d in devs}
        if root_bus and buses - {root_bus}:
            raise _Invalid(where, f"children of a root complex must sit on its bus {root_bus}")
        if len(buses) > 1:
            raise _Invalid(where, f"children of one bridge must share one bus, got {sorted(buses)}")
        if parent and devs and (devs[0].bdf[:4] != parent[:4] or devs[0].bdf[5:7] <= parent[5:7]):
            raise _Invalid(where, "children must be in the bridge's domain on a bus greater than its own")
        return devs

    def _device(self, raw: object, where: str) -> Device:
        d = _obj(raw, where, {"bdf", "model"}, {"children", "netdev", "vfs", "uuid", "link_up", "mig",
                                                    "vpd"})
        try:
            bdf = normalize_bus_id(_typed(d["bdf"], str, f"{where}.bdf"))
        except BusIdError as exc:
            raise _Invalid(f"{where}.bdf", str(exc)) from None
        model = self.models.get(_typed(d["model"], str, f"{where}.model"))
        if model is None:
            raise _Invalid(f"{where}.model", f"no model named {d['model']!r}")
        if "children" in d and not model.is_bridge:
            raise _Invalid(where, f"only bridges have children; {model.name!r} is class {model.pci_class}")
        vfs = _typed(d.get("vfs", 0), int, f"{where}.vfs")
        if vfs and (model.vf_model is None or not 0 < vfs <= model.sriov_totalvfs):
            raise _Invalid(f"{where}.vfs", f"model {model.name!r} allows 0..{model.sriov_totalvfs} VFs")
        netdev = d.get("netdev")
        if (netdev is None) != (model.net is None):
            raise _Invalid(where, "netdev is required for network models and only for them")
        if netdev is not None:
            self._netdevs(_typed(netdev, str, f"{where}.netdev"), vfs, f"{where}.netdev")
        if "uuid" in d:
            if not model.is_gpu:
                raise _Invalid(f"{where}.uuid", "only GPUs have a UUID")
            self.uuids[bdf] = _typed(d["uuid"], str, f"{where}.uuid")
        elif model.is_gpu:
            self.uuids[bdf] = f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{self.name}/{bdf}')}"
        if "mig" in d:
            mig = _obj(d["mig"], f"{where}.mig", {"profile", "count"}, set())
            profile, count = _typed(mig["profile"], str, f"{where}.mig.profile"), _typed(mig["count"], int, where)
            if not model.is_gpu or not _MIG_PROFILE.match(profile) or not 0 <= count <= 7:
                raise _Invalid(f"{where}.mig", "a GPU's MIG profile (<G>g.<GB>gb) and 0..7 devices")
            self.mig[bdf] = (profile, count)
        try:
            ids = [bdf, *(vf_bus_id(bdf, i) for i in range(vfs))]
        except ValueError as exc:
            raise _Invalid(f"{where}.vfs", str(exc)) from None
        for one in ids:
            if one in self.bdfs:
                raise _Invalid(f"{where}.bdf", f"bus id {one} is used twice")
            self.bdfs.add(one)
        children = self._children(d.get("children", []), where, parent=bdf)
        link_up = _typed(d.get("link_up", True), bool, f"{where}.link_up")
        vpd = self._vpd(d["vpd"], f"{where}.vpd") if "vpd" in d else None
        return Device(bdf, model, children, netdev, vfs, link_up, vpd)

    @staticmethod
    def _vpd(raw: object, where: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        v = _obj(raw, where, {"name", "keywords"}, set())
        name = _typed(v["name"], str, f"{where}.name")
        keywords = _typed(v["keywords"], dict, f"{where}.keywords")
        for key, value in keywords.items():
            text = _typed(value, str, f"{where}.keywords.{key}")
            if len(key) != 2 or key == "RV" or not key.isascii() or not text.isascii() or len(text) > 255:
                raise _Invalid(f"{where}.keywords.{key}", "a two-character keyword (not RV), at most 255 ASCII bytes")
        if not name.isascii() or len(name) > 255:
            raise _Invalid(f"{where}.name", "at most 255 ASCII characters")
        return name, tuple(keywords.items())

    def _netdevs(self, name: str, vfs: int, where: str) -> None:
        for one in [name, *(f"{name}v{i}" for i in range(vfs))]:
            if not _IFNAME.match(one):
                raise _Invalid(where, f"{one!r} is not a valid interface name (at most 15 characters)")
            if one in self.netdevs:
                raise _Invalid(where, f"interface name {one!r} is used twice")
            self.netdevs.add(one)

    def _span(self, bus: int, devs: tuple[Device, ...]) -> int:
        """Highest bus number used below a bus; sibling bridges' ranges must not overlap."""
        ranges = []
        for i, dev in enumerate(devs):
            if dev.children:
                secondary = int(dev.children[0].bdf[5:7], 16)
                ranges.append((secondary, self._span(secondary, dev.children), f"bridge {dev.bdf} (#{i})"))
        self._disjoint(ranges)
        return max([bus, *(high for _, high, _ in ranges)])

    @staticmethod
    def _disjoint(ranges: list[tuple[int, int, str]]) -> None:
        ordered = sorted(ranges)
        for (_, high, first), (low, _, second) in itertools.pairwise(ordered):
            if low <= high:
                raise _Invalid(second, f"bus range overlaps {first}'s (up to {high:02x})")
