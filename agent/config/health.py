"""Settings of the health subsystem: GPU and NIC health checks (NVML, kernel log, link state).

The state directory (kmsg cursor, outstanding GPU faults) is the top-level `AgentConfig.state_dir`; the
caller passes it in. Xid action overrides are `CODE=ACTION` strings because the config loader speaks flags
and env vars, where a list of strings is the natural shape; `xid_action_overrides()` gives the mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.config.fields import setting
from agent.signals import VERDICTS, XID_ACTIONS

__all__ = ["VERDICTS", "XID_ACTIONS", "HealthConfig", "parse_xid_override"]


# Default action of each NIC/PCIe/inventory check (`--check-action CHECK=ACTION` overrides one). The devices a
# finding names are Unhealthy whatever the action; the action only sets the node verdict.
CHECK_ACTIONS: dict[str, str] = {
    "nic_link_downed": "degraded",  # link_downed grew: the port went down (and perhaps came back)
    "nic_link_errors": "degraded",  # local_link_integrity / excessive_buffer_overrun errors grew
    "nic_symbol_errors": "degraded",  # symbol_error over its hourly rate (bit error rate past IBTA's 1e-12)
    "nic_rcv_errors": "degraded",  # port_rcv_errors over its rate
    "nic_link_flapping": "degraded",  # link_error_recovery plus observed flaps over the per-minute rate
    "nic_link_outage": "degraded",  # the port was down longer than the outage threshold
    "nic_low_rate": "degraded",  # an active port slower than its peers
    "pcie_downtrained": "degraded",  # current link width below max on a GPU, NIC or their upstream ports
    "pcie_aer_fatal": "cordon",  # aer_dev_fatal grew
    "pcie_aer_nonfatal": "degraded",  # aer_dev_nonfatal grew
    "gpu_missing": "cordon",  # fewer GPUs than expected on the bus or in NVML
    "nic_driver_fatal": "cordon",  # mlx5_core: firmware heartbeat lost, unrecoverable error, command timeout
    "nic_driver_warning": "degraded",  # mlx5_core: PCIe slot power too low, transceiver over temperature
    "nvswitch_fatal": "cordon",  # a fatal NVSwitch SXid
    "gpudirect_missing": "degraded",  # RDMA VFs and GPUs served, but neither nvidia_peermem nor gdrdrv loaded
    "nvlink_inactive": "cordon",  # NVML: a GPU's NVLinks inactive that its peers have active (node-wide fault)
    "gpu_fabric": "cordon",  # NVML fabric probe not completed after the grace time, failed, or fabric unhealthy
    "gpu_fabric_degraded": "degraded",  # fabric bandwidth degraded / limited capacity / a route recovery running
    # NVML's GPU recovery-action field: the driver itself asks for this (the finding carries it for remediation)
    "gpu_recovery_gpu_reset": "cordon",  # reset the GPU once its processes stopped
    "gpu_recovery_node_reboot": "drain",  # the OS state may be inconsistent: reboot
    "gpu_recovery_drain_p2p": "cordon",  # stop processes doing peer-to-peer, then query again
    "gpu_recovery_drain_and_reset": "drain",  # drain peer-to-peer users, then reset the GPU
    "gpu_recovery_recover_imex_domain": "cordon",  # the GPU's IMEX domain needs recovery
    "gpu_recovery_bus_reset": "cordon",  # reset the GPU's PCIe bus
    "gpu_recovery_system_reboot": "drain",  # reboot the system
    "gpu_recovery_unknown": "cordon",  # a recovery-action value newer than this agent
    "unknown": "degraded",  # a check that cannot run (unknownHealthAction=unhealthy): what the node verdict says
}


def parse_check_action(text: str) -> tuple[str, str]:
    """`"pcie_downtrained=cordon"` -> ("pcie_downtrained", "cordon"); ValueError naming the problem otherwise."""
    name, sep, action = text.partition("=")
    name, action = name.strip(), action.strip().lower()
    if not sep or name not in CHECK_ACTIONS:
        raise ValueError(f"check action {text!r} must look like CHECK=ACTION with CHECK one of "
                         f"{', '.join(CHECK_ACTIONS)}")
    if action not in VERDICTS:
        raise ValueError(f"check action {text!r}: action must be one of {', '.join(VERDICTS)}")
    return name, action


def parse_xid_override(text: str) -> tuple[int, str]:
    """`"109=drain"` -> (109, "drain"); ValueError naming the problem otherwise."""
    code_text, sep, action = text.partition("=")
    action = action.strip().lower()
    if not sep or not code_text.strip().isdigit():
        raise ValueError(f"xid action override {text!r} must look like CODE=ACTION, e.g. 109=drain")
    if action not in XID_ACTIONS:
        raise ValueError(f"xid action override {text!r}: action must be one of {', '.join(XID_ACTIONS)}")
    return int(code_text), action


@dataclass
class HealthConfig:
    """GPU and NIC health checks (NVML, kernel log, link state, optionally dcgm-exporter)."""

    kmsg: str = setting("/dev/kmsg", flag="--kmsg", env="GPU_NODE_AGENT_KMSG",
                        help="kernel log to read Xid lines from: /dev/kmsg, or a plain file in its record format "
                             "that is appended to (simulation); empty turns the kernel-log check off")
    nvml_poll_interval_seconds: float = setting(
        30.0, flag="--nvml-poll-interval", env="GPU_NODE_AGENT_NVML_POLL_INTERVAL",
        floor=0.1, help="seconds between NVML polls of ECC counts, retired pages and remapped rows")
    nvml_event_timeout_seconds: float = setting(
        5.0, flag="--nvml-event-timeout", env="GPU_NODE_AGENT_NVML_EVENT_TIMEOUT",
        help="longest single wait for NVML Xid/ECC events: how often the watch re-checks the GPU set and retries "
             "a failing wait (an event ends the wait at once; a stop interrupts it within 0.5 s)")
    require_nvml: bool = setting(
        False, flag="--require-nvml", env="GPU_NODE_AGENT_REQUIRE_NVML",
        help="fail the health checks (agent exits non-zero) when NVML cannot start; otherwise the NVML checks "
             "report 'unavailable' and the rest runs")
    xid_actions: list[str] = setting(
        factory=list, flag="--xid-action", env="GPU_NODE_AGENT_XID_ACTIONS", repeat=True,
        help="override the action for an Xid code as CODE=ACTION (none, degraded, isolate, cordon, drain), "
             "e.g. 109=none or 63=cordon")
    xid_burst_window_seconds: float = setting(
        180.0, flag="--xid-burst-window", env="GPU_NODE_AGENT_XID_BURST_WINDOW",
        help="repeats of one Xid on one GPU closer than this are one burst: counted, logged and acted on once")
    degraded_hold_seconds: float = setting(
        600.0, flag="--degraded-hold", env="GPU_NODE_AGENT_DEGRADED_HOLD",
        help="how long a 'degraded' finding (growing single-bit ECC, degraded-class Xid) stays after its last "
             "occurrence")
    link_check_interval_seconds: float = setting(
        30.0, flag="--link-check-interval", env="GPU_NODE_AGENT_LINK_CHECK_INTERVAL",
        zero_ok=True,
        floor=0.1,
        help="seconds between safety-net NIC link checks (netdev carrier/operstate, InfiniBand port state); links "
             "are judged at once on every netlink link event, this poll catches what no event reports; 0 turns "
             "link checks off")
    link_down_action: str = setting(
        "degraded", flag="--link-down-action", env="GPU_NODE_AGENT_LINK_DOWN_ACTION", choices=VERDICTS,
        help="node verdict while an RDMA NIC link is down (its VFs are Unhealthy regardless)")

    nic_counter_interval_seconds: float = setting(
        10.0, flag="--nic-counter-interval", env="GPU_NODE_AGENT_NIC_COUNTER_INTERVAL", zero_ok=True,
        floor=0.1,
        help="seconds between passes over the InfiniBand/RoCE port counters, PCIe link widths and AER counters "
             "(one pass reads them all); 0 turns the check off")
    nic_hold_seconds: float = setting(
        300.0, flag="--nic-hold", env="GPU_NODE_AGENT_NIC_HOLD", zero_ok=True,
        help="how long a NIC/PCIe/inventory finding (and the Unhealthy devices it names) stays after its "
             "condition was last seen")
    nic_symbol_errors_per_hour: float = setting(
        120.0, flag="--nic-symbol-errors-per-hour", env="GPU_NODE_AGENT_NIC_SYMBOL_ERRORS_PER_HOUR",
        help="symbol_error increase within an hour above which a port is faulty (120/h is IBTA's 1e-12 BER)")
    nic_flaps_per_minute: float = setting(
        5.0, flag="--nic-flaps-per-minute", env="GPU_NODE_AGENT_NIC_FLAPS_PER_MINUTE",
        help="link_error_recovery increases plus observed down/up cycles within a minute at which a port is "
             "flapping")
    nic_rcv_errors_per_second: float = setting(
        10.0, flag="--nic-rcv-errors-per-second", env="GPU_NODE_AGENT_NIC_RCV_ERRORS_PER_SECOND",
        help="port_rcv_errors per second between two passes above which a port is in an error storm")
    nic_outage_seconds: float = setting(
        30.0, flag="--nic-outage", env="GPU_NODE_AGENT_NIC_OUTAGE",
        help="a port down at least this long is a finding even after it came back (for the hold time)")
    expected_gpus: int = setting(
        0, flag="--expected-gpus", env="GPU_NODE_AGENT_EXPECTED_GPUS",
        help="GPUs this node must have (on the PCI bus and in NVML); 0 means the count at the first scan")
    gpu_state_interval_seconds: float = setting(
        30.0, flag="--gpu-state-interval", env="GPU_NODE_AGENT_GPU_STATE_INTERVAL", zero_ok=True,
        floor=0.1, help="seconds between NVML reads of every GPU's NVLink link states, fabric state and the driver's "
             "recovery action; 0 turns these checks off")
    gpu_fabric_grace_seconds: float = setting(
        600.0, flag="--gpu-fabric-grace", env="GPU_NODE_AGENT_GPU_FABRIC_GRACE", zero_ok=True,
        help="how long a GPU's NVLink fabric registration may stay not started / in progress (after boot the "
             "fabric manager trains the links) before it is a finding")
    unknown_health_action: str = setting(
        "unhealthy", flag="--unknown-health-action", env="GPU_NODE_AGENT_UNKNOWN_HEALTH_ACTION",
        choices=("unhealthy", "keep"),
        help="when a check cannot run (NVML fails to start on a node with NVIDIA GPUs in sysfs, counters "
             "unreadable): 'unhealthy' marks the devices it covers Unhealthy until it runs again; 'keep' leaves "
             "them as they were (health_check_up shows 0 either way)")
    check_actions: list[str] = setting(
        factory=list, flag="--check-action", env="GPU_NODE_AGENT_CHECK_ACTIONS", repeat=True,
        help="override the node verdict of a NIC/PCIe/inventory/NVLink/fabric/recovery-action check as "
             "CHECK=ACTION, e.g. "
             "pcie_downtrained=cordon; checks: " + ", ".join(CHECK_ACTIONS))

    nvsentinel_socket: str = setting(
        "", flag="--nvsentinel-socket", env="GPU_NODE_AGENT_NVSENTINEL_SOCKET",
        help="NVSentinel's platform-connector unix socket to send each health finding and recovery to as a "
             "HealthEvent (on the host /var/run/nvsentinel/nvsentinel.sock); empty (the default) sends nothing")
    nvsentinel_processing_strategy: str = setting(
        "STORE_ONLY", flag="--nvsentinel-processing-strategy", env="GPU_NODE_AGENT_NVSENTINEL_PROCESSING_STRATEGY",
        choices=("STORE_ONLY", "EXECUTE_REMEDIATION"),
        help="what NVSentinel does with the agent's events: STORE_ONLY records and exports them (the agent "
             "remediates by itself); EXECUTE_REMEDIATION lets NVSentinel quarantine and drain as well")

    dcgm_exporter_url: str = setting(
        "", flag="--dcgm-exporter-url", env="GPU_NODE_AGENT_DCGM_EXPORTER_URL",
        help="a dcgm-exporter /metrics URL on this node to read Xid, ECC, row-remap, NVLink and PCIe replay signals "
             "from, e.g. http://$(HOST_IP):9400/metrics; empty (the default) turns the DCGM check off")
    dcgm_scrape_interval_seconds: float = setting(
        15.0, flag="--dcgm-scrape-interval", env="GPU_NODE_AGENT_DCGM_SCRAPE_INTERVAL",
        floor=0.1, help="seconds between scrapes of dcgm-exporter")
    dcgm_scrape_timeout_seconds: float = setting(
        5.0, flag="--dcgm-scrape-timeout", env="GPU_NODE_AGENT_DCGM_SCRAPE_TIMEOUT",
        help="longest wait for one dcgm-exporter scrape")
    dcgm_xid_pairing_window_seconds: float = setting(
        90.0, flag="--dcgm-xid-pairing-window", env="GPU_NODE_AGENT_DCGM_XID_PAIRING_WINDOW",
        help="an Xid DCGM reports within this long of the same Xid on the same GPU from the kernel log or NVML is "
             "the same occurrence (dcgm-exporter samples every 30 s by default, plus the scrape interval)")
    dcgm_nvlink_errors_per_minute: float = setting(
        0.0, flag="--dcgm-nvlink-errors-per-minute", env="GPU_NODE_AGENT_DCGM_NVLINK_ERRORS_PER_MINUTE",
        help="NVLink CRC/replay/recovery errors per minute (the increase between scrapes, never the lifetime "
             "total) above which a GPU's NVLink counts as faulty; 0 means any increase")
    dcgm_pcie_replays_per_minute: float = setting(
        8.0, flag="--dcgm-pcie-replays-per-minute", env="GPU_NODE_AGENT_DCGM_PCIE_REPLAYS_PER_MINUTE",
        help="PCIe replays per minute (increase between scrapes) above which a GPU's PCIe link counts as faulty "
             "(DCGM's own PCIe health watch uses 8)")
    dcgm_link_error_action: str = setting(
        "degraded", flag="--dcgm-link-error-action", env="GPU_NODE_AGENT_DCGM_LINK_ERROR_ACTION", choices=VERDICTS,
        help="node verdict while a GPU's NVLink or PCIe error rate is over its threshold (held like other "
             "'degraded' findings)")

    def check(self) -> None:
        """Reject values that can never work (the loader reports them with the field name)."""
        self.xid_action_overrides()
        for name in ("nvml_poll_interval_seconds", "nvml_event_timeout_seconds", "xid_burst_window_seconds",
                     "degraded_hold_seconds", "dcgm_scrape_interval_seconds", "dcgm_scrape_timeout_seconds",
                     "dcgm_xid_pairing_window_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be greater than 0, got {getattr(self, name)}")
        for name in ("nic_counter_interval_seconds", "nic_hold_seconds", "nic_symbol_errors_per_hour",
                     "nic_flaps_per_minute", "nic_rcv_errors_per_second", "nic_outage_seconds", "expected_gpus",
                     "gpu_state_interval_seconds", "gpu_fabric_grace_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        self.check_action_map()
        for name in ("link_check_interval_seconds", "dcgm_nvlink_errors_per_minute", "dcgm_pcie_replays_per_minute"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.nvsentinel_socket and (not self.nvsentinel_socket.startswith("/") or len(self.nvsentinel_socket) > 107):
            raise ValueError(f"nvsentinel_socket must be an absolute path of a unix socket (at most 107 bytes), "
                             f"got {self.nvsentinel_socket[:120]!r}")
        if self.dcgm_exporter_url and not self.dcgm_exporter_url.startswith(("http://", "https://")):
            raise ValueError(f"dcgm_exporter_url must be an http:// or https:// URL, got {self.dcgm_exporter_url!r}")

    def check_action_map(self) -> dict[str, str]:
        """Every NIC/PCIe/inventory check -> its action (defaults, then `check_actions`); ValueError if malformed."""
        return {**CHECK_ACTIONS, **dict(parse_check_action(item) for item in self.check_actions)}

    def xid_action_overrides(self) -> dict[int, str]:
        """Xid code -> action from `xid_actions`; ValueError on a malformed entry."""
        return dict(parse_xid_override(item) for item in self.xid_actions)
