"""What Allocate returns for whole GPUs, with NVIDIA k8s-device-plugin's options and meanings.

Pods written for NVIDIA's plugin must run unchanged, so the same four device-list strategies exist and combine
the same way (NVIDIA/k8s-device-plugin:internal/plugin/server.go `getAllocateResponse`):

- `envvar`: `NVIDIA_VISIBLE_DEVICES=<id>,<id>` for the NVIDIA container runtime hook;
- `volume-mounts`: `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` and one `/dev/null` mount per
  device at `/var/run/nvidia-container-devices/<id>`;
- `cdi-annotations`: one annotation `<prefix>nvidia-device-plugin_<uuid4>` = comma list of CDI names (a fresh
  UUID per Allocate, checked like the CDI library's `AnnotationKey`);
- `cdi-cri`: the CDI names in the response's `cdi_devices`;
- when every selected strategy is a CDI one, nothing else is returned (no env, mounts or device nodes).

`deviceIDStrategy` picks the ID form in those places (`uuid`, or the NVML `index`); the kubelet's device IDs
stay UUIDs. `passDeviceSpecs` adds `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` and
`/dev/nvidia-modeset` (each only when it exists) and `/dev/nvidia<minor>` per GPU, `rw`, host paths under the
device root. A MIG device is named by its MIG UUID (`index`: `<GPU index>:<MIG index>`) and passes its parent's
`/dev/nvidia<minor>` plus the two `/dev/nvidia-caps/nvidia-cap<N>` nodes of its GPU and compute instance, N read
from `/proc/driver/nvidia-caps/mig-minors` (internal/rm/nvml_devices.go `GetPaths`, internal/mig/mig-dp.go).
CDI names use the kind of a spec already on the node (`nvidia-ctk cdi generate` writes `nvidia.com/gpu`); the
agent writes no GPU CDI spec.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.config.model import DEVICE_LIST_STRATEGIES
from agent.host.driver_files import mig_minors_path
from agent.topology.model import Gpu, MigDevice

log = logging.getLogger(__name__)

ENVVAR = "envvar"
VOLUME_MOUNTS = "volume-mounts"
CDI_ANNOTATIONS = "cdi-annotations"
CDI_CRI = "cdi-cri"
STRATEGIES = DEVICE_LIST_STRATEGIES
ID_UUID = "uuid"
ID_INDEX = "index"
ID_STRATEGIES = (ID_UUID, ID_INDEX)

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNTS_HOST_PATH = "/dev/null"
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
MIG_MINORS = mig_minors_path()  # on a node; a simulated one carries its own (agent.host.driver_files)
MIG_CAPS_DIR = "/dev/nvidia-caps"
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
DEFAULT_CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
ANNOTATION_PLUGIN = "nvidia-device-plugin"
_ANNOTATION_NAME_MAX = 63
_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ANNOTATION_INNER = re.compile(r"^[A-Za-z0-9_.-]*$")


class GpuServingError(ValueError):
    """A GPU serving option NVIDIA's plugin would refuse too; the message names the option."""


def parse_strategies(values: Sequence[str]) -> tuple[str, ...]:
    """The device-list strategies, de-duplicated in order; unknown or none is an error (as in NVIDIA's)."""
    chosen = tuple(dict.fromkeys(v.strip() for v in values if v.strip()))
    if not chosen:
        raise GpuServingError("deviceListStrategy: at least one strategy is required")
    unknown = [v for v in chosen if v not in STRATEGIES]
    if unknown:
        raise GpuServingError(f"deviceListStrategy: unknown {', '.join(unknown)}; "
                              f"use one or more of {', '.join(STRATEGIES)}")
    return chosen


def check_cdi_kind(kind: str) -> str:
    """`vendor/class` as CDI qualifies device names; GpuServingError otherwise."""
    if not _KIND.match(kind):
        raise GpuServingError(f"CDI kind {kind!r} is not vendor/class (e.g. nvidia.com/gpu)")
    return kind


def annotation_key(prefix: str, plugin: str, request_id: str) -> str:
    """`<prefix><plugin>_<id>` under the CDI library's rules (63 characters, alphanumeric ends)."""
    name = f"{plugin}_{request_id.replace('/', '_')}"
    if len(name) > _ANNOTATION_NAME_MAX or not name[0].isalnum() or not name[-1].isalnum() \
            or not _ANNOTATION_INNER.match(name):
        raise GpuServingError(f"CDI annotation name {name!r} breaks the CDI rules")
    return prefix + name


@dataclass(frozen=True)
class GpuServing:
    """NVIDIA's GPU options, checked."""

    device_list_strategy: tuple[str, ...] = (ENVVAR,)
    device_id_strategy: str = ID_UUID
    pass_device_specs: bool = False
    cdi_annotation_prefix: str = DEFAULT_CDI_ANNOTATION_PREFIX
    cdi_kind: str = "nvidia.com/gpu"
    dev_root: str = "/"  # where the host's /dev/nvidia* live (NVIDIA's --dev-root)
    mig_minors: str = MIG_MINORS  # the driver's MIG capability minors
    request_id: Callable[[], str] = field(default=lambda: str(uuid.uuid4()), compare=False)

    def __post_init__(self) -> None:
        parse_strategies(self.device_list_strategy)
        if self.device_id_strategy not in ID_STRATEGIES:
            raise GpuServingError(f"deviceIDStrategy: {self.device_id_strategy!r} is not uuid or index")
        check_cdi_kind(self.cdi_kind)

    @property
    def all_cdi(self) -> bool:
        """True when every strategy is a CDI one: then only CDI names are returned."""
        return all(s.startswith("cdi-") for s in self.device_list_strategy)

    @property
    def any_cdi(self) -> bool:
        """True when some strategy names CDI devices."""
        return any(s.startswith("cdi-") for s in self.device_list_strategy)


@dataclass
class GpuPayload:
    """The GPU part of one container's Allocate reply."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (container path, host path), read-write
    devices: list[tuple[str, str]] = field(default_factory=list)  # (container path, host path), rw
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)


#: A device handed out: a whole GPU, or a MIG device with its parent
Served = Gpu | tuple[Gpu, MigDevice | None]


def _pairs(devices: Sequence[Served]) -> list[tuple[Gpu, MigDevice | None]]:
    return [(d, None) if isinstance(d, Gpu) else d for d in devices]


def _ids(devices: list[tuple[Gpu, MigDevice | None]], serving: GpuServing) -> list[str]:
    index = serving.device_id_strategy == ID_INDEX
    ids = [(f"{gpu.index}:{mig.index}" if index else mig.uuid) if mig is not None
           else str(gpu.index) if index else (gpu.uuid or "") for gpu, mig in devices]
    return list(dict.fromkeys(i for i in ids if i))


def _host(dev_root: str, path: str) -> str:
    return os.path.join(dev_root, path.lstrip("/"))


def mig_capability_minors(path: str) -> dict[str, int]:
    """`gpu<minor>/gi<G>/access` and `gpu<minor>/gi<G>/ci<C>/access` -> capability minor, from the driver's
    mig-minors file (empty when it is missing: not a MIG-capable node)."""
    try:
        with open(path, encoding="ascii", errors="replace") as lines:
            found: dict[str, int] = {}
            for line in lines:
                name, _, minor = line.strip().rpartition(" ")
                if name and minor.isdigit():
                    found[name] = int(minor)
            return found
    except OSError:
        return {}


def device_specs(gpus: Sequence[Served], dev_root: str, mig_minors: str = MIG_MINORS) -> list[tuple[str, str]]:
    """The control nodes that exist, then `/dev/nvidia<minor>` per GPU and, per MIG device, its parent's node
    and its GPU- and compute-instance capability nodes (container path, host path)."""
    specs = [(path, _host(dev_root, path)) for path in CONTROL_NODES if os.path.exists(_host(dev_root, path))]
    pairs = _pairs(gpus)
    caps = mig_capability_minors(mig_minors) if any(mig is not None for _, mig in pairs) else {}
    for gpu, mig in pairs:
        if gpu.minor is None:
            log.warning("GPU %s has no known device minor; its /dev/nvidia node is not passed", gpu.bus_id)
            continue
        paths = [f"/dev/nvidia{gpu.minor}"]
        if mig is not None:
            names = (f"gpu{gpu.minor}/gi{mig.gpu_instance}/access",
                     f"gpu{gpu.minor}/gi{mig.gpu_instance}/ci{mig.compute_instance}/access")
            missing = [name for name in names if name not in caps]
            if missing:
                log.warning("MIG device %s: no capability minor for %s in %s", mig.uuid, ", ".join(missing),
                            mig_minors)
            paths.extend(f"{MIG_CAPS_DIR}/nvidia-cap{caps[name]}" for name in names if name in caps)
        specs.extend((path, _host(dev_root, path)) for path in paths if (path, _host(dev_root, path)) not in specs)
    return specs


def gpu_payload(gpus: Sequence[Served], serving: GpuServing) -> GpuPayload:
    """What NVIDIA's plugin returns for these GPUs and MIG devices with these options."""
    payload = GpuPayload()
    ids = _ids(_pairs(gpus), serving)
    if not ids:
        return payload
    if serving.any_cdi:
        names = [f"{serving.cdi_kind}={device_id}" for device_id in ids]
        if CDI_ANNOTATIONS in serving.device_list_strategy:
            key = annotation_key(serving.cdi_annotation_prefix, ANNOTATION_PLUGIN, serving.request_id())
            payload.annotations[key] = ",".join(names)
        if CDI_CRI in serving.device_list_strategy:
            payload.cdi_devices.extend(names)
    if serving.all_cdi:
        return payload
    if ENVVAR in serving.device_list_strategy:
        payload.envs[VISIBLE_DEVICES] = ",".join(ids)
    if VOLUME_MOUNTS in serving.device_list_strategy:
        payload.envs[VISIBLE_DEVICES] = VOLUME_MOUNTS_ROOT
        payload.mounts.extend((f"{VOLUME_MOUNTS_ROOT}/{device_id}", VOLUME_MOUNTS_HOST_PATH) for device_id in ids)
    if serving.pass_device_specs:
        payload.devices.extend(device_specs(gpus, serving.dev_root, serving.mig_minors))
    return payload
