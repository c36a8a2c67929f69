"""Rules for what the device-plugin section names: extended resource names and SR-IOV style selector ranges.

They live with the config so that `gpu-node-agent config` and `run` reject a bad name at load time (exit 2)
instead of the device plugin crash-looping on it later; the device plugin applies the same rules.
"""

from __future__ import annotations

import re

# Extended resource names: a DNS-subdomain prefix (not kubernetes.io) and a name as SR-IOV DP allows it.
PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
# The kubelet's own rule (a qualified name), which NVIDIA's MIG resources need for their dots: `mig-1g.10gb`
QUALIFIED = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_RANGE = re.compile(r"^\s*(\d{1,4})\s*(?:-\s*(\d{1,4})\s*)?$")


def resource_name_problem(prefix: str, name: str, *, dots: bool = False) -> str | None:
    """Why `prefix/name` is not an extended resource name the kubelet accepts, or None (`dots`: the kubelet's
    qualified-name rule, else SR-IOV DP's stricter one)."""
    rule = QUALIFIED if dots else NAME
    if not rule.match(name):
        return f"resource name {name!r} must match {rule.pattern}"
    if len(name) > 63:
        return f"resource name {name!r} is longer than 63 characters"
    if len(prefix) > 253 or not PREFIX.match(prefix):
        return f"resource prefix {prefix!r} is not a DNS subdomain"
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        return f"resource prefix {prefix!r}: kubernetes.io names are not extended resources"
    return None


def vf_range_problem(entry: str) -> str | None:
    """Why a `name#0-3,6` selector entry's VF ranges cannot be read, or None (no `#` is fine)."""
    name, sep, ranges = entry.partition("#")
    if not name.strip():
        return f"{entry!r} names nothing before '#'"
    if not sep:
        return None
    for part in ranges.split(","):
        match = _RANGE.match(part)
        if match is None:
            return f"{entry!r}: {part!r} is not a VF index or a range such as 0-3"
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            return f"{entry!r}: range {part.strip()!r} runs backwards"
    return None
