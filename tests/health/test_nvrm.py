"""NVRM kernel-log lines: every form from the reference, table-driven, and fuzzing that the parser never raises."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.health.nvrm import FallenOffBus, GpuUuidLine, XidLine, parse_nvrm, parse_nvrm_all
from agent.host.busid import bus_key


@pytest.mark.parametrize(("line", "expected"), [
    # the plain form (docs, most drivers)
    ("NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     XidLine("0000:05:00", 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")),
    ("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
     "(GPC 0, TPC 1, SM 0): Out Of Range Address",
     XidLine("0000:cb:00", 13, "pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 0, TPC 1, "
                               "SM 0): Out Of Range Address")),
    ("NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH "
     "TIMEOUT, Info 0x58005",
     XidLine("0000:cb:00", 109, "pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, "
                                "Info 0x58005")),
    ("NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
     XidLine("0000:10:1c", 63, "pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.")),
    # MIG: a GPU instance after the address
    ("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
     XidLine("0000:01:00", 94, "pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No", gpu_instance=5)),
    # older drivers: no PCI: prefix
    ("NVRM: Xid (0000:01:00): 31, Ch 0000000b, engmask 00000101, intr 10000000",
     XidLine("0000:01:00", 31, "Ch 0000000b, engmask 00000101, intr 10000000")),
    # cascade: Xid 45 names the Xid that caused it
    ("NVRM: Xid (PCI:0000:dc:00): 45, pid=2345, name=python3, Ch 00000001 caused by previous Xid 149",
     XidLine("0000:dc:00", 45, "pid=2345, name=python3, Ch 00000001 caused by previous Xid 149", caused_by=149)),
    # GSP timeout on another PCI domain
    ("NVRM: Xid (PCI:0002:00:00): 119, pid=1234, name=nvc:[driver], Timeout after 6s of waiting for RPC response "
     "from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x410).",
     XidLine("0002:00:00", 119, "pid=1234, name=nvc:[driver], Timeout after 6s of waiting for RPC response from GPU1 "
                                "GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x410).")),
    # 8-digit domain and upper case: normalised to the kernel's dddd:bb:dd
    ("NVRM: Xid (PCI:00000000:3B:00): 48, pid=99, DBE (double bit error) ECC error",
     XidLine("0000:3b:00", 48, "pid=99, DBE (double bit error) ECC error")),
    # a kernel prefix before NVRM and no trailing text
    ("nvidia 0000:3b:00.0: NVRM: Xid (PCI:0000:3b:00): 79", XidLine("0000:3b:00", 79)),
    # a device we cannot read as a bus id is still an Xid (counted, not attributed)
    ("NVRM: Xid (GPU 7): 62, pid=1, PMU halt", XidLine("GPU 7", 62, "pid=1, PMU halt", device_parsed=False)),
    # fallen off the bus without an Xid line
    ("NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:20b0) installed in this system has fallen off the bus and "
     "is not responding to commands.", FallenOffBus("0000:b3:00")),
    ("NVRM: GPU at PCI:0000:2b:00: GPU-0b11d014-6c1e-8e2a-1234-56789abcdef0",
     GpuUuidLine("0000:2b:00", "GPU-0b11d014-6c1e-8e2a-1234-56789abcdef0")),
    # not health events
    ("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15", None),
    ("nvidia-nvlink: Nvlink Core is being initialized", None),
    ("mlx5_core 0000:18:00.0: Port module event: module 0, Cable plugged", None),
    ("", None),
])
def test_nvrm_line_forms(line: str, expected: object) -> None:
    assert parse_nvrm(line) == expected


def test_bus_key_matches_the_kernel_form() -> None:
    assert bus_key("0000:1b:00.0") == "0000:1b:00"


_NVRMISH = st.one_of(
    st.text(max_size=200),
    st.builds(lambda pre, mid, post: f"{pre}NVRM: Xid ({mid}): {post}", st.text(max_size=20), st.text(max_size=40),
              st.text(max_size=40)),
    st.builds(lambda mid: f"NVRM: The NVIDIA GPU {mid} has fallen off the bus", st.text(max_size=40)),
    st.builds(lambda a, b: f"NVRM: GPU at PCI:{a}: GPU-{b}", st.text(max_size=20), st.text(max_size=40)),
)


@settings(max_examples=300, deadline=None)
@given(_NVRMISH)
def test_parser_never_raises(line: str) -> None:
    result = parse_nvrm(line)
    assert result is None or isinstance(result, XidLine | FallenOffBus | GpuUuidLine)


def test_every_xid_in_one_message_counts() -> None:
    """A message holding several NVRM lines (a dmesg dump in a file, or a record of several lines) yields each one.
    Texts: leptonai/gpud#1174 (Xid 149 NETIR), NVIDIA/open-gpu-kernel-modules#1150 (Xid 45 cascade)."""
    message = ("NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 "
               "0x00000000 0x00000000 0x00000000)\n"
               "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149")
    found = parse_nvrm_all(message)
    assert [(x.device, x.code) for x in found if isinstance(x, XidLine)] == [("0019:01:00", 149), ("0000:dc:00", 45)]
    assert isinstance(found[1], XidLine) and found[1].caused_by == 149


@pytest.mark.parametrize(("message", "device"), [
    # NVIDIA/NVSentinel#155: one record of three NVRM lines (as /dev/kmsg unescapes it, or dmesg joins it)
    ("NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) installed in this system has\n"
     "NVRM: fallen off the bus and is not responding to commands.", "0000:b3:00"),
    # Bumblebee-Project/Bumblebee#554 (older drivers)
    ("NVRM: GPU at 0000:01:00.0 has fallen off the bus.", "0000:01:00"),
])
def test_multi_line_bus_loss(message: str, device: str) -> None:
    assert parse_nvrm_all(message) == [FallenOffBus(device)]


def test_a_map_line_does_not_take_the_next_gpus_bus_loss() -> None:
    message = ("NVRM: GPU at PCI:0000:01:00: GPU-aeab3757-56a6-7e30-3f7c-1f322454bde2\n"
               "NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has fallen off the bus")
    assert parse_nvrm_all(message) == [GpuUuidLine("0000:01:00", "GPU-aeab3757-56a6-7e30-3f7c-1f322454bde2"),
                                       FallenOffBus("0000:b3:00")]
