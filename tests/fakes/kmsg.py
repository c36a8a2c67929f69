"""Kernel-log records as the NVIDIA driver writes them, for tests that feed a kmsg file."""

from __future__ import annotations


def xid_record(seq: int, bus: str, code: int, text: str = "pid=1, name=python3, test") -> str:
    """One /dev/kmsg record line (priority 3, sequence, timestamp, flags) with a real-format Xid message; `bus`
    like `0000:1b:00` (the driver's `PCI:` field) or a full bus id `0000:1b:00.0` (the function is dropped)."""
    return f"3,{seq},{1000 + seq},-;NVRM: Xid (PCI:{bus.rsplit('.', 1)[0]}): {code}, {text}\n"
