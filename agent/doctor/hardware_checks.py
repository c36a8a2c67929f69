"""Checks of what the agent reads from the machine: NVML, the sysfs PCI tree and NICs, the kernel log.

Each function is blocking and read-only (the caller runs it in a thread under a deadline) and returns Checks.
They reuse the readers `run` uses: the NVML port, the topology loaded by `Hardware`, the device plugin's
readiness rule (`pools.not_ready`), the NIC health pass's sysfs reader and the kernel-log reader.
"""

from __future__ import annotations

import os
from collections import Counter

from agent.deviceplugin.pools import not_ready
from agent.doctor.context import Context
from agent.doctor.report import Check, fail, ok, skip, warn
from agent.health.state import StateStore
from agent.host.kmsg import KmsgReader, read_boot_id
from agent.host.nic_sysfs import NicSysfs
from agent.host.nvml import NvmlError
from agent.topology.model import Level, RdmaPort

NVIDIA = "0x10de"
_MAX_LISTED = 8


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f", ... ({more} more)" if more > 0 else "")


def _flag(value: bool | None) -> str:
    return "?" if value is None else "on" if value else "off"


def nvml(ctx: Context) -> list[Check]:
    """Versions, each GPU's basics, which calls and fields the driver answers, event-set creation."""
    port = ctx.hardware.nvml
    in_sysfs = [g for g in ctx.hardware.topology.gpus if g.pci.vendor == NVIDIA]
    if not port.available:
        why = f"NVML unavailable ({port.unavailable_reason or 'no driver'})"
        if not in_sysfs:
            return [skip("nvml", f"{why}; no NVIDIA GPU in sysfs either (a node without GPUs)")]
        fix = "install the NVIDIA driver and mount libnvidia-ml.so.1 into the container (the NVIDIA container " \
              "toolkit does with NVIDIA_DRIVER_CAPABILITIES=utility), or run the agent where the driver is loaded"
        if ctx.cfg.health.require_nvml or ctx.cfg.device_plugin.serve_gpus:
            return [fail("nvml", f"{why}, but sysfs shows {len(in_sysfs)} NVIDIA GPUs", fix)]
        return [warn("nvml", f"{why}, but sysfs shows {len(in_sysfs)} NVIDIA GPUs: GPU identity and NVML health "
                             "checks are off", fix)]
    try:
        inventory = port.inventory()
    except NvmlError as exc:
        return [fail("nvml", f"NVML initialised but its inventory failed: {exc}",
                     "check `nvidia-smi -q` on the node; a driver/library version mismatch needs a reboot")]
    checks = [ok("nvml", f"driver {inventory.driver_version}, NVML {inventory.nvml_version}, CUDA "
                         f"{inventory.cuda_version}, {len(inventory.gpus)} GPUs")]
    for g in inventory.gpus:
        detail = f"{g.name} {g.uuid} {g.bus_id}, MIG {_flag(g.mig_enabled)}, ECC {_flag(g.ecc_enabled)}, " \
                 f"persistence {_flag(g.persistence)}"
        if g.uuid == "?" or not g.bus_id:
            checks.append(fail(f"nvml.gpu{g.index}", detail, "a GPU NVML cannot name is lost or needs a reset: see "
                                                             "`nvidia-smi -q` and the kernel log (Xid 79)"))
        else:
            checks.append(ok(f"nvml.gpu{g.index}", detail))
    missing = sorted({g.bus_id for g in in_sysfs} - {g.bus_id for g in inventory.gpus})
    if missing:
        checks.append(fail("nvml.gpus", f"in sysfs, not listed by NVML: {_listed(missing)}",
                           "the driver did not take these GPUs: see the kernel log (NVRM) and `nvidia-smi -q`"))
    support = inventory.support
    if not support:
        checks.append(skip("nvml.calls", "no GPU to ask"))
        return checks
    detail = ", ".join(f"{k} {v}" for k, v in support.items())
    broken = [k for k, v in support.items() if v.startswith("error")]
    if broken:
        checks.append(warn("nvml.calls", detail, f"{', '.join(broken)} failed: the health checks that need them "
                                                 "report unknown; update the driver or nvidia-ml-py"))
    else:
        checks.append(ok("nvml.calls", detail + " (no: this GPU or driver does not have it; its check is skipped)"))
    return checks


def _wants_rdma(ctx: Context) -> bool:
    dp, dra = ctx.cfg.device_plugin, ctx.cfg.dra
    pools = dp.enabled and (bool(dp.sriov_dp_config) or any(p.selectors.is_rdma for p in dp.pools))
    return pools or (dra.enabled and dra.rdma)


def sysfs(ctx: Context) -> list[Check]:
    """The PCI tree, RDMA devices and their netdevs, VFs and readiness, counters, PCIe width/AER, IOMMU groups."""
    topology, root = ctx.hardware.topology, ctx.hardware.sysfs_root
    if not (root / "bus" / "pci" / "devices").is_dir():
        return [fail("sysfs.topology", f"{root}/bus/pci/devices is not there",
                     "mount the host's /sys (read-only) and point --sysfs-root at it")]
    levels = Counter(topology.level(g.bus_id, n.bus_id).name for g in topology.gpus for n in topology.rdma_nics)
    pairs = ", ".join(f"{name} {levels[name]}" for name in (lvl.name for lvl in Level) if levels[name])
    checks = [ok("sysfs.topology", f"{len(topology.gpus)} GPUs, {len(topology.nics)} NICs "
                                   f"({len(topology.rdma_nics)} RDMA), source {topology.source}"
                                   + (f"; GPU-NIC pairs: {pairs}" if pairs else ""))]
    checks.append(_rdma(ctx))
    checks.append(_vfs(ctx))
    checks.append(_counters(ctx))
    checks.append(_pcie(ctx))
    checks.append(_iommu(ctx))
    checks.append(_locality(ctx))
    return checks


def _locality(ctx: Context) -> Check:
    """The GPU-NIC shapes found (docs/locality.md), and whatever kept a Data Direct NIC from its DMA function."""
    topology = ctx.hardware.topology
    if not topology.gpus or not topology.rdma_nics:
        return skip("sysfs.locality", "no GPU and RDMA NIC to pair")
    paths = Counter(g.gpu_direct_path or "none" for g in topology.gpus)
    detail = "GPUs by GPUDirect path: " + ", ".join(f"{p} {n}" for p, n in sorted(paths.items()))
    data_direct = [n for n in topology.rdma_nics if n.data_direct_function]
    if data_direct:
        detail += "; Data Direct: " + _listed([f"{n.bus_id}->{n.data_direct_function}" for n in data_direct])
    if topology.locality_problems:
        return warn("sysfs.locality", f"{detail}; {_listed(list(topology.locality_problems))}",
                    "the NIC is placed by its own PCIe position (its socket, not its GPU's switch): the agent reads "
                    "`vpd` as root (file mode 0600); check `lspci -vv -s <bus id>` for its VPD (V3), update the NIC "
                    "firmware if it has none, and see rdma_topo (rdma-core) for the node's complexes")
    return ok("sysfs.locality", detail)


def _ports(ports: tuple[RdmaPort, ...]) -> str:
    return "/".join(f"port {p.number} {p.state or '?'}" for p in ports) or "no port"


def _rdma(ctx: Context) -> Check:
    nics = ctx.hardware.topology.rdma_nics
    if not nics:
        detail = f"no RDMA device under {ctx.hardware.sysfs_root}/class/infiniband"
        fix = "load the RDMA driver (mlx5_ib, ib_uverbs), check `rdma link`, and mount the host's /sys"
        return fail("sysfs.rdma", detail + ": the RDMA pools are empty", fix) if _wants_rdma(ctx) \
            else skip("sysfs.rdma", detail + " (no RDMA pool configured)")
    rows = [f"{n.rdma} ({'/'.join(n.netdevs) or 'no netdev'}, {n.link_type or '?'}, {_ports(n.ports)})" for n in nics]
    no_uverbs = [n.rdma or n.bus_id for n in nics if not n.chardevs.uverbs]
    if no_uverbs:
        return warn("sysfs.rdma", _listed(rows), f"no uverbs device for {_listed(no_uverbs)}: load ib_uverbs")
    return ok("sysfs.rdma", _listed(rows))


def _vfs(ctx: Context) -> Check:
    pfs = [n for n in ctx.hardware.topology.nics if n.vfs or n.sriov_totalvfs]
    if not pfs:
        return skip("sysfs.vfs", "no SR-IOV physical function (PFs without VFs are served whole)")
    rows, reasons = [], []
    for pf in pfs:
        why = [r for r in (not_ready(vf, pf) for vf in pf.vfs) if r]
        rows.append(f"{pf.rdma or pf.bus_id}: {len(pf.vfs)}/{pf.sriov_totalvfs} VFs, {len(pf.vfs) - len(why)} ready")
        reasons += why
    if reasons:
        return warn("sysfs.vfs", f"{_listed(rows)}; not ready: {_listed(reasons)}",
                    "VFs that are not ready are not served until they are: bind them to their driver, load the RDMA "
                    "driver, wait for the SR-IOV config daemon")
    return ok("sysfs.vfs", _listed(rows))


def _counters(ctx: Context) -> Check:
    nics = ctx.hardware.topology.rdma_nics
    if not nics:
        return skip("sysfs.counters", "no RDMA device")
    reader = NicSysfs(ctx.hardware.sysfs_root)
    try:
        read, bad = 0, []
        for nic in nics:
            assert nic.rdma is not None
            for port in reader.ports(nic.rdma) or (1,):
                reading, why = reader.read_port(nic.rdma, port)
                if reading is None or not reading.counters:
                    bad.append(why or f"{nic.rdma}/{port}: no counter files")
                else:
                    read += len(reading.counters)
    finally:
        reader.close()
    if bad:
        return warn("sysfs.counters", f"{read} counters read; unreadable: {_listed(bad)}",
                    "the NIC counter checks skip these ports: mount the host's /sys, check the mlx5 driver exposes "
                    "ports/<n>/counters")
    return ok("sysfs.counters", f"{read} IB/RoCE port counters readable on {len(nics)} devices")


def _pcie(ctx: Context) -> Check:
    topology = ctx.hardware.topology
    functions = [g.bus_id for g in topology.gpus] + [n.bus_id for n in topology.nics]
    if not functions:
        return skip("sysfs.pcie", "no GPU or NIC")
    base = ctx.hardware.sysfs_root / "bus" / "pci" / "devices"
    no_width = [f for f in functions if not (base / f / "current_link_width").is_file()]
    no_aer = [f for f in functions if not (base / f / "aer_dev_fatal").is_file()]
    detail = f"{len(functions) - len(no_width)}/{len(functions)} with link width, " \
             f"{len(functions) - len(no_aer)}/{len(functions)} with AER counters"
    if no_width or no_aer:
        return warn("sysfs.pcie", detail + f"; missing: {_listed(sorted(set(no_width) | set(no_aer)))}",
                    "the PCIe width/AER checks skip these functions (AER needs CONFIG_PCIEAER and a device that "
                    "reports it; a VM often has neither)")
    return ok("sysfs.pcie", detail)


def _iommu(ctx: Context) -> Check:
    topology = ctx.hardware.topology
    functions = [g.pci for g in topology.gpus] + [n.pci for n in topology.nics] + \
        [vf.pci for n in topology.nics for vf in n.vfs]
    groups = {f.iommu_group for f in functions if f.iommu_group}
    vfio = [vf.bus_id for n in topology.nics for vf in n.vfs if vf.pci.driver == "vfio-pci" and not vf.pci.iommu_group]
    if vfio:
        return fail("sysfs.iommu", f"vfio-pci VFs without an IOMMU group: {_listed(vfio)}",
                    "enable the IOMMU (intel_iommu=on / amd_iommu=on, iommu=pt) or vfio's no-IOMMU mode")
    if not groups:
        return ok("sysfs.iommu", "IOMMU off (no group): only DPDK pools need one")
    return ok("sysfs.iommu", f"{len(groups)} IOMMU groups over {len(functions)} functions")


def kernel_log(ctx: Context) -> list[Check]:
    """Readable (a first record, non-blocking), and the saved sequence cursor."""
    path = ctx.kmsg
    if not path:
        why = "a simulated node is not judged by the host's kernel log" if ctx.simulated else "--kmsg is empty"
        return [skip("kmsg", f"kernel-log check off ({why})")]
    boot_id = read_boot_id()
    reader = KmsgReader(path, boot_id, batch_limit=1)
    fix = "run the container privileged or with CAP_SYSLOG and mount /dev/kmsg (hostPath, CharDevice); or set " \
          "--kmsg '' to turn the Xid check off"
    try:
        reader.open()
        records, _ = reader.read_available()
    except OSError as exc:
        return [fail("kmsg", f"cannot read {path}: {exc.strerror or exc}", fix)]
    finally:
        reader.close()
    saved = StateStore(ctx.state_dir).load(boot_id) if os.access(ctx.state_dir, os.R_OK) else None
    cursor = saved.cursor if saved is not None and saved.kmsg_path == path else None
    where = f"saved cursor at sequence {cursor.seq}" if cursor and cursor.seq is not None else "no saved cursor"
    kind = "device" if reader.is_device else "file"
    return [ok("kmsg", f"{path} readable ({kind}, {'a record' if records else 'no record'} read); {where}")]

