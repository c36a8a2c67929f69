"""The settings of this node's pod source and internal set, shared by netacct and shaping (`agent.pods`).

What is "cluster" traffic and what is "internet" must mean the same for counting (netacct) and limiting
(shaping), and one process follows one pod list, so these are settings of neither subsystem: they are read
once and handed to both. Their keys stay where operators have always written them, in the `netacct` section
(`netacct.podsFile` / `--pods-file`, `netacct.internalCidrs` / `--internal-cidr`): moving them would rename a
key, a flag and a variable. The checks live here, in the config package (the foundation layer, below
`agent.pods`), so a typo exits with code 2 naming the field at load time instead of failing later inside a
kernel command.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# RFC 1918, RFC 6598 (CGNAT), IPv4 link-local, IPv6 ULA and IPv6 link-local (reference netacct.md §6).
DEFAULT_INTERNAL_CIDRS: tuple[str, ...] = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "fc00::/7",
    "fe80::/10",
)


def check_internal_cidrs(texts: Sequence[str], field: str = "internalCidrs") -> None:
    """ValueError naming the entry for a malformed CIDR or one with host bits set."""
    for index, text in enumerate(texts):
        where = f"{field}[{index}]"
        try:
            network = ipaddress.ip_network(text.strip(), strict=False)
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not a CIDR such as 10.0.0.0/8 or fd00::/8") from None
        if network.network_address != ipaddress.ip_address(text.strip().split("/")[0]):
            raise ValueError(f"{where}: {text!r} has host bits set; did you mean {network}?")


def internal_networks(texts: Sequence[str]) -> list[Network]:
    """The internal set as networks (after `check_internal_cidrs`)."""
    return [ipaddress.ip_network(text.strip(), strict=False) for text in texts]
