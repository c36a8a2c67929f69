"""NCCL topology XML: parsing to Locations and merging over a sysfs Topology."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from agent.topology.model import Gpu, Level, Location, Nic, PciInfo, Topology, Vf
from agent.topology.nccl_xml import NcclXmlTopology, TopologyXmlError, apply_xml, parse_nccl_xml

BRIDGE = 'class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16" vendor="0x0000" device="0x0000"'


def ndv5_xml(bridge_ids: tuple[str, ...] = tuple(f"ffff:ff:0{n}.0" for n in range(1, 9))) -> str:
    """ND H100 v5 shape: two cpus, four synthetic bridges each, one GPU and one NIC per bridge."""
    cpus = []
    for cpu in range(2):
        bridges = []
        for slot in range(4):
            n = cpu * 4 + slot
            bridges.append(
                f'    <pci busid="{bridge_ids[n]}" {BRIDGE}>\n'
                f'      <pci busid="{n + 1:04x}:00:00.0" class="0x030200" link_speed="32.0 GT/s PCIe"/>\n'
                f'      <pci busid="{0x101 + n:04x}:00:00.0" class="0x020700" link_width="16"/>\n'
                "    </pci>\n"
            )
        cpus.append(
            f'  <cpu numaid="{cpu}" affinity="ffffffff" arch="x86_64" vendor="GenuineIntel">\n'
            + "".join(bridges)
            + "  </cpu>\n"
        )
    return '<system version="1">\n' + "".join(cpus) + "</system>\n"


def gpu_bus(n: int) -> str:
    return f"{n + 1:04x}:00:00.0"


def nic_bus(n: int) -> str:
    return f"{0x101 + n:04x}:00:00.0"


def level(xml: NcclXmlTopology, a: str, b: str) -> Level:
    return xml.locations[a].level_to(xml.locations[b])


# --- parsing -------------------------------------------------------------------------------------------


def test_ndv5_pairs_are_pix_bridges_phb_cpus_sys() -> None:
    xml = parse_nccl_xml(ndv5_xml())
    assert xml.gpus == tuple(gpu_bus(n) for n in range(8))
    assert xml.nics == {nic_bus(n): () for n in range(8)}
    assert set(xml.locations) == {gpu_bus(n) for n in range(8)} | {nic_bus(n) for n in range(8)}
    for n in range(8):
        assert level(xml, gpu_bus(n), nic_bus(n)) is Level.PIX
    assert level(xml, gpu_bus(0), nic_bus(1)) is Level.PHB
    assert level(xml, gpu_bus(0), gpu_bus(3)) is Level.PHB
    assert level(xml, gpu_bus(5), nic_bus(7)) is Level.PHB
    assert level(xml, gpu_bus(0), nic_bus(4)) is Level.SYS
    assert level(xml, gpu_bus(7), gpu_bus(3)) is Level.SYS
    gpu0, gpu4 = xml.locations[gpu_bus(0)], xml.locations[gpu_bus(4)]
    assert (gpu0.root, gpu0.numa, len(gpu0.switches)) == ("cpu0", 0, 1)
    assert (gpu4.root, gpu4.numa) == ("cpu1", 1)


def test_same_synthetic_bridge_id_under_two_cpus_is_two_switches() -> None:
    ids = tuple(f"ffff:ff:0{n % 4 + 1}.0" for n in range(8))  # cpu1 reuses cpu0's bridge ids
    xml = parse_nccl_xml(ndv5_xml(ids))
    assert xml.locations[gpu_bus(0)].switches != xml.locations[gpu_bus(4)].switches
    assert level(xml, gpu_bus(0), nic_bus(4)) is Level.SYS
    assert level(xml, gpu_bus(4), nic_bus(4)) is Level.PIX
    # Even with equal numa (or none), distinct cpus must not look like one switch.
    flat = ndv5_xml(ids).replace('numaid="1"', 'numaid="0"')
    assert level(parse_nccl_xml(flat), gpu_bus(0), nic_bus(4)) is Level.NODE


def test_nested_bridges_give_pxb() -> None:
    text = """<system version="1"><cpu numaid="0">
      <pci busid="0000:15:00.0" class="0x060400">
        <pci busid="0000:17:00.0" class="0x060400">
          <pci busid="0000:18:00.0" class="0x030200"/>
          <pci busid="0000:19:00.0" class="0x020700"/>
        </pci>
        <pci busid="0000:1a:00.0" class="0x060400">
          <pci busid="0000:1b:00.0" class="0x020700"/>
        </pci>
      </pci>
      <pci busid="0000:30:00.0" class="0x060400"/>
    </cpu></system>"""
    xml = parse_nccl_xml(text)
    assert xml.locations["0000:18:00.0"].switches == ("cpu0/0000:15:00.0", "cpu0/0000:17:00.0")
    assert level(xml, "0000:18:00.0", "0000:19:00.0") is Level.PIX
    assert level(xml, "0000:18:00.0", "0000:1b:00.0") is Level.PXB
    assert "0000:30:00.0" not in xml.locations  # an empty bridge is no device


def test_nvml_style_uppercase_bus_ids_normalise() -> None:
    text = """<system><cpu numaid="0"><pci busid="FFFF:FF:01.0" class="0x060400">
      <pci busid="00000000:3B:00.0" class="0x030200"/><pci busid="0000:3C:00.1" class="0x020700"/>
    </pci></cpu></system>"""
    xml = parse_nccl_xml(text)
    assert xml.gpus == ("0000:3b:00.0",)
    assert set(xml.nics) == {"0000:3c:00.1"}
    assert xml.locations["0000:3b:00.0"].switches == ("cpu0/ffff:ff:01.0",)
    assert level(xml, "0000:3b:00.0", "0000:3c:00.1") is Level.PIX


def test_dump_style_gpu_and_nic_children() -> None:
    text = """<system version="2"><cpu numaid="1" affinity="ffff0000">
      <pci busid="0000:9a:00.0" class="0x060400">
        <pci busid="0000:9b:00.0"><gpu dev="4" sm="90" rank="4" gdr="1"/></pci>
        <pci busid="0000:9c:00.0" class="0x020700">
          <nic><net name="mlx5_4" dev="4" speed="400000" port="1" gdr="1"/>
               <net name="mlx5_5" dev="5" speed="400000" port="1"/></nic>
        </pci>
        <pci busid="0000:9d:00.0" class="0x010802"/>
      </pci></cpu></system>"""
    xml = parse_nccl_xml(text)
    assert xml.gpus == ("0000:9b:00.0",)
    assert xml.nics == {"0000:9c:00.0": ("mlx5_4", "mlx5_5")}
    assert xml.locations["0000:9d:00.0"].numa == 1  # other devices are placed, neither GPU nor NIC
    assert level(xml, "0000:9b:00.0", "0000:9c:00.0") is Level.PIX


def test_nic_directly_under_cpu() -> None:
    text = """<system><cpu numaid="0"><pci busid="0000:18:00.0" class="0x030200"/></cpu>
      <cpu numaid="1"><nic><net name="mlx5_0" port="1"/><net name="mlx5_1"/></nic></cpu></system>"""
    xml = parse_nccl_xml(text)
    assert xml.nics == {}
    assert xml.nics_without_bus_id == {
        "mlx5_0": Location(root="cpu1", numa=1),
        "mlx5_1": Location(root="cpu1", numa=1),
    }
    assert xml.locations["0000:18:00.0"].level_to(xml.nics_without_bus_id["mlx5_0"]) is Level.SYS


@pytest.mark.parametrize("numaids", [("", ""), ('numaid="-1"', 'numaid="-1"'), ('numaid="0"', 'numaid="0"')])
def test_cpus_without_distinct_numaid_stay_distinct_roots(numaids: tuple[str, str]) -> None:
    text = (
        f'<system><cpu {numaids[0]}><pci busid="0001:00:00.0" class="0x030200"/></cpu>'
        f'<cpu {numaids[1]}><pci busid="0002:00:00.0" class="0x030200"/></cpu></system>'
    )
    xml = parse_nccl_xml(text)
    first, second = xml.locations["0001:00:00.0"], xml.locations["0002:00:00.0"]
    assert first.root != second.root
    assert first.level_to(second) is Level.NODE
    if not numaids[0] or "-1" in numaids[0]:
        assert (first.numa, first.root, second.root) == (None, "cpu#0", "cpu#1")


def test_reads_path_and_str_path(tmp_path: Path) -> None:
    path = tmp_path / "ndv5-topo.xml"
    path.write_text(ndv5_xml())
    assert parse_nccl_xml(path).gpus == parse_nccl_xml(str(path)).gpus == parse_nccl_xml(ndv5_xml()).gpus
    assert parse_nccl_xml(path).origin == str(path)


# --- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("<system><cpu numaid='0'><pci busid='0000:01:00.0'></cpu></system>", "line 1, column"),
        ("<system>\n<cpu>\n</system>", "line 3, column"),
        ("", "not well-formed XML"),
        ("<topology><cpu/></topology>", "root element is <topology>, expected <system>"),
        ("<system><cpu numaid='0'><pci class='0x030200'/></cpu></system>", "pci element without a busid"),
        ("<system><cpu numaid='0'><pci busid=' '/></cpu></system>", "pci element without a busid"),
        ("<system><cpu><pci busid='gpu0'/></cpu></system>", "busid 'gpu0' is not a PCI bus id"),
        (
            "<system><cpu><pci busid='0000:3b:00.9'/></cpu></system>",
            "busid '0000:3b:00.9' is not a PCI bus id",
        ),
        (
            "<system><cpu numaid='1'><pci busid='ffff:ff:01.0'><pci busid='3b:00.0'/></pci></cpu></system>",
            "(at system > cpu[numaid=1] > pci[busid=ffff:ff:01.0] > pci[busid=3b:00.0])",
        ),
        ("<system><cpu numaid='zero'/></system>", "numaid 'zero' is not an integer"),
        (
            "<system><cpu><pci busid='0001:00:00.0'/><pci busid='0001:00:00.0'/></cpu></system>",
            "busid 0001:00:00.0 appears more than once",
        ),
        (
            '<!DOCTYPE system [<!ENTITY a "aaaa">]><system>&a;</system>',
            "<!DOCTYPE declarations are not allowed",
        ),
        ('<system><!ENTITY a "x"></system>', "<!ENTITY declarations are not allowed"),
    ],
)
def test_malformed_files_raise_topology_xml_error(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "bad-topo.xml"
    path.write_text(content)
    with pytest.raises(TopologyXmlError) as info:
        parse_nccl_xml(path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)
    assert info.value.__cause__ is None  # clear message, no chained internals


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_unreadable_file_raises_topology_xml_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "topo.xml"
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"<system>\xff\xfe</system>")
    with pytest.raises(TopologyXmlError, match="cannot read NCCL topology file") as info:
        parse_nccl_xml(path)
    assert str(path) in str(info.value)


# --- merging over sysfs -------------------------------------------------------------------------------


def vm_topology() -> Topology:
    """What sysfs shows inside an ND H100 v5 VM: every device on its own PCI root, numa unknown.

    GPU 8 (0009:...) is not in the XML below; NIC 0 has a VF; NIC 7 is only known by its RDMA name.
    """

    def own_root(bus_id: str) -> Location:
        return Location(root=f"pci{bus_id[:4]}:00")

    gpus = tuple(Gpu(index=n, pci=PciInfo(gpu_bus(n)), location=own_root(gpu_bus(n))) for n in range(9))
    nics = []
    for n in range(8):
        bus_id = nic_bus(n)
        vfs = (
            (Vf(pci=PciInfo("0201:00:00.1"), pf_bus_id=bus_id, vf_index=0, rdma="mlx5_8"),) if n == 0 else ()
        )
        nics.append(Nic(pci=PciInfo(bus_id), location=own_root(bus_id), rdma=f"mlx5_{n}", vfs=vfs))
    return Topology(gpus=gpus, nics=tuple(nics))


def test_vm_sysfs_sees_no_pairing() -> None:
    topo = vm_topology()
    assert topo.level(gpu_bus(0), nic_bus(0)) is Level.NODE
    assert topo.level(gpu_bus(0), nic_bus(4)) is Level.NODE


def test_apply_xml_restores_pairs(caplog: pytest.LogCaptureFixture) -> None:
    # NIC 7 of the XML sits directly under cpu1 with only its RDMA name; the XML also names a GPU
    # (000d:...) that this node lacks.
    text = ndv5_xml().replace(
        f'<pci busid="{nic_bus(7)}" class="0x020700" link_width="16"/>',
        '<pci busid="000d:00:00.0" class="0x030200"/>',
    )
    text = text.replace("  </cpu>\n</system>", '  <nic><net name="mlx5_7"/></nic>\n  </cpu>\n</system>')
    xml = parse_nccl_xml(text)
    sysfs = vm_topology()
    with caplog.at_level(logging.WARNING, logger="agent.topology.nccl_xml"):
        merged = apply_xml(sysfs, xml)

    assert merged.source == "sysfs+nccl-xml"
    assert sysfs.source == "sysfs"  # the input is untouched
    for n in range(7):
        assert merged.level(gpu_bus(n), nic_bus(n)) is Level.PIX
        assert merged.find(gpu_bus(n)).numa == n // 4
    assert merged.level(gpu_bus(0), nic_bus(1)) is Level.PHB
    assert merged.level(gpu_bus(0), nic_bus(4)) is Level.SYS
    # A VF inherits its PF's XML location.
    assert merged.location("0201:00:00.1") == merged.location(nic_bus(0))
    assert merged.level("0201:00:00.1", gpu_bus(0)) is Level.PIX
    # The name-only NIC lands under cpu1: PHB to cpu1's GPUs, SYS to cpu0's.
    assert merged.location(nic_bus(7)) == Location(root="cpu1", numa=1)
    assert merged.level(nic_bus(7), gpu_bus(7)) is Level.PHB
    assert merged.level(nic_bus(7), gpu_bus(0)) is Level.SYS
    # A GPU the XML does not know keeps its sysfs location.
    assert merged.location(gpu_bus(8)) == sysfs.location(gpu_bus(8))
    assert merged.gpus[8] is sysfs.gpus[8]
    # Everything else is carried over.
    assert [gpu.index for gpu in merged.gpus] == list(range(9))
    assert [nic.rdma for nic in merged.nics] == [nic.rdma for nic in sysfs.nics]
    assert merged.nics[0].vfs == sysfs.nics[0].vfs

    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2
    not_placed = next(msg for msg in warnings if "does not place" in msg)
    assert f"GPU {gpu_bus(8)}" in not_placed
    assert "NIC" not in not_placed
    unknown = next(msg for msg in warnings if "does not have" in msg)
    assert "GPU 000d:00:00.0" in unknown
    assert merged.find("000d:00:00.0") is None


def test_apply_xml_warns_for_unknown_names_and_keeps_sysfs_numa(caplog: pytest.LogCaptureFixture) -> None:
    text = """<system><cpu><pci busid="ffff:ff:01.0" class="0x060400">
      <pci busid="0001:00:00.0" class="0x030200"/><pci busid="0101:00:00.0" class="0x020700"/>
      </pci><nic><net name="mlx5_9"/></nic></cpu></system>"""
    gpu = Gpu(index=0, pci=PciInfo("0001:00:00.0"), location=Location(root="pci0001:00", numa=0))
    nic = Nic(pci=PciInfo("0101:00:00.0"), location=Location(root="pci0101:00", numa=0), rdma="mlx5_0")
    with caplog.at_level(logging.WARNING, logger="agent.topology.nccl_xml"):
        merged = apply_xml(Topology(gpus=(gpu,), nics=(nic,)), parse_nccl_xml(text))
    assert merged.level("0001:00:00.0", "0101:00:00.0") is Level.PIX
    assert merged.gpus[0].numa == 0  # the XML's cpu has no numaid: sysfs' value stays
    assert [r.getMessage() for r in caplog.records] == [
        "<text> names devices this node does not have: NIC mlx5_9; ignored"
    ]


def test_apply_xml_without_matches_changes_only_source() -> None:
    sysfs = vm_topology()
    merged = apply_xml(sysfs, NcclXmlTopology())
    assert merged == replace(sysfs, source="sysfs+nccl-xml")


def test_deeply_nested_xml_is_a_clear_error() -> None:
    """A hostile topology file: bridges nested 100,000 deep overran the parser's recursion (a traceback)."""
    depth = 100_000
    text = ('<system version="1"><cpu numaid="0" arch="x86_64">' + '<pci busid="0000:10:00.0" class="0x060400">' * depth
            + "</pci>" * depth + "</cpu></system>")
    with pytest.raises(TopologyXmlError, match="nested more than"):
        parse_nccl_xml(text)


def test_non_utf8_xml_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "topo.xml"
    path.write_bytes('<system version="1"><cpu numaid="0"/></system><!-- caf\xe9 -->'.encode("latin-1"))
    with pytest.raises(TopologyXmlError):
        parse_nccl_xml(path)
