"""The driver's MIG capability minors file, `/proc/driver/nvidia-caps/mig-minors`, as a simulated node carries it.

The NVIDIA driver writes it whenever it is loaded, MIG mode or not: `config 1`, `monitor 2`, then per GPU minor
and GPU instance 0-14 `gpu<minor>/gi<G>/access <N>` followed by that instance's compute instances 0-7,
`gpu<minor>/gi<G>/ci<C>/access <N>`, numbered in that order (so `gpu0/gi1/access 12`, `gpu0/gi1/ci0/access 13`,
as NVIDIA's MIG user guide, "Device Nodes and Capabilities", shows). NVIDIA's plugin turns those minors into
`/dev/nvidia-caps/nvidia-cap<N>` nodes for a MIG device; a simulated node without the file would pass none.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from agent.host.driver_files import mig_minors_path

GPU_INSTANCES = 15
COMPUTE_INSTANCES = 8


def mig_minors(gpu_minors: Iterable[int]) -> dict[str, int]:
    """The file's entries, in the driver's order, for these GPU minors."""
    minors = {"config": 1, "monitor": 2}
    per_gpu = GPU_INSTANCES * (1 + COMPUTE_INSTANCES)
    for gpu in sorted(set(gpu_minors)):
        first = 3 + gpu * per_gpu  # numbered by minor, so a gap in the minors leaves a gap in the numbers
        for gi in range(GPU_INSTANCES):
            base = first + gi * (1 + COMPUTE_INSTANCES)
            minors[f"gpu{gpu}/gi{gi}/access"] = base
            for ci in range(COMPUTE_INSTANCES):
                minors[f"gpu{gpu}/gi{gi}/ci{ci}/access"] = base + 1 + ci
    return minors


def write_mig_minors(proc_root: Path, gpu_minors: Iterable[int]) -> Path:
    """Write the file under `proc_root` (which plays /proc); its path."""
    path = Path(mig_minors_path(proc_root))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{name} {minor}\n" for name, minor in mig_minors(gpu_minors).items()),
                    encoding="ascii")
    return path
