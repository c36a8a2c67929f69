"""A simulated node: a profile's sysfs tree written to disk, its NVML identities, its NCCL XML if any, and the files
the NVIDIA driver keeps under /proc (the MIG capability minors) in a `proc` directory of its own.

The agent's real readers then run on it unchanged, which is the point: `--simulate` exercises the same code
paths as a real host, only the sources differ.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from agent.host.driver_files import PROC_ROOT
from agent.host.nvml import MigInfo, SimulatedNvml, mig_profile_name
from agent.host.nvml.simulated_driver import SimDriver, SimGpuModel, SimMigProfile
from agent.simulate import nvidia_caps, profiles, sysfs_writer
from agent.topology.load import load_topology
from agent.topology.model import Topology


@dataclass(frozen=True)
class SimulatedNode:
    """Everything `run --simulate` and the tests need to treat a profile like a host."""

    profile: profiles.Profile
    sysfs_root: Path
    nvml: SimulatedNvml
    proc_root: Path | None = None  # what plays /proc (the driver's files), when written

    @property
    def driver_proc_root(self) -> str:
        """Where the agent reads the driver's /proc files: the node's own, or the host's when none was written."""
        return str(self.proc_root) if self.proc_root is not None else PROC_ROOT

    @property
    def topology_file(self) -> Path | None:
        """The profile's NCCL topology XML (cloud VM profiles), or None."""
        return self.profile.topology_xml

    def topology(self) -> Topology:
        """Read the written tree back with the real readers."""
        return load_topology(self.sysfs_root, self.nvml.gpu_uuids(), self.topology_file,
                             gpu_minors=self.nvml.gpu_minors(), mig_gpus=self.nvml.mig_gpus(),
                             mig_devices=self.nvml.mig_devices())


# NVLinks and NVSwitch fabric of the GPU models the profiles use, by PCI device id: H100 SXM5 has 18 NVLink4 links
# to the NVSwitches of an HGX board (fabric probe supported from Hopper on); V100 SXM2 has 6 NVLink2 links and no
# fabric probe. A GPU model not listed is a PCIe board without NVLink.
GPU_INTERCONNECT: dict[str, tuple[int, bool]] = {"0x2330": (18, True), "0x1db1": (6, False)}


# What the driver reports for the GPU models the profiles use, by PCI device id: NVML name, memory.total in MiB
# (nvidia-smi prints 81559MiB for an H100 SXM5 80GB, 16160MiB for a V100 SXM2 16GB), compute capability and
# whether nvmlDeviceGetMigMode answers (MIG needs compute capability 8.0 or later).
# Sources: H100's name and 81559MiB are in the nvidia-smi sample of NVIDIA's MIG User Guide (v580, "Getting Started
# with MIG", https://docs.nvidia.com/datacenter/tesla/mig-user-guide/getting-started-with-mig.html); its compute
# capability 9.0 and MIG support in its "Supported GPUs" table (supported-gpus.html there); V100's 7.0 in
# https://developer.nvidia.com/cuda-gpus. The V100's 16160MiB is what public nvidia-smi captures of V100 16GB
# boards print (no NVIDIA document states it).
GPU_MODELS: dict[str, SimGpuModel] = {
    "0x2330": SimGpuModel("NVIDIA H100 80GB HBM3", 81559, (9, 0), True),
    "0x1db1": SimGpuModel("Tesla V100-SXM2-16GB", 16160, (7, 0), False),
}
# Memory of the GPU models the profiles use (MiB); MIG devices are named from it.
GPU_MEMORY_MIB: dict[str, int] = {device: model.memory_mib for device, model in GPU_MODELS.items()}
_DEFAULT_MEMORY_MIB = 81559
# nvmlDeviceGetAttributes of H100 80GB MIG devices, as `nvidia-smi mig -lgip` prints the profiles (memory 9.75 and
# 79.25 GiB; SMs; copy engines, NVDEC, NVENC, JPEG, OFA). Only profiles seen in independent captures are listed:
# the simulated driver refuses to describe another rather than invent its figures.
# Sources: memory, SMs and NVENC 0 from an H100 80GB `nvidia-smi mig -lgip` capture published at
# https://jbarrow.ai/field_notes/nvidia-mig/ (1g.10gb: 9.75 GiB, 16 SMs; 7g.80gb: 79.25 GiB, 132 SMs); copy
# engines, NVDEC, JPEG and OFA also in the MIG User Guide's "GPU Instance Profiles on H100" table (Table 7,
# https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html): 1g.10gb 1 CE, 1 NVDEC,
# 1 JPEG, 0 OFA; 7g.80gb 8 CE, 7 NVDEC, 7 JPEG, 1 OFA.
H100_MIG_PROFILES: dict[str, SimMigProfile] = {
    "1g.10gb": SimMigProfile(9984, 16, 1, 1, 0, 1, 0),
    "7g.80gb": SimMigProfile(81152, 132, 8, 7, 0, 7, 1),
}
# The pair nvidia-smi shows (dcgm's too): R550 data-center driver 550.54.15, the driver CUDA 12.4 Update 1 ships
# with ("CUDA 12.4 Update 1 >=550.54.15" in the CUDA Toolkit Release Notes' driver table,
# https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/), so the CUDA version it supports is 12.4 (12040).
DRIVER_VERSION, CUDA_DRIVER_VERSION = "550.54.15", 12040
_MIG_NAMESPACE = uuid.UUID("2f0c7d4e-8d3a-4d8e-9c51-6b1f0e2a7c33")


def simulated_mig_devices(gpu_uuid: str, profile: str, count: int,
                          memory_mib: int = _DEFAULT_MEMORY_MIB) -> list[MigInfo]:
    """`count` MIG devices of `profile` (`<G>g.<GB>gb`) on one GPU: GPU instances 1..count, compute instance 0,
    stable `MIG-<uuid5>` UUIDs, and a memory size NVIDIA's naming turns back into `profile`."""
    slices, gb = (int(part.rstrip("gb")) for part in profile.split("."))
    total_gb = -(-memory_mib // 1024)
    known = H100_MIG_PROFILES.get(profile) if memory_mib == GPU_MEMORY_MIB["0x2330"] else None
    # the real device's size where known; else a little under the share, as a real MIG device has
    memory_mb = known.memory_mb if known is not None else memory_mib * gb // total_gb - 200
    found = [MigInfo(uuid=f"MIG-{uuid.uuid5(_MIG_NAMESPACE, f'{gpu_uuid}/{gi}/0')}", gpu_instance=gi,
                     compute_instance=0, gpu_slices=slices, compute_slices=slices, memory_mb=memory_mb,
                     profile=mig_profile_name(slices, slices, memory_mb, memory_mib << 20))
             for gi in range(1, count + 1)]
    if any(m.profile != profile for m in found):
        raise ValueError(f"MIG profile {profile!r} does not fit a GPU of {memory_mib} MiB")
    return found


def simulated_nvml(profile: profiles.Profile, overrides_dir: Path | None = None) -> SimulatedNvml:
    """The profile's NVML: its UUIDs, the NVLinks and fabric of its GPU model, and its GPUs' MIG devices."""
    models = {dev.model.device for _, _, dev in profile.walk() if dev.model.is_gpu}
    links, fabric = GPU_INTERCONNECT.get(min(models), (0, False)) if models else (0, False)
    memory = GPU_MEMORY_MIB.get(min(models), _DEFAULT_MEMORY_MIB) if models else _DEFAULT_MEMORY_MIB
    mig = {bus_id: simulated_mig_devices(profile.gpu_uuids[bus_id], name, count, memory)
           for bus_id, (name, count) in profile.gpu_mig.items()}
    devices = {dev.bdf: dev.model.device for _, _, dev in profile.walk() if dev.model.is_gpu}
    driver = SimDriver(DRIVER_VERSION, CUDA_DRIVER_VERSION,
                       {bus_id: GPU_MODELS[device] for bus_id, device in devices.items() if device in GPU_MODELS},
                       H100_MIG_PROFILES)
    return SimulatedNvml(profile.gpu_uuids, nvlinks=links, fabric=fabric, overrides_dir=overrides_dir,
                         mig=profile.gpu_mig, mig_devices=mig, driver=driver)


def build_simulated_node(name: str, root: Path, nvml_overrides: Path | None = None,
                         proc_root: Path | None = None) -> SimulatedNode:
    """Write profile `name` as a sysfs tree under `root` (and create `nvml_overrides`, where NVML override files
    are read, when given; write the driver's /proc files under `proc_root` when given, for a node with GPUs).
    Raises profiles.UnknownProfileError."""
    profile = profiles.load_profile(name)
    root.mkdir(parents=True, exist_ok=True)
    sysfs_writer.write_sysfs(profile, root)
    if nvml_overrides is not None:
        nvml_overrides.mkdir(parents=True, exist_ok=True)
    nvml = simulated_nvml(profile, nvml_overrides)
    if proc_root is not None and profile.gpu_uuids:  # the driver (and its files) is loaded only with GPUs
        # minors as the driver numbers its GPUs, which the simulated NVML reports too
        nvidia_caps.write_mig_minors(proc_root, range(len(profile.gpu_uuids)))
    return SimulatedNode(profile=profile, sysfs_root=root, nvml=nvml, proc_root=proc_root)


def simulated_topology(name: str, root: Path) -> Topology:
    """The Topology of profile `name`, written under `root` and read back."""
    return build_simulated_node(name, root).topology()
