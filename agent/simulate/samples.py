"""The simulated node's demo: a few containers admitted through the stand-in kubelet once the device plugin has
registered, and what they got, and how close (GPU-NIC levels), logged.

A client of the served device plugin, as the kubelet is: it sits above placement (whose levels it reports)
beside the composition root that runs it, not with the simulator's sources.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agent.placement.policy import achieved_levels
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.simulate.kubelet import LocalKubelet

log = logging.getLogger(__name__)


async def show_sample_allocations(kubelet: LocalKubelet, manager: DevicePluginManager, topology: Topology) -> None:
    """Admit 1, 2 and 4 of every served resource in turn, log what each container got, and release it."""
    resources = sorted(manager.resources)
    gpu_resources = [r for r in resources if manager.plugin(r).pool.kind == "gpu"]
    for size in (1, 2, 4):
        request = dict.fromkeys(resources, size)
        try:
            allocation = await kubelet.admit(request)
        except Exception as exc:  # a demo must never take the agent down
            log.warning("sample allocation of %s failed: %s", request, exc)
            return
        gpus = [i for r in gpu_resources for i in allocation.get(r, [])]
        nics = [i for r in resources if r not in gpu_resources for i in allocation.get(r, [])]
        hcas = [getattr(topology.find(i), "rdma", None) or i for i in nics]
        if gpus:
            indexes = [g.index for g in topology.gpus if g.uuid in gpus]
            levels = [level.name for level in achieved_levels(topology, gpus, nics)]
            log.info("sample allocation: %d GPU + %d NIC container got GPUs %s and HCAs %s; GPU-NIC levels %s",
                     size, size, indexes, hcas, levels)
        else:
            log.info("sample allocation: %d-NIC container (GPUs served elsewhere) got HCAs %s on PFs %s", size,
                     hcas, sorted({getattr(topology.find(i), "pf_bus_id", i) for i in nics}))
        kubelet.release(allocation)
