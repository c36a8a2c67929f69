"""`gpu-node-agent doctor`: what the agent can and cannot see on this node, and why.

Every probe `run` depends on, once, read-only and bounded: NVML (`hardware_checks`), the sysfs PCI tree and
NICs, the kernel log, the kubelet's sockets and directories, the CDI and state directories, the clock and the
netacct/shaping tools (`node_checks`), the API server's RBAC and dcgm-exporter (`cluster_checks`). `run`
orchestrates them (`diagnose`); `report` renders the rows. The package sits beside `agent.wiring`: it opens
the same `Hardware` and reuses the readers of the layers below, and `agent.app` logs a summary of the
machine's own checks at start.
"""

from agent.doctor.report import Check, exit_code, summary, to_json, to_table
from agent.doctor.run import diagnose

__all__ = ["Check", "diagnose", "exit_code", "summary", "to_json", "to_table"]
