"""GPU Feature Discovery's `nvidia.com/` labels, computed as GFD v0.20.0 computes them (a pure function).

Rules from NVIDIA/k8s-device-plugin `internal/lm` (nvml.go, resource.go, mig-strategy.go, imex.go, vgpu.go,
machine-type.go): values are Go `%v` strings; whole GPUs are labelled per NVML name, MIG-enabled GPUs first
(without sharing: replicas 0) and then the whole ones over them; `single` relabels `nvidia.com/gpu.*` with the
MIG devices (or the invalid set); `mixed` adds `nvidia.com/mig-<profile>.*`. Where GFD's result depends on Go
map order (two GPU models on one node) the models are taken in name order, the last one winning. Not written:
`gfd.timestamp` (a per-process liveness stamp that changes at every restart; the agent never blinks), and the
GPU Operator's `gpu.present` / `gpu.deploy.*` and the device plugin's `device-plugin.config` inputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.config.sharing import TimeSlicingConfig
from agent.host.nvml import GpuFacts, MigFacts, NvmlFacts
from agent.host.pci_config import VgpuCapability

PREFIX = "nvidia.com/"
GPU_RESOURCE = "nvidia.com/gpu"
_UNSAFE = re.compile(r"[^A-Za-z0-9\-_. ]")
_MODES = {"0x030000": "graphics", "0x030200": "compute"}
_FAMILIES = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell",
             12: "blackwell", 13: "rubin"}


class GfdError(ValueError):
    """The facts cannot be labelled as GFD would (GFD itself would fail and write nothing)."""


@dataclass(frozen=True)
class GfdInputs:
    """Everything besides NVML that GFD's labels depend on."""

    mig_strategy: str = "none"
    time_slicing: TimeSlicingConfig | None = None
    machine_type: str | None = None  # product_name as read, None when unreadable
    gpu_classes: tuple[str, ...] = ()  # PCI class of every GPU ("0x030200"); "" where unreadable
    vgpu: VgpuCapability | None = None  # None when the scan failed (GFD then writes no vgpu keys)


def sanitise(text: str) -> str:
    """GFD's `sanitise`: drop characters outside `A-Za-z0-9-_.` and space, join the words with `-`."""
    return "-".join(_UNSAFE.sub("", text).split())


def family(major: int, minor: int) -> str:
    """GFD's `getArchFamily`."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return _FAMILIES.get(major, "undefined")


class _Resource:
    """GFD's `resourceLabeler`: keys `<resource>.<suffix>`; `sharing` None means sharing disabled (replicas 0)."""

    def __init__(self, name: str, sharing: TimeSlicingConfig | None) -> None:
        self.name, self.sharing = name, sharing

    def _replicated(self) -> int | None:
        return self.sharing.replicas(self.name) if self.sharing is not None else None

    def _renamed(self) -> bool:
        # NVIDIA's config sets `rename` only through renameByDefault (a per-resource rename is ignored)
        return self.sharing is not None and self._replicated() is not None and self.sharing.rename_by_default

    def replicas(self) -> int:
        if self.sharing is None:
            return 0
        replicated = self._replicated()
        return replicated if replicated is not None and replicated > 0 else 1

    def product(self, *parts: str) -> str:
        words = [sanitise(p) for p in parts if p]
        if not words:
            return ""
        if (self._replicated() or 0) > 1 and not self._renamed():
            words.append("SHARED")
        return "-".join(words)

    def base(self, count: int, *parts: str) -> dict[str, str]:
        replicas = self.replicas()
        strategy = "time-slicing" if self.sharing is not None and replicas > 1 else "none"
        return self.values({"product": self.product(*parts), "count": count, "replicas": replicas,
                            "sharing-strategy": strategy})

    def values(self, suffixes: dict[str, object]) -> dict[str, str]:
        return {f"{self.name}.{k}": str(v) for k, v in suffixes.items()}


def _whole(gpu: GpuFacts, count: int, sharing: TimeSlicingConfig | None) -> dict[str, str]:
    rl = _Resource(GPU_RESOURCE, sharing)
    labels = rl.base(count, gpu.name)
    if gpu.memory_mib:
        labels.update(rl.values({"memory": gpu.memory_mib}))
    if gpu.compute_capability is not None and gpu.compute_capability[0] != 0:
        major, minor = gpu.compute_capability
        labels.update(rl.values({"family": family(major, minor), "compute.major": major, "compute.minor": minor}))
    return labels


def _mig_resource(name: str, model: str, mig: MigFacts, count: int,
                  sharing: TimeSlicingConfig | None) -> dict[str, str]:
    rl = _Resource(name, sharing)
    labels = rl.base(count, model, "MIG", _resource_profile(mig))
    labels.update(rl.values({
        "memory": mig.memory_mb, "multiprocessors": mig.multiprocessors, "slices.gi": mig.gpu_slices,
        "slices.ci": mig.compute_slices, "engines.copy": mig.copy_engines, "engines.decoder": mig.decoders,
        "engines.encoder": mig.encoders, "engines.jpeg": mig.jpeg_engines, "engines.ofa": mig.ofa_engines}))
    return labels


def _resource_profile(mig: MigFacts) -> str:
    return mig.profile.replace("+", ".")  # nvmlMigDevice.GetName


def _gpu_labels(facts: NvmlFacts, sharing: TimeSlicingConfig) -> dict[str, str]:
    """`newGPULabelers`: MIG-enabled models without sharing first, whole-GPU models over them."""
    counts: dict[str, int] = {}
    mig_enabled: dict[str, GpuFacts] = {}
    whole: dict[str, GpuFacts] = {}
    for gpu in facts.gpus:
        counts[gpu.name] = counts.get(gpu.name, 0) + 1
        (mig_enabled if gpu.mig_enabled else whole)[gpu.name] = gpu
    labels: dict[str, str] = {}
    for name in sorted(mig_enabled):
        labels.update(_whole(mig_enabled[name], counts[name], None))
    for name in sorted(whole):
        labels.update(_whole(whole[name], counts[name], sharing))
    return labels


def _by_profile(facts: NvmlFacts) -> dict[str, tuple[GpuFacts, MigFacts, int]]:
    """Every MIG device of the node by resource profile name: (parent of the first, the first, count)."""
    found: dict[str, tuple[GpuFacts, MigFacts, int]] = {}
    for gpu in facts.gpus:
        for mig in gpu.mig_devices if gpu.mig_enabled else ():
            name = _resource_profile(mig)
            parent, first, count = found.get(name, (gpu, mig, 0))
            found[name] = (parent, first, count + 1)
    return found


def _single(facts: NvmlFacts, sharing: TimeSlicingConfig) -> dict[str, str]:
    enabled = [g for g in facts.gpus if g.mig_enabled]
    if not enabled:
        return {}
    profiles = _by_profile(facts)
    if any(not g.mig_devices for g in enabled) or len(enabled) != len(facts.gpus) or len(profiles) != 1:
        rl = _Resource(GPU_RESOURCE, None)
        return {**rl.values({"product": rl.product(enabled[0].name, "MIG", "INVALID")}),
                **rl.values({"count": 0, "replicas": 0, "sharing-strategy": "", "memory": 0})}
    (parent, first, count), = profiles.values()
    return _mig_resource(GPU_RESOURCE, parent.name, first, count, sharing)


def _mixed(facts: NvmlFacts, sharing: TimeSlicingConfig) -> dict[str, str]:
    labels: dict[str, str] = {}
    for name, (parent, first, count) in sorted(_by_profile(facts).items()):
        labels.update(_mig_resource(f"{PREFIX}mig-{name}", parent.name, first, count, sharing))
    return labels


def _versions(facts: NvmlFacts) -> dict[str, str]:
    parts = facts.driver_version.split(".")
    if not 2 <= len(parts) <= 3:
        raise GfdError(f'driver version "{facts.driver_version}" does not match format "X.Y[.Z]"')
    major, minor, rev = parts[0], parts[1], parts[2] if len(parts) > 2 else ""
    cuda_major, cuda_minor = facts.cuda_driver_version // 1000, facts.cuda_driver_version % 1000 // 10
    return {f"{PREFIX}{k}": v for k, v in {
        "cuda.driver.major": major, "cuda.driver.minor": minor, "cuda.driver.rev": rev,
        "cuda.runtime.major": str(cuda_major), "cuda.runtime.minor": str(cuda_minor),
        "cuda.driver-version.major": major, "cuda.driver-version.minor": minor,
        "cuda.driver-version.revision": rev, "cuda.driver-version.full": facts.driver_version,
        "cuda.runtime-version.major": str(cuda_major), "cuda.runtime-version.minor": str(cuda_minor),
        "cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}"}.items()}


def _mode(classes: tuple[str, ...]) -> str:
    seen = set(classes)
    return _MODES.get(next(iter(seen)), "unknown") if len(seen) == 1 else "unknown"


def _clique(facts: NvmlFacts) -> dict[str, str]:
    attached = [g.clique for g in facts.gpus if g.clique is not None]
    clusters, cliques = {c for c, _ in attached}, {q for _, q in attached}
    if len(clusters) != 1 or len(cliques) != 1:
        return {}
    return {f"{PREFIX}gpu.clique": f"{next(iter(clusters))}.{next(iter(cliques))}"}


def _vgpu(scan: VgpuCapability | None) -> dict[str, str]:
    if scan is None:
        return {}
    labels = {f"{PREFIX}vgpu.present": "true" if scan.present else "false"}
    if scan.present:
        labels[f"{PREFIX}vgpu.host-driver-version"] = scan.host_driver_version
        labels[f"{PREFIX}vgpu.host-driver-branch"] = scan.host_driver_branch
    return labels


def gfd_labels(facts: NvmlFacts, inputs: GfdInputs) -> dict[str, str]:
    """Every label GFD writes for these GPUs (none without GPUs); GfdError where GFD would fail."""
    if not facts.gpus:
        return {}
    if inputs.mig_strategy not in ("none", "single", "mixed"):
        raise GfdError(f"unknown MIG strategy {inputs.mig_strategy!r}")
    sharing = inputs.time_slicing or TimeSlicingConfig()
    labels = {f"{PREFIX}gpu.machine": sanitise(inputs.machine_type if inputs.machine_type is not None else "unknown")}
    labels.update(_versions(facts))
    labels[f"{PREFIX}mig.capable"] = "true" if any(g.mig_capable for g in facts.gpus) else "false"
    labels[f"{PREFIX}mps.capable"] = "false"  # the agent refuses MPS sharing
    labels.update(_gpu_labels(facts, sharing))
    if inputs.mig_strategy != "none":
        labels[f"{PREFIX}mig.strategy"] = inputs.mig_strategy
        labels.update(_single(facts, sharing) if inputs.mig_strategy == "single" else _mixed(facts, sharing))
    labels[f"{PREFIX}gpu.mode"] = _mode(inputs.gpu_classes)
    labels.update(_clique(facts))
    labels.update(_vgpu(inputs.vgpu))
    return labels
