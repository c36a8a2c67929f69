"""GPU and NIC health: producers (kernel log, NVML, NIC links) -> findings -> device health and node verdict.

Entry point: `agent.health.service.HealthService`.
"""
