"""Settings of the remediation subsystem: what the agent may do to its own Node through the Kubernetes API.

Every knob that changes how hard the agent hits the API server or how far it goes (drain, uncordon) is here, so
that an operator can roll out with `--dry-run`, a small slot count and drain off, then widen. `check()` rejects
values that would make a 7,500-node fleet hammer the API server (a condition heartbeat under 5 minutes).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from agent.config.fields import PROJECT_DOMAIN, setting

CLOUDS = ("azure", "gcp", "aws")
DRAIN_MODES = ("Immediate", "AllowCompletion", "DeleteAfterTimeout")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
UNCORDON_POLICIES = ("never", "non-hardware", "always")
MIN_HEARTBEAT_SECONDS = 300.0


def parse_selector(text: str) -> tuple[tuple[str, str], ...]:
    """An equality label selector `k=v,k2=v2` (also `k==v`) as (key, value) pairs; ValueError names the bad part.

    Only equality is accepted: a drain rule that silently matched more than the operator meant would evict the
    wrong pods, so anything else (`!=`, `in (..)`, a bare key) is refused rather than guessed."""
    pairs: list[tuple[str, str]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.replace("==", "=", 1).partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key.endswith("!") or not _LABEL_KEY.match(key) or len(key) > 316 \
                or not _LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"podSelector: {part!r} is not an equality requirement key=value")
        pairs.append((key, value))
    return tuple(pairs)


@dataclass
class DrainRule:
    """One `remediation.drainModes` entry: which pods (namespaces and/or labels; empty = any) drain how."""

    namespaces: list[str] = setting(factory=list, help="namespaces this rule covers (empty: every namespace)")
    pod_selector: str = setting("", help="equality label selector k=v,k2=v2 (empty: every pod)")
    mode: str = setting("Immediate", choices=DRAIN_MODES,
                        help="Immediate (evict now), AllowCompletion (never evict; wait until the drain deadline), "
                             "DeleteAfterTimeout (evict timeoutSeconds after the fault)")
    timeout_seconds: float = setting(3600.0, help="DeleteAfterTimeout: seconds from the fault to the eviction; the "
                                                  "most a pod's drain-timeout-seconds annotation may ask for")

    def check(self) -> None:
        """Refuse a rule the drainer could not apply as written."""
        parse_selector(self.pod_selector)
        if self.mode not in DRAIN_MODES:
            raise ValueError(f"mode: {self.mode!r} not one of {', '.join(DRAIN_MODES)}")


@dataclass
class RemediationConfig:
    """Node remediation through the Kubernetes API: cordon, taint, condition, events, drain, slots, preflight."""

    enabled: bool = setting(False, flag="--remediation", env="GPU_NODE_AGENT_REMEDIATION",
                            help="act on this node's API objects (cordon, condition, events, drain)")
    dry_run: bool = setting(False, flag="--dry-run", env="GPU_NODE_AGENT_DRY_RUN",
                            help="decide, log and emit Events, but change nothing else on the cluster")
    prefix: str = setting(PROJECT_DOMAIN, flag="--remediation-prefix", env="GPU_NODE_AGENT_REMEDIATION_PREFIX",
                          help="domain prefix of the agent's taint, annotations and labels")
    pod_name: str = setting("", flag="--pod-name", env="POD_NAME",
                            help="the agent's own pod name (downward API metadata.name); never evicted")
    pod_namespace: str = setting("", flag="--pod-namespace", env="POD_NAMESPACE",
                                 help="the agent's own namespace (downward API metadata.namespace)")
    slot_namespace: str = setting("", flag="--slot-namespace", env="GPU_NODE_AGENT_SLOT_NAMESPACE",
                                  help="namespace of the remediation-slot Leases; the agent's namespace when empty")
    slots: int = setting(3, flag="--remediation-slots", env="GPU_NODE_AGENT_REMEDIATION_SLOTS",
                         help="how many nodes may be cordoned by agents at once (K slot Leases)")
    slot_lease_seconds: float = setting(3600.0, flag="--slot-lease-seconds", env="GPU_NODE_AGENT_SLOT_LEASE_SECONDS",
                                        help="slot Lease duration; renewed at a third of it while held")
    slot_retry_seconds: float = setting(300.0, flag="--slot-retry-seconds", env="GPU_NODE_AGENT_SLOT_RETRY_SECONDS",
                                        floor=1.0,
                                        help="how long a deferred remediation waits before looking for a slot again")
    healthy_window_seconds: float = setting(
        1800.0, flag="--healthy-window", env="GPU_NODE_AGENT_HEALTHY_WINDOW",
        help="seconds a node must stay healthy before the agent lifts its own cordon")
    uncordon_policy: str = setting(
        "non-hardware", flag="--uncordon-policy", env="GPU_NODE_AGENT_UNCORDON_POLICY", choices=UNCORDON_POLICIES,
        help="which cordons the agent lifts by itself: never, only non-hardware faults, or always")
    uncordon_allow_reasons: list[str] = setting(
        factory=list, flag="--uncordon-allow-reason", env="GPU_NODE_AGENT_UNCORDON_ALLOW_REASONS", repeat=True,
        help="reasons (e.g. GpuXid79) that may be uncordoned even though they are hardware faults")
    uncordon_deny_reasons: list[str] = setting(
        factory=list, flag="--uncordon-deny-reason", env="GPU_NODE_AGENT_UNCORDON_DENY_REASONS", repeat=True,
        help="reasons that stay cordoned until a person uncordons, whatever the policy")
    drain: bool = setting(True, flag="--drain", env="GPU_NODE_AGENT_DRAIN",
                          help="evict pods on drain verdicts (off: drain verdicts only cordon)")
    drain_deadline_seconds: float = setting(
        3600.0, flag="--drain-deadline", env="GPU_NODE_AGENT_DRAIN_DEADLINE",
        help="seconds after which an unfinished drain stops and is reported")
    drain_modes: list[DrainRule] = setting(
        factory=list, help="per-workload drain modes, first match wins: namespaces, podSelector, mode, timeoutSeconds")
    default_drain_mode: str = setting(
        "Immediate", flag="--default-drain-mode", env="GPU_NODE_AGENT_DEFAULT_DRAIN_MODE", choices=DRAIN_MODES,
        help="drain mode of a pod no drainModes rule matches")
    default_drain_timeout_seconds: float = setting(
        1800.0, flag="--default-drain-timeout", env="GPU_NODE_AGENT_DEFAULT_DRAIN_TIMEOUT",
        help="DeleteAfterTimeout as defaultDrainMode: seconds from the fault to the eviction")
    latch_count: int = setting(
        3, flag="--latch-count", env="GPU_NODE_AGENT_LATCH_COUNT",
        help="remediations (cordon, GPU reset, reboot request) within latchWindowSeconds after which the node stays "
             "cordoned as NeedsHumanAttention until a person removes the annotation (0: off)")
    latch_window_seconds: float = setting(
        604800.0, flag="--latch-window", env="GPU_NODE_AGENT_LATCH_WINDOW",
        help="window in seconds over which remediations are counted for the latch (default 7 days)")
    reboot_sentinel_path: str = setting(
        "", flag="--reboot-sentinel", env="GPU_NODE_AGENT_REBOOT_SENTINEL",
        help="file to create when a fault needs a reboot, after the cordon and the drain (kured's sentinel: the "
             "host's /var/run/reboot-required, mounted into the agent's container; empty: off); it must lie under "
             "rebootSentinelDir")
    reboot_sentinel_dir: str = setting(
        "", flag="--reboot-sentinel-dir", env="GPU_NODE_AGENT_REBOOT_SENTINEL_DIR",
        help="the only directory the reboot sentinel may be created in, e.g. the agent's own hostPath mount "
             "/host/run/gpu-node-agent (empty: stateDir); never /, /proc, /sys, /dev, /etc, /boot, /usr or a "
             "directory under them")
    reboot_condition_type: str = setting(
        "", flag="--reboot-condition-type", env="GPU_NODE_AGENT_REBOOT_CONDITION_TYPE",
        help="NodeCondition set True when a fault needs a reboot and False after it (for NodeHealthCheck or "
             "Karpenter node repair), e.g. GpuNodeRebootRequired; empty: off")
    gpu_reset_command: list[str] = setting(
        factory=list, flag="--gpu-reset-command-arg", env="GPU_NODE_AGENT_GPU_RESET_COMMAND", repeat=True,
        help="command as argv (no shell) that resets one GPU once no process uses it, for faults whose catalog "
             "recovery is a GPU reset; {busId}, {index} and {uuid} in an argument are replaced, e.g. "
             "nvidia-smi --gpu-reset -i {uuid} (needs a privileged container; empty: off)")
    gpu_reset_timeout_seconds: float = setting(
        120.0, flag="--gpu-reset-timeout", env="GPU_NODE_AGENT_GPU_RESET_TIMEOUT",
        help="seconds before the GPU reset command is killed and the reset counted as failed")
    gpu_reset_verify_seconds: float = setting(
        300.0, flag="--gpu-reset-verify", env="GPU_NODE_AGENT_GPU_RESET_VERIFY",
        help="seconds after a reset within which the GPU's checks must pass again, else the reset failed")
    eviction_backoff_seconds: float = setting(
        5.0, flag="--eviction-backoff", env="GPU_NODE_AGENT_EVICTION_BACKOFF",
        floor=0.1, help="first wait after a 429 (PodDisruptionBudget) eviction refusal; doubles up to the maximum")
    eviction_backoff_max_seconds: float = setting(
        120.0, flag="--eviction-backoff-max", env="GPU_NODE_AGENT_EVICTION_BACKOFF_MAX",
        help="longest wait between eviction retries after 429")
    eviction_blocked_retry_seconds: float = setting(
        300.0, flag="--eviction-blocked-retry", env="GPU_NODE_AGENT_EVICTION_BLOCKED_RETRY",
        floor=1.0, help="wait after a 500 eviction refusal (e.g. several PDBs select the pod) before trying again")
    preflight_taint: str = setting(
        f"{PROJECT_DOMAIN}/preflight", flag="--preflight-taint", env="GPU_NODE_AGENT_PREFLIGHT_TAINT",
        help="taint key that marks a node not yet checked; removed when the checks pass (empty: off)")
    preflight_gpu_count: int = setting(0, flag="--preflight-gpu-count", env="GPU_NODE_AGENT_PREFLIGHT_GPU_COUNT",
                                       help="GPUs the node must show for preflight to pass (0: not checked)")
    preflight_command: list[str] = setting(
        factory=list, flag="--preflight-command-arg", env="GPU_NODE_AGENT_PREFLIGHT_COMMAND", repeat=True,
        help="operator preflight command as argv (no shell); it passes when it exits 0")
    preflight_command_timeout_seconds: float = setting(
        300.0, flag="--preflight-command-timeout", env="GPU_NODE_AGENT_PREFLIGHT_COMMAND_TIMEOUT",
        help="seconds before the operator preflight command is killed and counted as failed")
    preflight_retry_seconds: float = setting(
        600.0, flag="--preflight-retry", env="GPU_NODE_AGENT_PREFLIGHT_RETRY",
        zero_ok=True,
        floor=1.0, help="seconds between preflight attempts while it fails (0: try once)")
    maintenance_clouds: list[str] = setting(
        factory=list, flag="--maintenance-cloud", env="GPU_NODE_AGENT_MAINTENANCE_CLOUDS", repeat=True,
        help="clouds whose scheduled maintenance events to poll: azure, gcp, aws (empty: off)")
    maintenance_base_url: str = setting(
        "http://169.254.169.254", flag="--maintenance-base-url", env="GPU_NODE_AGENT_MAINTENANCE_BASE_URL",
        help="instance metadata endpoint (a local server in tests)")
    maintenance_poll_seconds: float = setting(
        10.0, flag="--maintenance-poll", env="GPU_NODE_AGENT_MAINTENANCE_POLL",
        floor=1.0, help="seconds between metadata polls (local only, no API server load)")
    maintenance_drain_before_seconds: float = setting(
        0.0, flag="--maintenance-drain-before", env="GPU_NODE_AGENT_MAINTENANCE_DRAIN_BEFORE",
        zero_ok=True,
        help="start draining this many seconds before a maintenance event's NotBefore (0: only cordon)")
    condition_type: str = setting("GpuUnhealthy", flag="--condition-type", env="GPU_NODE_AGENT_CONDITION_TYPE",
                                  help="NodeCondition type the agent owns (True means a problem)")
    condition_heartbeat_seconds: float = setting(
        300.0, flag="--condition-heartbeat", env="GPU_NODE_AGENT_CONDITION_HEARTBEAT",
        help="seconds between unchanged condition heartbeats (at least 300)")

    def check(self) -> None:
        """Reject settings that are unsafe at fleet scale; the message names the setting and the fix."""
        if self.slots < 1:
            raise ValueError(f"slots: {self.slots} must be at least 1 (set dryRun to observe without acting)")
        if self.condition_heartbeat_seconds < MIN_HEARTBEAT_SECONDS:
            raise ValueError(f"conditionHeartbeatSeconds: {self.condition_heartbeat_seconds} is under "
                             f"{MIN_HEARTBEAT_SECONDS:.0f}; at 7,500 nodes that floods the API server")
        unknown = sorted(set(self.maintenance_clouds) - set(CLOUDS))
        if unknown:
            raise ValueError(f"maintenanceClouds: {', '.join(unknown)} not one of {', '.join(CLOUDS)}")
        for name in ("slot_lease_seconds", "slot_retry_seconds", "maintenance_poll_seconds",
                     "eviction_backoff_seconds", "preflight_command_timeout_seconds", "gpu_reset_timeout_seconds",
                     "gpu_reset_verify_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        timeouts = [(f"drainModes[{i}].timeoutSeconds", r.timeout_seconds) for i, r in enumerate(self.drain_modes)
                    if r.mode == "DeleteAfterTimeout"]
        if self.default_drain_mode == "DeleteAfterTimeout":
            timeouts.append(("defaultDrainTimeoutSeconds", self.default_drain_timeout_seconds))
        for name, timeout in timeouts:
            if timeout >= self.drain_deadline_seconds:
                raise ValueError(f"{name}: {timeout:.0f} is not under "
                                 f"drainDeadlineSeconds ({self.drain_deadline_seconds:.0f}); the drain would stop "
                                 f"before the eviction: raise drainDeadlineSeconds or lower the timeout")
        if self.latch_count < 0:
            raise ValueError(f"latchCount: {self.latch_count} must be 0 (off) or more")
        check_sentinel_path(self.reboot_sentinel_path, self.reboot_sentinel_dir)
        check_reset_command(self.gpu_reset_command)
        if self.reboot_condition_type and (not _CONDITION_TYPE.match(self.reboot_condition_type)
                                           or self.reboot_condition_type == self.condition_type):
            raise ValueError(f"rebootConditionType: {self.reboot_condition_type!r} must be a CamelCase name other "
                             f"than conditionType ({self.condition_type})")
        if self.uncordon_policy not in UNCORDON_POLICIES:
            raise ValueError(f"uncordonPolicy: {self.uncordon_policy!r} not one of {', '.join(UNCORDON_POLICIES)}")

    @property
    def reboot_requests(self) -> bool:
        """Whether faults that need a reboot are handed on (a sentinel file, a NodeCondition or both)."""
        return bool(self.reboot_sentinel_path or self.reboot_condition_type)

    @property
    def gpu_resets(self) -> bool:
        """Whether GPUs whose fault a reset cures are reset (a reset command is configured)."""
        return bool(self.gpu_reset_command)

    def lease_namespace(self) -> str:
        """Where slot Leases live: the configured namespace, else the agent's own, else `default`."""
        return self.slot_namespace or self.pod_namespace or "default"


_CONDITION_TYPE = re.compile(r"^[A-Z][A-Za-z0-9]{0,62}$")


#: Directories the sentinel may never be written in, whatever rebootSentinelDir says: the host's system files.
SYSTEM_DIRS = ("/proc", "/sys", "/dev", "/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/root")


def _normalised(path: str) -> bool:
    return (path.startswith("/") and posixpath.normpath(path) == path and ".." not in path.split("/")
            and "\0" not in path and path != "/")


def check_sentinel_path(path: str, directory: str = "") -> None:
    """An absolute, normalised path with no `..` (empty: off), strictly under `directory` when one is given (the
    loader gives stateDir when rebootSentinelDir is empty); ValueError names the setting."""
    if not path:
        return
    if not _normalised(path):
        raise ValueError(f"rebootSentinelPath: {path!r} must be an absolute, normalised file path without '..'")
    if not directory:
        return
    if not _normalised(directory) or any(directory == d or directory.startswith(d + "/") for d in SYSTEM_DIRS):
        raise ValueError(f"rebootSentinelDir: {directory!r} must be an absolute, normalised directory of the "
                         f"agent's own (not /, {', '.join(SYSTEM_DIRS)} or under them)")
    if not path.startswith(directory + "/"):
        raise ValueError(f"rebootSentinelPath: {path!r} is not under rebootSentinelDir {directory!r} (empty "
                         f"rebootSentinelDir means stateDir): set rebootSentinelDir to the directory mounted for it")


#: The placeholders a GPU reset argument may hold; each is replaced by a value the agent checked itself.
RESET_PLACEHOLDERS = ("{busId}", "{index}", "{uuid}")
RESET_PLACEHOLDER = re.compile(r"\{busId\}|\{index\}|\{uuid\}")


def check_reset_command(argv: list[str]) -> None:
    """A fixed program (no placeholder in argv[0]) and no brace but the known placeholders; ValueError says which."""
    if not argv:
        return
    if not argv[0] or RESET_PLACEHOLDER.search(argv[0]):
        raise ValueError(f"gpuResetCommand: the program {argv[0]!r} must be a fixed, non-empty path or name")
    for arg in argv:
        rest = RESET_PLACEHOLDER.sub("", arg)
        if "{" in rest or "}" in rest or "\0" in arg:
            raise ValueError(f"gpuResetCommand: {arg!r} holds a brace that is not one of "
                             f"{', '.join(RESET_PLACEHOLDERS)}")
