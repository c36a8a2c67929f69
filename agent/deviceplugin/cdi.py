"""CDI (Container Device Interface) specs: find the GPU spec another tool wrote, write the RDMA pools' own.

GPUs: the agent writes no GPU spec; `nvidia-ctk cdi generate` does (kind `nvidia.com/gpu`). A CDI strategy
whose kind has no spec in the spec directories is reported once at start, because the runtime would then
refuse the container.

RDMA (`--rdma-cdi`): as the SR-IOV and RDMA shared device plugins do with `-use-cdi`, each NIC pool gets one
spec whose devices are the pool's functions by bus id, each with its RDMA char devices as `deviceNodes`
(`rw`); Allocate then names devices by annotation instead of returning DeviceSpecs. Unlike SR-IOV DP's one
key per prefix (`cdi.k8s.io/<prefix>_net-pci`, where two pools of one prefix in one container collide in the
kubelet), the annotation key is per resource. Specs are written atomically, rewritten when the pool changes,
and removed when the agent stops; at start, specs a crashed run left are removed first
(cncf-tags/container-device-interface SPEC.md; sriov-network-device-plugin pkg/cdi/cdi.go).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import yaml

from agent.deviceplugin.pools import ResourcePool

log = logging.getLogger(__name__)

CDI_VERSION = "0.5.0"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # the runtimes' defaults; /var/run/cdi takes precedence
DEV_INFINIBAND = "/dev/infiniband"
ANNOTATION_PLUGIN = "gpu-node-agent"
_FILE_PREFIX = "gpu-node-agent-"


def _spec_kind(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        log.debug("ignoring CDI spec %s: %s", path, exc)
        return None
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def find_spec(kind: str, directories: Iterable[str]) -> Path | None:
    """The first `*.json`/`*.yaml` spec of this kind in the directories, or None."""
    for directory in directories:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = Path(directory) / name
            if path.suffix in (".json", ".yaml", ".yml") and _spec_kind(path) == kind:
                return path
    return None


def pool_kind(pool: ResourcePool) -> str:
    """`<prefix>/<name>`: a valid CDI kind, since both parts are checked resource-name parts."""
    return pool.resource_name


def device_name(pool: ResourcePool, device_id: str) -> str:
    """Fully qualified CDI device name, e.g. `nvidia.com/sriov_rdma=0000:1a:00.2`."""
    return f"{pool_kind(pool)}={device_id}"


def annotation_key(prefix: str, pool: ResourcePool) -> str:
    """`<prefix>gpu-node-agent_<prefix with . kept>_<name>`, hashed when it would pass 63 characters."""
    name = f"{ANNOTATION_PLUGIN}_{pool.resource_name.replace('/', '_')}"
    if len(name) > 63 or not name[-1].isalnum():
        name = f"{ANNOTATION_PLUGIN}_{hashlib.sha256(pool.resource_name.encode()).hexdigest()[:16]}"
    return prefix + name


def rdma_nodes(pool: ResourcePool, device_id: str, mad_devices: bool) -> list[str]:
    """The char devices of one function: uverbs, umad/issm when asked for, rdma_cm."""
    device = pool.device(device_id)
    function = device.function if device is not None else None
    if function is None or function.rdma is None:
        return []
    chardevs = function.chardevs
    names = [chardevs.uverbs] if chardevs.uverbs else []
    if mad_devices:
        names += [*chardevs.umad, *chardevs.issm]
    return [*(f"{DEV_INFINIBAND}/{name}" for name in names), f"{DEV_INFINIBAND}/rdma_cm"]


def rdma_spec(pool: ResourcePool, mad_devices: bool) -> dict[str, object]:
    """The CDI spec of one NIC pool: a device per RDMA function, its char devices as deviceNodes."""
    devices = []
    for device in pool.devices:
        nodes = rdma_nodes(pool, device.id, mad_devices)
        if nodes:
            devices.append({"name": device.id, "containerEdits": {"deviceNodes": [
                {"path": path, "hostPath": path, "permissions": "rw"} for path in nodes]}})
    return {"cdiVersion": CDI_VERSION, "kind": pool_kind(pool), "devices": devices}


def remove_stale_specs(directory: str) -> list[Path]:
    """Remove the RDMA specs an earlier agent left (a crash skips the clean-up at stop); others' files stay.

    As SR-IOV DP removes every `sriov-dp-*` spec at start: the specs of the pools served now are written again.
    """
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.startswith(_FILE_PREFIX) and name.endswith(".json"):
            path = Path(directory) / name
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


class RdmaSpecWriter:
    """Writes one spec file per NIC pool in `directory`, and removes what it wrote."""

    def __init__(self, directory: str, mad_devices: bool = False) -> None:
        self.directory = Path(directory)
        self.mad_devices = mad_devices
        self._written: dict[str, Path] = {}  # resource name -> spec file

    def path(self, pool: ResourcePool) -> Path:
        """`<dir>/gpu-node-agent-<prefix>-<name>.json`."""
        return self.directory / f"{_FILE_PREFIX}{pool.resource_name.replace('/', '-')}.json"

    def write(self, pool: ResourcePool) -> None:
        """Write (or rewrite) a NIC pool's spec atomically; OSError names the path."""
        if pool.kind != "nic":
            return
        path = self.path(pool)
        data = json.dumps(rdma_spec(pool, self.mad_devices), indent=2).encode()
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gpu-node-agent-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._written[pool.resource_name] = path

    def remove(self, resource_name: str) -> None:
        """Remove one pool's spec, if written."""
        path = self._written.pop(resource_name, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def remove_all(self) -> None:
        """Remove every spec this writer made."""
        for name in list(self._written):
            self.remove(name)
