"""gpu-node-agent: one agent per GPU node (device plugin, health, remediation, network accounting)."""

__version__ = "0.1.0"
