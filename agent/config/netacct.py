"""Settings of the netacct subsystem: Network accounting (iptables mangle rules and ipset counters)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.config.fields import setting  # noqa: F401  (used as fields are added)


@dataclass
class NetacctConfig:
    """Network accounting (iptables mangle rules and ipset counters)."""
