"""Multus device-info files (Network Plumbing WG Device Information Specification 1.1.0) for allocated VFs.

Multus copies `<dir>/<resource>-<deviceID>-device.json` for a NetworkAttachmentDefinition that names the
resource and publishes it as `device-info` in the pod's network-status; SR-IOV CNI users read it there. The
file name follows the spec's library (network-attachment-definition-client `SaveDeviceInfoForDP`): `/` becomes
`-` in the resource name and in the device ID. As the SR-IOV device plugin does, the file is written in
Allocate (a stale one is replaced: the library refuses to overwrite), mode 0444, and every file this writer
made is removed when the agent stops or the device leaves its pool. A write failure fails the Allocate, as
there: a container whose CNI cannot find its device info would start without its network.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from agent.deviceplugin.pools import PoolDevice, ResourcePool
from agent.host.busid import is_bus_id
from agent.topology.model import Vf

log = logging.getLogger(__name__)

SPEC_VERSION = "1.1.0"
DEFAULT_DIR = "/var/run/k8s.cni.cncf.io/devinfo/dp"
_MODE = 0o444


def file_name(resource_name: str, device_id: str) -> str:
    """`nvidia.com/sriov_rdma` + `0000:3b:02.2` -> `nvidia.com-sriov_rdma-0000:3b:02.2-device.json`."""
    return f"{resource_name.replace('/', '-')}-{device_id.replace('/', '-')}-device.json"


def device_info(device: PoolDevice) -> dict[str, object]:
    """The spec's `pci` document for one NIC function: address, RDMA device, and PF address for a VF."""
    pci: dict[str, str] = {"pci-address": device.bus_id}
    function = device.function
    if function is not None and function.rdma is not None:
        pci["rdma-device"] = function.rdma
    if isinstance(function, Vf):
        pci["pf-pci-address"] = function.pf_bus_id
    return {"type": "pci", "version": SPEC_VERSION, "pci": pci}


class DeviceInfoError(OSError):
    """A device-info file could not be written; the message names the path."""


class DeviceInfoWriter:
    """Writes and removes the device-info files of NIC pools in one directory; remembers what it wrote."""

    def __init__(self, directory: str = DEFAULT_DIR) -> None:
        self.directory = Path(directory)
        self._written: dict[tuple[str, str], Path] = {}  # (resource, device ID) -> file

    @property
    def written(self) -> dict[tuple[str, str], Path]:
        """The files this writer made and has not removed yet."""
        return dict(self._written)

    def write(self, pool: ResourcePool, devices: Sequence[PoolDevice]) -> None:
        """Write one file per NIC device (GPUs have none). Raises DeviceInfoError naming the path."""
        if pool.kind != "nic":
            return
        for device in devices:
            if not is_bus_id(device.id):  # IDs are bus ids we made; never let anything else form a path
                log.warning("%s: device %r is not a PCI address; no device-info file", pool.resource_name,
                            device.id)
                continue
            self._write_one(pool.resource_name, device)

    def _write_one(self, resource_name: str, device: PoolDevice) -> None:
        path = self.directory / file_name(resource_name, device.id)
        data = json.dumps(device_info(device), separators=(",", ":")).encode()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale file from an earlier Allocate or an earlier agent
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _MODE)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            raise DeviceInfoError(f"cannot write device-info file {path}: {exc.strerror or exc}") from exc
        self._written[(resource_name, device.id)] = path

    def _remove(self, key: tuple[str, str]) -> None:
        path = self._written.pop(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove device-info file %s: %s", path, exc.strerror or exc)

    def retain(self, resource_name: str, device_ids: Iterable[str]) -> None:
        """Remove the files of this resource's devices that are no longer in `device_ids`."""
        keep = set(device_ids)
        for key in [k for k in self._written if k[0] == resource_name and k[1] not in keep]:
            self._remove(key)

    def remove_all(self) -> None:
        """Remove every file this writer made (the agent stops)."""
        for key in list(self._written):
            self._remove(key)
