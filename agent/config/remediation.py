"""Settings of the remediation subsystem: Node remediation through the Kubernetes API."""

from __future__ import annotations

from dataclasses import dataclass

from agent.config.fields import setting  # noqa: F401  (used as fields are added)


@dataclass
class RemediationConfig:
    """Node remediation through the Kubernetes API."""
