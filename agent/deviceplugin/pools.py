"""Turn the node's topology and the pool config into the resources the device plugin serves.

This is the SR-IOV network device plugin's resource-pool model, so an operator can carry a resourceList over:
each pool has a name, a prefix and selectors; a NIC function joins the first pool whose selectors all match.
The candidates are the VFs of each physical function, plus a physical function that has no VFs. Whole GPUs
form one more pool when `serve_gpus` is on. The result is plain data that the servers, Allocate and the
preferred-allocation policy read; a rescan builds a new one. GPU resources named in `timeSlicing` (NVIDIA's
`sharing.timeSlicing`) serve each device as replicas `<id>::<n>` (`share`).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property

from agent.config.model import DevicePluginConfig, PoolConfig, SelectorConfig
from agent.config.resources import resource_name_problem
from agent.config.sharing import TimeSlicingConfig
from agent.placement.replicas import physical
from agent.topology.model import BusIdError, Gpu, MigDevice, Nic, Topology, Vf, normalize_bus_id

log = logging.getLogger(__name__)

#: Drivers a DPDK pool binds its VFs to: the container opens them through /dev/vfio or /dev/uio*, as the SR-IOV
#: device plugin serves them (pkg/factory GetDefaultInfoProvider)
VFIO_DRIVER = "vfio-pci"
UIO_DRIVERS = frozenset({"uio", "igb_uio", "uio_pci_generic"})

_SOCKET_NAME_MAX = 40


class PoolConfigError(ValueError):
    """The pool configuration cannot be served (bad or duplicate resource names)."""


@dataclass(frozen=True)
class PoolDevice:
    """One device the kubelet can hand out: a VF, a VF-less PF, or a whole GPU.

    `id` is what the kubelet sees: the function's bus id for NICs, the GPU UUID for GPUs, the MIG UUID for MIG
    devices, and `<that id>::<n>` for replica n of a time-sliced one (NVIDIA's annotated IDs).
    """

    id: str
    bus_id: str
    numa: int | None
    function: Vf | Nic | None = None  # NIC pools
    pf: Nic | None = None  # the physical function (itself for a VF-less PF)
    gpu: Gpu | None = None  # GPU pools: the GPU, or a MIG device's parent (whose bus id and NUMA node it has)
    mig: MigDevice | None = None  # MIG pools
    replica: int | None = None  # time-sliced: which replica of the device `physical_id` names

    @property
    def physical_id(self) -> str:
        """The device behind this ID: itself, or the GPU (or MIG device) a replica shares. Health is recorded
        under it, so all replicas of a GPU go Unhealthy together."""
        return physical(self.id) if self.replica is not None else self.id

    @property
    def rdma(self) -> str | None:
        """RDMA device name (`mlx5_3`) of a NIC function, None for GPUs and non-RDMA functions."""
        return self.function.rdma if self.function is not None else None


@dataclass(frozen=True)
class ResourcePool:
    """One extended resource and its devices in a stable order (bus-id order for NICs, index for GPUs)."""

    prefix: str
    name: str
    kind: str  # "nic" or "gpu"
    devices: tuple[PoolDevice, ...] = ()
    exclude_topology: bool = False
    fail_requests_greater_than_one: bool = False  # replicas: an Allocate of more than one is refused
    # the node the pool was built from, for policies that look beyond the pool (GPU <-> NIC distance)
    topology: Topology | None = field(default=None, compare=False, repr=False)

    @property
    def resource_name(self) -> str:
        """Full name the kubelet registers, e.g. `gpunodeagent.io/sriov_rdma`."""
        return f"{self.prefix}/{self.name}"

    @cached_property
    def _by_id(self) -> dict[str, PoolDevice]:
        # built once per pool (a rescan builds a new one): Allocate and health look devices up by ID, and a
        # replica pool holds up to 8,192 of them
        found: dict[str, PoolDevice] = {}
        for device in self.devices:
            found.setdefault(device.id, device)
        return found

    @cached_property
    def _by_physical(self) -> dict[str, tuple[str, ...]]:
        grouped: dict[str, list[str]] = {}
        for device in self.devices:
            grouped.setdefault(device.physical_id, []).append(device.id)
        return {physical_id: tuple(ids) for physical_id, ids in grouped.items()}

    def indexed(self) -> ResourcePool:
        """The pool with its lookups (IDs, by ID, by physical device) built now rather than at the first call
        that reads them: the manager builds a big pool's in a worker thread, before the loop serves it."""
        for lookup in ("ids", "_by_id", "_by_physical"):
            getattr(self, lookup)
        return self

    def device(self, device_id: str) -> PoolDevice | None:
        """The device with this ID, or None."""
        return self._by_id.get(device_id)

    @cached_property
    def ids(self) -> tuple[str, ...]:
        """Device IDs in pool order."""
        return tuple(d.id for d in self.devices)

    @property
    def replicated(self) -> bool:
        """True when the pool serves time-sliced replicas."""
        return any(d.replica is not None for d in self.devices)

    def serves_physical(self, device_id: str) -> bool:
        """Whether a device of the pool is `device_id` or one of its replicas (health events name those)."""
        return device_id in self._by_physical

    def ids_of(self, physical_ids: Iterable[str]) -> frozenset[str]:
        """The pool's IDs of these devices (each device itself, or all its replicas); the cost is that of
        `physical_ids`, not of the pool."""
        return frozenset(i for physical_id in physical_ids for i in self._by_physical.get(physical_id, ()))


@dataclass(frozen=True)
class PoolScan:
    """The pools found in one topology, and devices left out with the reason (for one warning per change)."""

    pools: tuple[ResourcePool, ...]
    skipped: tuple[str, ...] = ()
    # devices left out, by reason: not_ready, default_route, no_uuid, mig, mig_strategy (for the metric)
    not_served: dict[str, int] = field(default_factory=dict, compare=False)

    def by_name(self) -> dict[str, ResourcePool]:
        """Pools keyed by full resource name."""
        return {pool.resource_name: pool for pool in self.pools}


def socket_name(resource_name: str) -> str:
    """Short, stable socket file name for a resource: `gna-<name>.sock`, hashed when the name is long.

    The prefix is dropped to keep the path short; a hash of the full name keeps two prefixes apart.
    """
    name = resource_name.rsplit("/", 1)[-1]
    digest = hashlib.sha256(resource_name.encode()).hexdigest()[:8]
    if len(name) > _SOCKET_NAME_MAX - 18:
        name = name[: _SOCKET_NAME_MAX - 18]
    return f"gna-{name}-{digest}.sock"


def check_resource_name(prefix: str, name: str, *, dots: bool = False) -> None:
    """Raise PoolConfigError unless `prefix/name` is an extended resource name the kubelet accepts."""
    problem = resource_name_problem(prefix, name, dots=dots)
    if problem:
        raise PoolConfigError(problem)


def _pool_prefix(pool: PoolConfig, config: DevicePluginConfig) -> str:
    return pool.resource_prefix or config.resource_prefix


def check_config(config: DevicePluginConfig) -> None:
    """Validate every pool name and that no two pools (GPU pool included) share a resource name."""
    seen: set[str] = set()
    names = []
    for pool in config.pools:
        prefix = _pool_prefix(pool, config)
        check_resource_name(prefix, pool.resource_name)
        names.append(f"{prefix}/{pool.resource_name}")
    if config.serve_gpus:
        prefix, _, name = config.gpu_resource_name.rpartition("/")
        if not prefix:
            raise PoolConfigError(f"GPU resource name {config.gpu_resource_name!r} needs a prefix, "
                                  "e.g. nvidia.com/gpu")
        check_resource_name(prefix, name)
        names.append(config.gpu_resource_name)
    for full in names:
        if full in seen:
            raise PoolConfigError(f"resource {full} is configured twice")
        seen.add(full)


def _hex(text: str) -> str:
    text = text.strip().lower()
    return text[2:] if text.startswith("0x") else text


def _ranged(entries: list[str], key: str, vf_index: int | None, normalize: bool = False) -> bool:
    """True when `key` is listed, honouring SR-IOV DP's `name#0,2-5` VF-index ranges (VFs only)."""
    for entry in entries:
        name, sep, ranges = entry.partition("#")
        if normalize:
            try:
                name = normalize_bus_id(name)
            except BusIdError:
                continue
        if name != key:
            continue
        if not sep:
            return True
        if vf_index is not None and _in_ranges(ranges, vf_index):
            return True
    return False


def _in_ranges(ranges: str, index: int) -> bool:
    for part in ranges.split(","):
        low, _, high = part.strip().partition("-")
        try:
            if int(low) <= index <= int(high or low):
                return True
        except ValueError:
            log.warning("ignoring bad VF range %r in a selector", part)
    return False


def _link_type(function: Vf | Nic, pf: Nic) -> str:
    """The function's own link type when sysfs gave one, else its PF's."""
    return (getattr(function, "link_type", "") or pf.link_type).lower()


def matches(selector: SelectorConfig, function: Vf | Nic, pf: Nic) -> bool:
    """True when every non-empty selector field matches this VF (or VF-less PF) of `pf`."""
    pci = function.pci
    vf_index = function.vf_index if isinstance(function, Vf) else None
    checks = (
        not selector.vendors or _hex(pci.vendor) in {_hex(v) for v in selector.vendors},
        not selector.devices or _hex(pci.device) in {_hex(d) for d in selector.devices},
        not selector.drivers or pci.driver in selector.drivers,
        not selector.pf_names or any(_ranged(selector.pf_names, n, vf_index) for n in pf.netdevs),
        not selector.root_devices or _ranged(selector.root_devices, pf.bus_id, vf_index, normalize=True),
        not selector.pci_addresses or _ranged(selector.pci_addresses, function.bus_id, None, normalize=True),
        not selector.link_types or _link_type(function, pf) in {t.strip().lower() for t in selector.link_types},
        selector.is_rdma is None or (function.rdma is not None) == selector.is_rdma,
    )
    return all(checks)


def not_ready(function: Vf | Nic, pf: Nic) -> str:
    """Why a NIC function cannot be handed out yet, or "" when it can.

    Advertising a VF before it is configured is a known production failure (OpenShift blocks the SR-IOV device
    plugin until its config daemon is done; the RDMA shared plugin checks every char device). Ready means: bound
    to a kernel driver; when it runs its PF's driver on an RDMA NIC, its RDMA device and uverbs node exist (the
    RDMA driver may load later); an RDMA device always comes with its uverbs node; and the PF's link state is
    known (its RDMA ports report a state, or it has a netdev).
    """
    kind = "VF" if isinstance(function, Vf) else "NIC"
    if not function.pci.driver:
        return f"{kind} {function.bus_id} is bound to no driver"
    if function.pci.driver == VFIO_DRIVER and not function.pci.iommu_group:
        return f"{kind} {function.bus_id} is bound to vfio-pci but has no IOMMU group (/dev/vfio/<group>)"
    if function.pci.driver in UIO_DRIVERS and not function.pci.uio:
        return f"{kind} {function.bus_id} is bound to {function.pci.driver} but has no UIO device"
    if function.rdma is None and pf.rdma is not None and function.pci.driver == pf.pci.driver:
        return f"{kind} {function.bus_id} has no RDMA device yet ({pf.bus_id} is {pf.rdma})"
    if function.rdma is not None and not function.chardevs.uverbs:
        return f"{kind} {function.bus_id} ({function.rdma}) has no uverbs device"
    if (pf.rdma is not None and not (pf.ports and all(port.state for port in pf.ports))) or \
            (pf.rdma is None and not pf.netdevs):
        return f"{kind} {function.bus_id}: link state of {pf.bus_id} is unknown"
    return ""


def _candidates(topology: Topology, skipped: list[str], counts: Counter[str]) -> list[tuple[Vf | Nic, Nic]]:
    """Ready NIC functions: every VF, and each PF that has none unless it is the node's uplink."""
    found: list[tuple[Vf | Nic, Nic]] = []
    for nic in sorted(topology.nics, key=lambda n: n.bus_id):
        functions: list[Vf | Nic]
        if nic.vfs:
            functions = sorted(nic.vfs, key=lambda v: v.bus_id)
        elif uplinks := sorted(set(nic.netdevs) & topology.default_route_netdevs):
            skipped.append(f"NIC {nic.bus_id} carries the default route ({', '.join(uplinks)})")
            counts["default_route"] += 1
            continue
        else:
            functions = [nic]
        for function in functions:
            if reason := not_ready(function, nic):
                skipped.append(reason)
                counts["not_ready"] += 1
            else:
                found.append((function, nic))
    return found


def build_pools(topology: Topology, config: DevicePluginConfig, *, expand: bool = True) -> PoolScan:
    """All pools for this topology. Every configured pool is present, even when it has no devices.

    `expand=False`: time-sliced pools keep their served name but list each device once, not as its replicas
    (enough to check names and socket paths, at a 1024th of the cost). Raises PoolConfigError for names the
    kubelet would refuse (`check_config`).
    """
    check_config(config)
    skipped: list[str] = []
    counts: Counter[str] = Counter()
    members: list[list[PoolDevice]] = [[] for _ in config.pools]
    for function, pf in _candidates(topology, skipped, counts):
        for i, pool in enumerate(config.pools):
            if any(matches(selector, function, pf) for selector in (pool.selectors, *pool.selector_list)):
                members[i].append(PoolDevice(id=function.bus_id, bus_id=function.bus_id, numa=pf.numa,
                                             function=function, pf=pf))
                break
    pools = [ResourcePool(prefix=_pool_prefix(pool, config), name=pool.resource_name, kind="nic",
                          devices=tuple(devices), exclude_topology=pool.exclude_topology, topology=topology)
             for pool, devices in zip(config.pools, members, strict=True)]
    if config.serve_gpus:
        pools.extend(share(gpu_pools(topology, config, skipped, counts), config.time_slicing, expand=expand))
    return PoolScan(pools=tuple(pools), skipped=tuple(skipped), not_served=dict(counts))


def share(pools: list[ResourcePool], sharing: TimeSlicingConfig, *, expand: bool = True) -> list[ResourcePool]:
    """GPU pools named in `sharing` with each device served as replicas `<id>::0` .. `<id>::<replicas-1>`, under
    `<name>.shared` with renameByDefault (NVIDIA's `updateDeviceMapWithReplicas`: every device is replicated).
    `expand=False` renames the pools but keeps one record per device (see `build_pools`)."""
    out = []
    for pool in pools:
        replicas = sharing.replicas(pool.resource_name)
        if replicas is None:
            out.append(pool)
            continue
        # up to 28,672 replicas: each shares its device's records (GPU, MIG device), only its ID and number are
        # its own; the constructor, not dataclasses.replace, which costs twice as much per replica
        devices = tuple(PoolDevice(id=f"{device.id}::{n}", bus_id=device.bus_id, numa=device.numa, gpu=device.gpu,
                                   mig=device.mig, function=device.function, pf=device.pf, replica=n)
                        for device in pool.devices for n in range(replicas)) if expand else pool.devices
        out.append(replace(pool, name=sharing.served_name(pool.resource_name).rpartition("/")[2], devices=devices,
                           fail_requests_greater_than_one=sharing.fail_requests_greater_than_one))
    return out


MIG_STRATEGIES = ("none", "single", "mixed")


def mig_resource_name(profile: str) -> str:
    """NVIDIA's resource name of a MIG profile under mixed: `mig-<profile>`, `+` replaced by `.`."""
    return "mig-" + profile.replace("+", ".")


def _whole(gpu: Gpu) -> PoolDevice:
    return PoolDevice(id=gpu.uuid or "", bus_id=gpu.bus_id, numa=gpu.numa, gpu=gpu)


def _slice(gpu: Gpu, mig: MigDevice) -> PoolDevice:
    return PoolDevice(id=mig.uuid, bus_id=gpu.bus_id, numa=gpu.numa, gpu=gpu, mig=mig)


def _single_problem(gpus: list[Gpu]) -> str:
    """Why NVIDIA's plugin refuses this node under mig-strategy single (device_map.go), or ""."""
    mig = [g for g in gpus if g.mig_enabled]
    if not mig:
        return ""
    if len(mig) != len(gpus):
        return (f"GPUs {', '.join(str(g.index) for g in mig)} are in MIG mode and "
                f"{', '.join(str(g.index) for g in gpus if not g.mig_enabled)} are not (all devices on the node "
                "must be configured with the same migEnabled value)")
    if empty := [g for g in mig if not g.mig_devices]:
        return f"GPU {empty[0].index} has no MIG devices configured"
    if len({(m.profile, m.gpu_slices, m.compute_slices) for g in mig for m in g.mig_devices}) > 1:
        return "more than one MIG device type present on node"
    return ""


def gpu_pools(topology: Topology, config: DevicePluginConfig, skipped: list[str],
              counts: Counter[str]) -> list[ResourcePool]:
    """The GPU resources under config.mig_strategy, as NVIDIA's plugin builds them (internal/rm/device_map.go):

    - none: every GPU whole, MIG mode or not;
    - single: the MIG devices as the GPU resource when every GPU is in MIG mode with one MIG device type (whole
      GPUs when none is in MIG mode); any other node is refused, as NVIDIA's plugin exits on it: no GPU is
      served, said in `skipped` and counted as `mig_strategy`;
    - mixed: whole GPUs not in MIG mode as the GPU resource, and `<prefix>/mig-<profile>` per MIG profile.
    """
    prefix, _, name = config.gpu_resource_name.rpartition("/")
    strategy = config.mig_strategy
    gpus: list[Gpu] = []
    for gpu in sorted(topology.gpus, key=lambda g: g.index):
        if gpu.uuid:
            gpus.append(gpu)
        else:
            skipped.append(f"GPU {gpu.index} at {gpu.bus_id} has no UUID")
            counts["no_uuid"] += 1
    members: dict[str, list[PoolDevice]] = {name: []}
    if strategy == "single" and (problem := _single_problem(gpus)):
        skipped.append(f"mig-strategy single: {problem}; NVIDIA's plugin exits on such a node, so no GPU is "
                       "served (use mixed, or repartition)")
        counts["mig_strategy"] += len(gpus)
        gpus = []
    for gpu in gpus:
        if strategy == "none" or not gpu.mig_enabled:
            members[name].append(_whole(gpu))
            continue
        if not gpu.mig_devices:
            skipped.append(f"GPU {gpu.index} at {gpu.bus_id} is in MIG mode with no MIG devices configured")
            counts["mig"] += 1
        for mig in gpu.mig_devices:
            if strategy == "single":
                members[name].append(_slice(gpu, mig))
            elif mig.compute_slices != mig.gpu_slices:  # NVIDIA's mixed resources are the C == G profiles only
                skipped.append(f"MIG device {mig.uuid} of GPU {gpu.index} has profile {mig.profile}, which "
                               "mig-strategy mixed does not serve")
                counts["mig"] += 1
            else:
                members.setdefault(mig_resource_name(mig.profile), []).append(_slice(gpu, mig))
    pools = []
    for resource, devices in members.items():
        check_resource_name(prefix, resource, dots=resource != name)
        pools.append(ResourcePool(prefix=prefix, name=resource, kind="gpu", devices=tuple(devices),
                                  topology=topology))
    return pools
