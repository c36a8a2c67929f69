"""The driver's MIG capability minors file, `/proc/driver/nvidia-caps/mig-minors`, for a simulated host.

Line format as the driver writes it and NVIDIA's MIG user guide ("Device Nodes and Capabilities") shows it:
`config 1`, `monitor 2`, then per GPU minor and GPU instance 0-14 `gpu<minor>/gi<G>/access <N>` followed by its
compute instances 0-7, `gpu<minor>/gi<G>/ci<C>/access <N>` (NVIDIA/k8s-device-plugin internal/mig reads it).
The minors are numbered in that order here.
"""

from __future__ import annotations

from pathlib import Path

GPU_INSTANCES = 15
COMPUTE_INSTANCES = 8


def write_mig_minors(path: Path, gpus: int) -> dict[str, int]:
    """Write the file for GPU minors 0..gpus-1; return the minors by name."""
    minors = {"config": 1, "monitor": 2}
    for gpu in range(gpus):
        for gi in range(GPU_INSTANCES):
            minors[f"gpu{gpu}/gi{gi}/access"] = len(minors) + 1
            for ci in range(COMPUTE_INSTANCES):
                minors[f"gpu{gpu}/gi{gi}/ci{ci}/access"] = len(minors) + 1
    path.write_text("".join(f"{name} {minor}\n" for name, minor in minors.items()))
    return minors
