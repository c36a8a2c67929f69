"""What a simulated node's driver reports: its version, the CUDA version it supports, and per GPU model the
figures NVML gives (name, memory, compute capability, MIG) and the attributes of each MIG profile. Plain data: the
simulated profiles (`agent.simulate.node`) fill it with real models' figures; `SimulatedNvml` answers from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimGpuModel:
    """What the driver reports for one GPU model (a simulated profile's GPUs report a real model's figures)."""

    name: str  # nvmlDeviceGetName
    memory_mib: int  # memory.total >> 20
    compute_capability: tuple[int, int]
    mig_capable: bool


@dataclass(frozen=True)
class SimMigProfile:
    """nvmlDeviceGetAttributes of a MIG device of one profile on one GPU model (`nvidia-smi mig -lgip`)."""

    memory_mb: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int


@dataclass(frozen=True)
class SimDriver:
    """The simulated driver: its version, the CUDA version it supports (NVML's integer), its GPU models by bus
    id and MIG profile attributes by profile name."""

    version: str = "550.54.15"  # the default pair, sourced at agent.simulate.node.DRIVER_VERSION
    cuda_version: int = 12040
    models: Mapping[str, SimGpuModel] = field(default_factory=dict)
    mig_profiles: Mapping[str, SimMigProfile] = field(default_factory=dict)
