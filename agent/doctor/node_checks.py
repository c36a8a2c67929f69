"""Checks of the node's kubelet paths, the CDI and state directories, the clock, and the netacct/shaping tools.

Read-only: directories are checked with `os.access`, never by writing; the PodResources socket gets one `List`.
"""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import stat
import time
from pathlib import Path

from agent.doctor.context import Context
from agent.doctor.report import Check, fail, ok, skip, warn
from agent.host.podresources import PodResourcesError
from agent.host.podresources.client import KubeletPodResources

POD_RESOURCES_TIMEOUT = 2.0
_MOUNT = "mount the host's /var/lib/kubelet/{} into the pod (hostPath) or set {}"


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


def device_plugin_dir(ctx: Context) -> Check:
    """The device-plugin directory and the kubelet's Registration socket in it."""
    dp = ctx.cfg.device_plugin
    where = " (stand-in kubelet: simulated node)" if ctx.stand_in else ""
    if not dp.enabled:
        return skip("kubelet.device-plugins", "device plugin off")
    directory = ctx.device_plugin_dir
    if not directory.is_dir():
        return fail("kubelet.device-plugins", f"{directory} is not there",
                    _MOUNT.format("device-plugins", "--device-plugin-dir"))
    sock = directory / "kubelet.sock"
    writable = os.access(directory, os.W_OK | os.X_OK)
    if not writable:
        return fail("kubelet.device-plugins", f"{directory} is not writable: the plugin sockets go there",
                    "mount it read-write and run as root (the kubelet's directory is root's)")
    if _is_socket(sock):
        return ok("kubelet.device-plugins", f"{sock} is a socket, {directory} writable{where}")
    if dp.registration_mode == "plugin-watcher":
        return ok("kubelet.device-plugins", f"{directory} writable; no kubelet.sock (plugin-watcher registration)")
    return fail("kubelet.device-plugins", f"no kubelet socket at {sock}",
                "is the kubelet running with the DevicePlugins feature? mount the directory, not the socket, so a "
                "kubelet restart's new socket is seen")


def sriov_dp_config(ctx: Context) -> Check:
    """The SR-IOV device plugin's config file, read and checked as `run` reads it at start (which refuses it with
    exit 2): the same bounded, non-blocking read and the same name-collision check."""
    from agent.deviceplugin import sriovdp

    name = "sriov-dp-config"
    dp = ctx.cfg.device_plugin
    if not dp.enabled:
        return skip(name, "device plugin off")
    path = dp.sriov_dp_config
    if not path:
        return skip(name, "none set: the NIC pools come from the agent's own config")
    try:
        read = sriovdp.read_config(path, sriovdp.default_prefix(dp))
        sriovdp.with_pools(dp, read)
    except sriovdp.SriovConfigError as exc:
        detail = str(exc) if path in str(exc) else f"{path}: {exc}"
        return fail(name, detail, "`run` refuses this file at start (exit 2): fix it; "
                                  "`gpu-node-agent config --sriov-dp-config PATH --pools` shows what it serves")
    pools = ", ".join(f"{p.resource_prefix}/{p.resource_name}" for p in read.pools) or "none"
    if read.warnings:
        return warn(name, f"{path}: pools {pools}; ignored: {'; '.join(read.warnings)}",
                    "the agent serves the pools and ignores the rest: see `gpu-node-agent config`")
    return ok(name, f"{path}: pools {pools}")


def plugin_registry(ctx: Context) -> Check:
    """The kubelet plugin-watcher directory: needed by DRA and by plugin-watcher registration."""
    needed = ctx.cfg.dra.enabled or (ctx.cfg.device_plugin.enabled
                                     and ctx.cfg.device_plugin.registration_mode == "plugin-watcher")
    directory = ctx.plugin_registry_dir
    if ctx.stand_in:
        return ok("kubelet.plugins-registry", f"{directory} (stand-in kubelet: simulated node)")
    if directory.is_dir() and os.access(directory, os.W_OK | os.X_OK):
        return ok("kubelet.plugins-registry", f"{directory} writable")
    state = "not writable" if directory.is_dir() else "not there"
    if needed:
        return fail("kubelet.plugins-registry", f"{directory} is {state}",
                    _MOUNT.format("plugins_registry", "--plugin-registry-dir"))
    return skip("kubelet.plugins-registry", f"{directory} is {state}; registration uses kubelet.sock")


async def pod_resources(ctx: Context) -> Check:
    """One PodResources `List`, bounded, with its latency."""
    socket = ctx.pod_resources_socket
    if not socket:
        return skip("kubelet.pod-resources", "PodResources off (--pod-resources-socket '')")
    fix = "mount the host's /var/lib/kubelet/pod-resources (the directory) or set --pod-resources-socket; the " \
          "kubelet serves it from 1.20 (KubeletPodResources)"
    if not os.path.exists(socket):
        return fail("kubelet.pod-resources", f"no socket at {socket}", fix)
    client = KubeletPodResources(socket, timeout=POD_RESOURCES_TIMEOUT)
    started = time.monotonic()
    try:
        containers = await client.list(POD_RESOURCES_TIMEOUT)
    except PodResourcesError as exc:
        return fail("kubelet.pod-resources", f"List failed after {time.monotonic() - started:.1f} s: {exc}",
                    fix + "; a kubelet that does not answer leaves GPU resets and isolation drains waiting")
    finally:
        await client.aclose()
    took = (time.monotonic() - started) * 1000
    return ok("kubelet.pod-resources", f"List answered in {took:.0f} ms: {len(containers)} containers")


def cdi(ctx: Context) -> Check:
    """The CDI spec directory writable (os.access only), when the config writes specs there."""
    needed = ctx.cfg.dra.enabled or (ctx.cfg.device_plugin.enabled and ctx.cfg.device_plugin.rdma_cdi)
    directory = ctx.cdi_dir
    if ctx.stand_in:
        return skip("cdi", f"{directory}: the stand-in kubelet's (simulated node)")
    writable = directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)
    if writable:
        return ok("cdi", f"{directory} writable")
    state = "not writable" if directory.is_dir() else "not there"
    if needed:
        return fail("cdi", f"{directory} is {state}", "mount the runtime's CDI directory (/var/run/cdi) read-write "
                                                      "or set --cdi-spec-dir")
    return skip("cdi", f"{directory} is {state} (no CDI spec written with this config)")


def state_dir(ctx: Context) -> Check:
    """The state directory writable (os.access only; `run` creates it when its parent is writable)."""
    directory = ctx.state_dir
    fix = "mount a hostPath at the state directory (--state-dir) read-write; the kernel-log cursor and " \
          "outstanding GPU faults live there"
    if directory.is_dir():
        if os.access(directory, os.W_OK | os.X_OK):
            return ok("state-dir", f"{directory} writable")
        return fail("state-dir", f"{directory} is not writable", fix)
    parent = next((p for p in directory.parents if p.exists()), Path("/"))
    if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        return ok("state-dir", f"{directory} not there yet; {parent} writable, run creates it")
    return fail("state-dir", f"{directory} is not there and {parent} is not writable", fix)


def clock() -> Check:
    """The monotonic clock never goes back and is fine-grained (every interval and deadline uses it)."""
    readings = [time.monotonic() for _ in range(1000)]
    backwards = sum(b < a for a, b in itertools.pairwise(readings))
    resolution = time.get_clock_info("monotonic").resolution
    if backwards or resolution > 0.01:
        return fail("clock", f"monotonic clock: {backwards} steps back, resolution {resolution} s",
                    "the kernel clocksource is broken (see /sys/devices/system/clocksource); timers misbehave")
    return ok("clock", f"monotonic, resolution {resolution * 1e9:.0f} ns")


def _module(name: str, sysfs_root: Path) -> str:
    """loaded, built-in, loadable, or missing (from /sys/module and the kernel's module lists)."""
    if (sysfs_root / "module" / name).exists():
        return "loaded"
    release = Path("/lib/modules") / platform.release()
    for listing, answer in (("modules.builtin", "built-in"), ("modules.dep", "loadable")):
        try:
            text = (release / listing).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if f"/{name}.ko" in text:
            return answer
    return "missing"


def netacct(ctx: Context) -> Check:
    """The tools of the layout network accounting will use, when it is on: `nft` for the native table (layout
    nft, or auto where it answers), else iptables (its backend) and ipset. Read-only: `auto`'s probe packet
    (a throw-away table) is the agent's own start-up step, not the doctor's."""
    if not ctx.cfg.netacct.enabled:
        return skip("netacct", "network accounting off")
    from agent.host.netfilter import Host
    from agent.netacct.engine import Netacct
    from agent.netacct.layout import NotReady

    engine = Netacct(ctx.cfg.netacct, Host(timeout=3.0))
    try:
        return ok("netacct", engine.readiness())
    except NotReady as exc:
        return fail("netacct", exc.why, exc.fix)
    finally:
        engine.close()


_TC_MODULES = ("sch_htb", "ifb", "sch_ingress", "cls_u32", "act_mirred")


def shaping(ctx: Context) -> Check:
    """The traffic-control pieces shaping uses (HTB, IFB, clsact, u32, mirred) and the pod veths."""
    if not ctx.cfg.shaping.enabled:
        return skip("shaping", "shaping off")
    root = ctx.hardware.sysfs_root
    found = {name: _module(name, root) for name in _TC_MODULES}
    try:
        veths = [n for n in os.listdir(root / "class" / "net") if (root / "class" / "net" / n / "device").exists()
                 is False and n not in ("lo",)]
    except OSError:
        veths = []
    detail = ", ".join(f"{k} {v}" for k, v in found.items()) + f"; {len(veths)} virtual interfaces"
    missing = [k for k, v in found.items() if v == "missing"]
    if missing:
        return warn("shaping", detail, f"{', '.join(missing)} not found for this kernel: install the kernel's extra "
                                       "modules (linux-modules-extra) or shaping cannot attach")
    if shutil.which("tc") is None:
        return ok("shaping", detail + " (tc binary absent: shaping uses netlink)")
    return ok("shaping", detail)
