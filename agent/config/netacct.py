"""Settings of the netacct subsystem: network accounting with a native nftables table (counted sets, named
counters) or, on nodes where that does not work, iptables mangle rules and ipset counters.

The internal set decides what is "cluster" traffic; everything else is "internet". It lives in an ipset, not in
rules, so changing it never rewrites a rule nor resets a counter. It and the pods file are the node's pod settings
(`agent.config.pods`), shared with shaping: their keys stay in this section so none is renamed. `check()` rejects
malformed CIDRs at load time, so that a typo exits with code 2 naming the field instead of failing later inside
`ipset restore`.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.config.fields import setting
from agent.config.files import check_files
from agent.config.pods import DEFAULT_INTERNAL_CIDRS, Network, check_internal_cidrs, internal_networks

BACKENDS = ("auto", "nft", "legacy")
LAYOUTS = ("auto", "ebpf", "nft", "iptables")


def _default_internal() -> list[str]:
    return list(DEFAULT_INTERNAL_CIDRS)


@dataclass
class NetacctConfig:
    """Network accounting (iptables mangle rules and ipset counters)."""

    enabled: bool = setting(False, flag="--netacct", env="GPU_NODE_AGENT_NETACCT",
                            help="count node and pod traffic (internet vs cluster) with iptables mangle rules "
                                 "and ipset counters; needs NET_ADMIN and the host network namespace")
    internal_cidrs: list[str] = setting(
        factory=_default_internal, flag="--internal-cidr", env="GPU_NODE_AGENT_INTERNAL_CIDRS", repeat=True,
        help="address range counted as cluster traffic (pod, service and node subnets); giving any replaces the "
             "default set: RFC 1918, 100.64.0.0/10, 169.254.0.0/16, fc00::/7, fe80::/10")
    pods_file: str | None = setting(
        None, flag="--pods-file", env="GPU_NODE_AGENT_PODS_FILE",
        help='JSON file listing this node\'s pods, {"pods":[{"namespace":..,"name":..,"ips":[..]}]} (optional per '
             'pod: "uid" and "annotations", for shaping), re-read on change (standalone use instead of the '
             "Kubernetes pod watch)")
    per_pod_metrics: bool = setting(True, flag="--netacct-per-pod", env="GPU_NODE_AGENT_NETACCT_PER_POD",
                                    help="export per-pod byte counters (one series per pod, traffic class and "
                                         "direction); turn off to save Prometheus cardinality")
    layout: str = setting("auto", flag="--netacct-layout", env="GPU_NODE_AGENT_NETACCT_LAYOUT", choices=LAYOUTS,
                          help="where the counting rules live: ebpf (the agent's own tc programs and pinned per-CPU "
                               "maps; needs CAP_BPF and a bpffs), nft (one native nftables table with counted "
                               "sets), iptables (mangle chains and ipsets, for nodes without a usable nf_tables), "
                               "or auto (ebpf when its programs load and attach, else nft when a probe packet "
                               "through a counted set is counted, else iptables); a change migrates on the next "
                               "start, counters carried over")
    backend: str = setting("auto", flag="--netacct-backend", env="GPU_NODE_AGENT_NETACCT_BACKEND",
                           choices=BACKENDS,
                           help="iptables backend of the iptables layout: auto follows the kubelet's hint chain "
                                "(default nft)")
    ipv6: bool = setting(True, flag="--netacct-ipv6", env="GPU_NODE_AGENT_NETACCT_IPV6",
                         help="also account IPv6 with ip6tables (turn off on nodes without IPv6)")
    sync_interval_seconds: float = setting(
        30.0, flag="--netacct-sync-interval", env="GPU_NODE_AGENT_NETACCT_SYNC_INTERVAL",
        floor=1.0, help="seconds between full re-checks of rules and sets (pod changes are applied at once)")
    bpffs_dir: str = setting("/sys/fs/bpf/gpu-node-agent", flag="--bpffs-dir", env="GPU_NODE_AGENT_BPFFS_DIR",
                             help="directory on a bpf filesystem where the ebpf layout pins its maps and links "
                                  "(mounted there when no bpffs is); run, netacct cleanup and doctor take it")
    lock_wait_seconds: int = setting(5, flag="--netacct-lock-wait", env="GPU_NODE_AGENT_NETACCT_LOCK_WAIT",
                                     zero_ok=True,
                                     help="seconds iptables-restore waits for the xtables lock (/run/xtables.lock)")

    def check(self) -> None:
        """Reject malformed CIDRs, non-positive intervals and a pods file that is no regular file (the loader
        reports them with exit code 2)."""
        check_files(("podsFile", self.pods_file))
        check_internal_cidrs(self.internal_cidrs)
        if not self.sync_interval_seconds > 0:
            raise ValueError(f"syncIntervalSeconds: must be positive, got {self.sync_interval_seconds!r}")
        if not self.bpffs_dir.startswith("/") or "." in self.bpffs_dir or "\0" in self.bpffs_dir:
            raise ValueError(f"bpffsDir: must be an absolute path without '.' (bpffs refuses dots in pin paths), "
                             f"got {self.bpffs_dir!r}")
        if self.lock_wait_seconds < 0:
            raise ValueError(f"lockWaitSeconds: must be zero or positive, got {self.lock_wait_seconds!r}")

    def internal_networks(self) -> list[Network]:
        """The internal set as networks (call after `check()`); netacct's and shaping's alike."""
        return internal_networks(self.internal_cidrs)
