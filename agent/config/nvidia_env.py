"""NVIDIA k8s-device-plugin's environment variables, honoured where the agent has the same setting.

An operator replacing NVIDIA's plugin often carries its DaemonSet environment over as it is. Its names
(cmd/nvidia-device-plugin/main.go, api/config/v1/flags.go; `../shared/reference/dropin.md` §1.2) are read as
aliases of the agent's own: the agent's name wins when both are set, and every alias used is said once in the log.
A name whose setting the agent does not have either changes nothing about the devices (a warning says it is
ignored) or would change what is served (MPS, GDS/MOFED, IMEX): that is refused (exit 2, naming it), since serving
otherwise than the operator asked hands out the wrong devices. NVIDIA's config file (`CONFIG_FILE`) is read by
`agent.config.nvidia_file`, whose `flags` go through the same tables here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class NvidiaEnvError(ValueError):
    """An NVIDIA plugin setting in the environment that the agent cannot honour."""


def _same(value: str) -> str:
    return value


def _kubelet_dir(value: str) -> str:
    """The device-plugin directory of NVIDIA's kubelet socket path. A relative path (`kubelet.sock`) or one whose
    directory is `/` silently made `/` (or a directory under the agent's working directory) the device-plugin
    directory: refused."""
    directory = os.path.dirname(value.rstrip("/"))
    if not value.startswith("/") or directory in ("", "/"):
        raise NvidiaEnvError(f"KUBELET_SOCKET={value[:200]!r} (NVIDIA device plugin) must be the absolute path of "
                             "the kubelet's socket in its device-plugin directory, e.g. "
                             "/var/lib/kubelet/device-plugins/kubelet.sock")
    return directory


def _ignored_xids(value: str) -> str:
    codes = [part.strip() for part in value.split(",") if part.strip()]
    if not all(code.isdigit() and len(code) <= 4 for code in codes):
        raise NvidiaEnvError(f"DP_DISABLE_HEALTHCHECKS={value[:80]!r}: 'all', 'xids' or a comma list of Xid codes")
    return ",".join(f"{code}=none" for code in codes)


# NVIDIA's name -> (the agent's variable, how the value translates)
ALIASES: Mapping[str, tuple[str, Callable[[str], str]]] = {
    "DEVICE_LIST_STRATEGY": ("GPU_NODE_AGENT_DEVICE_LIST_STRATEGY", _same),
    "DEVICE_ID_STRATEGY": ("GPU_NODE_AGENT_DEVICE_ID_STRATEGY", _same),
    "PASS_DEVICE_SPECS": ("GPU_NODE_AGENT_PASS_DEVICE_SPECS", _same),
    "CDI_ANNOTATION_PREFIX": ("GPU_NODE_AGENT_CDI_ANNOTATION_PREFIX", _same),
    "MIG_STRATEGY": ("GPU_NODE_AGENT_MIG_STRATEGY", _same),
    # NVIDIA: exit when NVML cannot start (default true there). The agent's equivalent is --require-nvml,
    # default false: it also serves NICs and watches links, which need no NVML.
    "FAIL_ON_INIT_ERROR": ("GPU_NODE_AGENT_REQUIRE_NVML", _same),
    "KUBELET_SOCKET": ("GPU_NODE_AGENT_DEVICE_PLUGIN_DIR", _kubelet_dir),
    "CONFIG_FILE": ("GPU_NODE_AGENT_NVIDIA_DP_CONFIG", _same),
    "SHARED_DEVICES_ALLOCATION_POLICY": ("GPU_NODE_AGENT_SHARED_DEVICES_ALLOCATION_POLICY", _same),
}
# NVIDIA's name -> the values that serve what the agent serves (anything else is refused)
REFUSED_UNLESS: Mapping[str, frozenset[str]] = {
    "GDS_ENABLED": frozenset({"false", "0"}),
    "MOFED_ENABLED": frozenset({"false", "0"}),
    "GDRCOPY_ENABLED": frozenset({"false", "0"}),
    "IMEX_REQUIRED": frozenset({"false", "0"}),
    "DEVICE_DISCOVERY_STRATEGY": frozenset({"auto", "nvml"}),
}
# NVIDIA's names that change nothing the agent serves
IGNORED = ("NVIDIA_DRIVER_ROOT", "NVIDIA_DEV_ROOT", "NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH", "DRIVER_ROOT_CTR_PATH",
           "CONTAINER_DRIVER_ROOT", "NVIDIA_MIG_MONITOR_DEVICES", "DP_ENABLE_HEALTHCHECKS",
           "MPS_ROOT", "USE_NODE_FEATURE_API")  # MPS_ROOT matters only with MPS sharing, which is refused


def translate(env: Mapping[str, str], source: str = "environment") -> dict[str, str]:
    """`env` with NVIDIA's names turned into the agent's (the agent's own name wins). Raises NvidiaEnvError for
    a setting that would change what is served and that the agent does not have. `source` names where the
    values came from in log lines."""
    out = dict(env)
    for name, allowed in REFUSED_UNLESS.items():
        value = env.get(name, "").strip()
        if value and value.lower() not in allowed:
            raise NvidiaEnvError(f"{name}={value[:80]!r} (NVIDIA device plugin) is not supported by gpu-node-agent; "
                                 f"unset it or keep NVIDIA's plugin on this node")
    for name, (ours, convert) in ALIASES.items():
        value = env.get(name, "")
        if not value:
            continue
        if env.get(ours, ""):
            log.info("%s: %s (NVIDIA's name) is set, and so is %s, which wins", source, name, ours)
            continue
        out[ours] = convert(value)
        log.info("%s: %s (NVIDIA's name) read as %s=%s", source, name, ours, out[ours])
    _health_checks(env, out)
    for name in IGNORED:
        if env.get(name, ""):
            log.warning("%s: %s (NVIDIA device plugin) changes nothing in gpu-node-agent; ignored", source, name)
    return out


def _health_checks(env: Mapping[str, str], out: dict[str, str]) -> None:
    value = env.get("DP_DISABLE_HEALTHCHECKS", "").strip()
    if not value:
        return
    if value.lower() in ("all", "xids"):
        log.warning("environment: DP_DISABLE_HEALTHCHECKS=%s (NVIDIA's) does not turn the agent's health checks "
                    "off; to count an Xid without acting on it use --xid-action CODE=none", value)
        return
    overrides = _ignored_xids(value)
    if env.get("GPU_NODE_AGENT_XID_ACTIONS", ""):
        log.info("environment: DP_DISABLE_HEALTHCHECKS is set, and so is GPU_NODE_AGENT_XID_ACTIONS, which wins")
        return
    out["GPU_NODE_AGENT_XID_ACTIONS"] = overrides
    log.info("environment: DP_DISABLE_HEALTHCHECKS (NVIDIA's) read as GPU_NODE_AGENT_XID_ACTIONS=%s", overrides)
