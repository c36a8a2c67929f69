"""Settings of the health subsystem: GPU and NIC health checks (NVML, kernel log, link state)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.config.fields import setting  # noqa: F401  (used as fields are added)


@dataclass
class HealthConfig:
    """GPU and NIC health checks (NVML, kernel log, link state)."""
