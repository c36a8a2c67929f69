"""Build the kubelet Allocate payload for a set of devices out of small, independent contributors.

What a container needs differs by device kind: an RDMA VF needs its `/dev/infiniband` nodes, the SR-IOV device
plugin's `PCIDEVICE_*` variables (which SR-IOV CNI users and apps such as app-netutil read) and an exact
`NCCL_IB_HCA`; a GPU needs `NVIDIA_VISIBLE_DEVICES` and maybe CDI names. Each contributor adds its part to one
`ContainerPayload`; the payload de-duplicates device nodes by host path and turns into the protobuf reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.config.model import DevicePluginConfig
from agent.deviceplugin import cdi, nvidia
from agent.deviceplugin.pools import UIO_DRIVERS, VFIO_DRIVER, PoolDevice, ResourcePool
from agent.deviceplugin.v1beta1 import api_pb2
from agent.topology.model import RdmaCharDevices

DEV_INFINIBAND = "/dev/infiniband"
RDMA_CM = f"{DEV_INFINIBAND}/rdma_cm"
DEV_VFIO = "/dev/vfio"
VFIO_CONTAINER = f"{DEV_VFIO}/vfio"  # the vfio container device every vfio user opens first


@dataclass(frozen=True)
class AllocateOptions:
    """The config switches that change Allocate payloads."""

    rdma_mad_devices: bool = False
    gpu: nvidia.GpuServing = field(default_factory=nvidia.GpuServing)
    rdma_cdi: bool = False  # name RDMA devices by CDI annotation instead of device nodes
    cdi_annotation_prefix: str = nvidia.DEFAULT_CDI_ANNOTATION_PREFIX

    @classmethod
    def from_config(cls, config: DevicePluginConfig, mig_minors: str = nvidia.MIG_MINORS) -> AllocateOptions:
        """Options taken from the device-plugin config section (`gpuCdi` adds the cdi-cri strategy); `mig_minors`:
        the driver's MIG capability minors file on this node (a simulated node carries its own)."""
        strategies = [*config.device_list_strategy, *([nvidia.CDI_CRI] if config.gpu_cdi else [])]
        gpu = nvidia.GpuServing(device_list_strategy=nvidia.parse_strategies(strategies),
                                device_id_strategy=config.device_id_strategy,
                                pass_device_specs=config.pass_device_specs,
                                cdi_annotation_prefix=config.cdi_annotation_prefix, cdi_kind=config.gpu_cdi_kind,
                                mig_minors=mig_minors)
        return cls(rdma_mad_devices=config.rdma_mad_devices, gpu=gpu, rdma_cdi=config.rdma_cdi,
                   cdi_annotation_prefix=config.cdi_annotation_prefix)


@dataclass
class ContainerPayload:
    """What one container gets: env, device nodes (one per host path), mounts, annotations, CDI names."""

    envs: dict[str, str] = field(default_factory=dict)
    devices: dict[str, tuple[str, str]] = field(default_factory=dict)  # host path -> (container path, perms)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (container, host, read-only)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)

    def add_device(self, host_path: str, container_path: str | None = None, permissions: str = "rw") -> None:
        """Add a device node unless its host path is already there."""
        self.devices.setdefault(host_path, (container_path or host_path, permissions))

    def to_proto(self) -> api_pb2.ContainerAllocateResponse:
        """The protobuf reply for this container."""
        return api_pb2.ContainerAllocateResponse(
            envs=self.envs,
            devices=[api_pb2.DeviceSpec(container_path=c, host_path=h, permissions=p)
                     for h, (c, p) in self.devices.items()],
            mounts=[api_pb2.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in self.mounts],
            annotations=self.annotations,
            cdi_devices=[api_pb2.CDIDevice(name=name) for name in self.cdi_devices],
        )


Contributor = Callable[[ResourcePool, Sequence[PoolDevice], AllocateOptions, ContainerPayload], None]


def pcidevice_env_key(resource_name: str) -> str:
    """SR-IOV DP's variable name: `PCIDEVICE_<PREFIX>_<NAME>`, upper case, `.` and `/` as `_`."""
    return "PCIDEVICE_" + resource_name.replace(".", "_").replace("/", "_").upper()


def _rdma_paths(device: PoolDevice, options: AllocateOptions) -> list[str]:
    function = device.function
    if function is None or function.rdma is None:
        return []
    chardevs = function.chardevs
    paths = [f"{DEV_INFINIBAND}/{chardevs.uverbs}"] if chardevs.uverbs else []
    if options.rdma_mad_devices:
        paths += [f"{DEV_INFINIBAND}/{name}" for name in (*chardevs.umad, *chardevs.issm)]
    return [*paths, RDMA_CM]


def rdma_char_devices(pool: ResourcePool, devices: Sequence[PoolDevice], options: AllocateOptions,
                      payload: ContainerPayload) -> None:
    """Each RDMA function's own uverbs node plus rdma_cm (umad/issm only with `rdma_mad_devices`), rw.

    With `rdma_cdi` the same nodes come from the pool's CDI spec: one annotation names the devices instead.
    """
    if options.rdma_cdi:
        names = [cdi.device_name(pool, d.id) for d in devices if cdi.rdma_nodes(pool, d.id, options.rdma_mad_devices)]
        if names:
            payload.annotations[cdi.annotation_key(options.cdi_annotation_prefix, pool)] = ",".join(names)
        return
    for device in devices:
        for path in _rdma_paths(device, options):
            payload.add_device(path)


def userspace_nodes(device: PoolDevice) -> tuple[str, dict[str, str], list[tuple[str, str]]] | None:
    """A function bound to vfio-pci or a UIO driver: (info kind, `_INFO` block, (host, container) device nodes),
    as the SR-IOV device plugin's vfio and uio info providers give them; None for a kernel-driver function."""
    function = device.function
    if function is None:
        return None
    pci = function.pci
    if pci.driver == VFIO_DRIVER and pci.iommu_group:
        # a VM without a vIOMMU: vfio's no-IOMMU group is /dev/vfio/noiommu-<n> on the host, <n> in the container
        host = f"{DEV_VFIO}/{'noiommu-' if pci.vfio_noiommu else ''}{pci.iommu_group}"
        container = f"{DEV_VFIO}/{pci.iommu_group}"
        return "vfio", {"mount": VFIO_CONTAINER, "dev-mount": container}, [(VFIO_CONTAINER, VFIO_CONTAINER),
                                                                          (host, container)]
    if pci.driver in UIO_DRIVERS and pci.uio:
        node = f"/dev/{pci.uio}"
        return "uio", {"mount": node}, [(node, node)]
    return None


def userspace_devices(pool: ResourcePool, devices: Sequence[PoolDevice], options: AllocateOptions,
                      payload: ContainerPayload) -> None:
    """DPDK functions: /dev/vfio/vfio and /dev/vfio/<IOMMU group> for vfio-pci, /dev/uio<N> for UIO, rw."""
    for device in devices:
        found = userspace_nodes(device)
        for host, container in found[2] if found is not None else ():
            payload.add_device(host, container)


def _rdma_info(rdma_dev: str, chardevs: RdmaCharDevices, options: AllocateOptions) -> dict[str, str]:
    """SR-IOV DP's `rdma` info block: one path per kind (the last one when there are several) and the name."""
    info: dict[str, str] = {}
    if chardevs.uverbs:
        info["uverbs"] = f"{DEV_INFINIBAND}/{chardevs.uverbs}"
    if options.rdma_mad_devices and chardevs.umad:
        info["umad"] = f"{DEV_INFINIBAND}/{chardevs.umad[-1]}"
    if options.rdma_mad_devices and chardevs.issm:
        info["issm"] = f"{DEV_INFINIBAND}/{chardevs.issm[-1]}"
    info["rdma_cm"] = RDMA_CM
    info["rdma_dev"] = rdma_dev
    return info


def pcidevice_env(pool: ResourcePool, devices: Sequence[PoolDevice], options: AllocateOptions,
                  payload: ContainerPayload) -> None:
    """`PCIDEVICE_<PREFIX>_<NAME>` (comma-separated bus ids) and its `_INFO` JSON, in SR-IOV DP's form."""
    key = pcidevice_env_key(pool.resource_name)
    info: dict[str, dict[str, dict[str, str]]] = {}
    for device in devices:
        entry: dict[str, dict[str, str]] = {"generic": {"deviceID": device.bus_id}}
        function = device.function
        if function is not None and function.rdma is not None:
            entry["rdma"] = _rdma_info(function.rdma, function.chardevs, options)
        userspace = userspace_nodes(device)
        if userspace is not None:
            entry[userspace[0]] = userspace[1]
        info[device.bus_id] = entry
    payload.envs[key] = ",".join(device.bus_id for device in devices)
    payload.envs[f"{key}_INFO"] = json.dumps(info, separators=(",", ":"))


def nccl_ib_hca(pool: ResourcePool, devices: Sequence[PoolDevice], options: AllocateOptions,
                payload: ContainerPayload) -> None:
    """`NCCL_IB_HCA==mlx5_3:1,mlx5_9:1`: exactly the allocated HCAs and their ports (`=` means exact match).

    A function whose ports are unknown is named with port 1, the only port of a VF.
    """
    hcas: list[str] = []
    for device in sorted(devices, key=lambda d: d.bus_id):
        function = device.function
        if function is None or function.rdma is None:
            continue
        ports = sorted(port.number for port in function.ports) or [1]
        hcas.extend(f"{function.rdma}:{port}" for port in ports)
    if hcas:
        payload.envs["NCCL_IB_HCA"] = "=" + ",".join(hcas)


def nvidia_visible_devices(pool: ResourcePool, devices: Sequence[PoolDevice], options: AllocateOptions,
                           payload: ContainerPayload) -> None:
    """The GPUs as NVIDIA's plugin passes them with the same options (env, mounts, device nodes, CDI)."""
    part = nvidia.gpu_payload([(device.gpu, device.mig) for device in devices if device.gpu is not None], options.gpu)
    payload.envs.update(part.envs)
    payload.mounts.extend((container, host, False) for container, host in part.mounts)
    for container, host in part.devices:
        payload.add_device(host, container)
    payload.annotations.update(part.annotations)
    payload.cdi_devices.extend(part.cdi_devices)


NIC_CONTRIBUTORS: tuple[Contributor, ...] = (rdma_char_devices, userspace_devices, pcidevice_env, nccl_ib_hca)
GPU_CONTRIBUTORS: tuple[Contributor, ...] = (nvidia_visible_devices,)


def contributors_for(pool: ResourcePool) -> tuple[Contributor, ...]:
    """The contributors for a pool's kind."""
    return GPU_CONTRIBUTORS if pool.kind == "gpu" else NIC_CONTRIBUTORS


def build_container_payload(pool: ResourcePool, devices: Sequence[PoolDevice], options: AllocateOptions,
                            contributors: Sequence[Contributor] | None = None) -> ContainerPayload:
    """Run every contributor over the devices of one container request."""
    payload = ContainerPayload()
    for contribute in contributors if contributors is not None else contributors_for(pool):
        contribute(pool, devices, options, payload)
    return payload
