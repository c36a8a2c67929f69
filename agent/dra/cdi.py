"""CDI specs per prepared claim: what a container gets for the claim's GPUs and RDMA functions.

One transient spec file per claim, `<vendor>-claim_<claim uid>.json` in the CDI spec directory (the CDI
library's `GenerateTransientSpecName` convention), kind `<driver>/claim`, one CDI device per allocated device
named `<claim uid>-<device name>`; the kubelet passes the fully qualified names to the runtime, which reads the
file (`/work/shared/reference/dra.md` section 8). The payload follows the device plugin's conventions so a
workload sees the same thing either way:

- RDMA function: its `/dev/infiniband/uverbs*` node and `rdma_cm` (rw) on the device; in the spec's common
  edits the SR-IOV device plugin's `PCIDEVICE_<RESOURCE>` (bus ids) and `PCIDEVICE_<RESOURCE>_INFO`, and an
  exact `NCCL_IB_HCA==mlx5_3:1,...` over the claim's HCAs;
- GPU: `NVIDIA_VISIBLE_DEVICES` with the claim's GPU UUIDs in the common edits;
- MIG device: its MIG UUID in the same `NVIDIA_VISIBLE_DEVICES`, and on the device the nodes the device plugin
  passes for it (`deviceplugin.nvidia.device_specs`, one builder for both APIs): the control nodes that exist,
  the parent's `/dev/nvidia<minor>` and the `/dev/nvidia-caps/nvidia-cap<N>` nodes of its GPU and compute
  instance, N from the driver's `mig-minors` file (a missing entry is a warning and that node is left out, as
  there). Whole GPUs carry no nodes: the NVIDIA runtime hook adds them from the UUID.

Env that lists several devices belongs to the whole claim, so it sits in the spec-level edits; each device
carries its own nodes and one variable naming its bus id, or a MIG device's MIG UUID (CDI refuses devices
without edits). Files are written to a dot-named temporary file and renamed, so the runtime's directory watch
never reads half a spec.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.deviceplugin.nvidia import MIG_MINORS, device_specs
from agent.dra.devices import DraDevice

CDI_VERSION = "0.6.0"
DEV_INFINIBAND = "/dev/infiniband"
RDMA_CM = f"{DEV_INFINIBAND}/rdma_cm"
_CHARDEV = re.compile(r"^[a-z]+[0-9]+$")  # uverbs3: a name from sysfs that becomes a path
_UID = re.compile(r"^[0-9a-fA-F][0-9a-fA-F-]{0,62}$")


class CdiError(ValueError):
    """A claim that cannot be turned into a CDI spec (bad uid, unsafe device node name)."""


def check_uid(uid: str) -> str:
    """A claim UID safe to put in a file name and a CDI device name (UIDs are UUIDs)."""
    if not _UID.match(uid):
        raise CdiError(f"claim uid {uid!r} is not a UUID")
    return uid


def pcidevice_env_key(resource_name: str) -> str:
    """SR-IOV DP's variable name: `PCIDEVICE_<PREFIX>_<NAME>`, upper case, `.` and `/` as `_`."""
    return "PCIDEVICE_" + resource_name.replace(".", "_").replace("/", "_").upper()


class CdiSpecs:
    """Writes and removes the per-claim spec files of one driver."""

    def __init__(self, directory: Path | str, driver: str, rdma_resource_name: str, *, dev_root: str = "/",
                 mig_minors: str = MIG_MINORS) -> None:
        self.directory = Path(directory)
        self.kind = f"{driver}/claim"
        self._vendor = driver
        self._resource = rdma_resource_name
        self._dev_root = dev_root  # where the host's /dev/nvidia* live
        self._mig_minors = mig_minors  # the driver's MIG capability minors

    def path(self, claim_uid: str) -> Path:
        """The claim's spec file."""
        return self.directory / f"{self._vendor}-claim_{check_uid(claim_uid)}.json"

    def device_id(self, claim_uid: str, device: DraDevice) -> str:
        """Fully qualified CDI name of one device of the claim."""
        return f"{self.kind}={check_uid(claim_uid)}-{device.name}"

    def spec(self, claim_uid: str, devices: Sequence[DraDevice]) -> dict[str, Any]:
        """The spec document for the claim's devices of this driver."""
        check_uid(claim_uid)
        rdma = [d for d in devices if d.kind == "rdma" and d.function is not None]
        gpus = [d for d in devices if d.kind in ("gpu", "mig") and d.gpu is not None]
        env: list[str] = []
        if gpus:
            env.append("NVIDIA_VISIBLE_DEVICES=" + ",".join(
                d.mig.uuid if d.mig is not None else d.gpu.uuid or d.bus_id for d in gpus if d.gpu))
        if rdma:
            key = pcidevice_env_key(self._resource)
            env.append(f"{key}=" + ",".join(d.bus_id for d in rdma))
            env.append(f"{key}_INFO=" + json.dumps(_pcidevice_info(rdma), separators=(",", ":")))
            hcas = [f"{f.rdma}:{port}" for d in sorted(rdma, key=lambda d: d.bus_id) if (f := d.function) and f.rdma
                    for port in sorted(p.number for p in f.ports) or [1]]
            if hcas:
                env.append("NCCL_IB_HCA==" + ",".join(hcas))
        return {"cdiVersion": CDI_VERSION, "kind": self.kind,
                "devices": [{"name": f"{claim_uid}-{d.name}", "containerEdits": self._device_edits(d)}
                            for d in devices],
                "containerEdits": {"env": env} if env else {}}

    def write(self, claim_uid: str, devices: Sequence[DraDevice]) -> list[str]:
        """Write the claim's spec atomically; return the CDI device ids in device order."""
        document = self.spec(claim_uid, devices)
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path(claim_uid)
        fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".part")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(document, handle, indent=1)
            os.chmod(temporary, 0o644)  # the runtime reads it; nothing in it is secret
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return [self.device_id(claim_uid, d) for d in devices]

    def remove(self, claim_uid: str) -> bool:
        """Delete the claim's spec; True when there was one."""
        try:
            self.path(claim_uid).unlink()
        except FileNotFoundError:
            return False
        return True


    def _device_edits(self, device: DraDevice) -> dict[str, Any]:
        variable = "GPU_NODE_AGENT_DEVICE_" + device.name.upper().replace("-", "_")
        edits: dict[str, Any] = {"env": [f"{variable}={device.mig.uuid if device.mig else device.bus_id}"]}
        function = device.function
        if device.kind == "rdma" and function is not None:
            nodes = []
            uverbs = function.chardevs.uverbs
            if uverbs:
                if not _CHARDEV.match(uverbs):
                    raise CdiError(f"device {device.name}: unexpected uverbs name {uverbs!r}")
                nodes.append({"path": f"{DEV_INFINIBAND}/{uverbs}", "permissions": "rw"})
            nodes.append({"path": RDMA_CM, "permissions": "rw"})
            edits["deviceNodes"] = nodes
        elif device.kind == "mig" and device.gpu is not None and device.mig is not None:
            specs = device_specs([(device.gpu, device.mig)], self._dev_root, self._mig_minors)
            edits["deviceNodes"] = [{"path": path, **({"hostPath": host} if host != path else {}),
                                     "permissions": "rw"} for path, host in specs]
        return edits


def _pcidevice_info(devices: Sequence[DraDevice]) -> dict[str, Any]:
    """SR-IOV DP's `_INFO` JSON: per bus id the generic deviceID and the rdma block."""
    info: dict[str, Any] = {}
    for device in devices:
        entry: dict[str, Any] = {"generic": {"deviceID": device.bus_id}}
        function = device.function
        if function is not None and function.rdma:
            rdma = {"rdma_cm": RDMA_CM, "rdma_dev": function.rdma}
            if function.chardevs.uverbs:
                rdma = {"uverbs": f"{DEV_INFINIBAND}/{function.chardevs.uverbs}", **rdma}
            entry["rdma"] = rdma
        info[device.bus_id] = entry
    return info
